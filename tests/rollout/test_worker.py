"""The engine process (`rollout.max_staleness` >= 1): the staleness bound, rounds in order, training, resume mid-flight,
an engine process that dies or fails. The engine process runs the scripted agent and a recording engine
(`dspo.testing`), so each start costs a Python start-up, not an engine's."""

from __future__ import annotations

import os
import queue
import signal
import time
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from dspo.algorithms.config import AlgorithmConfig
from dspo.callbacks.rollout_callback import RolloutCallback
from dspo.data.datamodule import PromptSampler
from dspo.models import ModelConfig
from dspo.rollout.engine_process import EngineProcess, EngineProcessDied, EngineProcessError
from dspo.rollout.placement import colocated_device, engine_devices_for, split_cores
from dspo.rollout.producer import staleness_stats
from dspo.testing import (
    recording_engine,
    report_environment_agent,
    toy_items,
    toy_run,
    weights_echo_agent,
    worker_spec,
)
from dspo.types import QAItem, RolloutGroup, Trajectory


# ------------------------------------------------------------------------------------------------- pure parts
def test_split_cores_gives_the_engine_its_share_and_the_trainer_the_rest():
    assert split_cores(None, [0, 1]) == ([0], [1])
    assert split_cores(None, [0, 1, 2, 3]) == ([0, 1], [2, 3])
    assert split_cores(1, [0, 1, 2, 3]) == ([0, 1, 2], [3])
    assert split_cores(None, [5]) == ([5], [5])  # one core: shared, only thread counts split
    assert split_cores(None, [0, 1], local_processes=2) == ([0, 1], [0, 1])  # ranks share the mask
    assert split_cores(4, [0, 1, 2, 3]) == ([0, 1, 2, 3], [0, 1, 2, 3])  # nothing left for the trainer: shared
    with pytest.raises(ValueError, match="rollout.engine_threads=0"):
        split_cores(0, [0, 1])


def _group(versions: list[int]) -> RolloutGroup:
    item = QAItem(id="q", question="q", golden_answers=["a"])
    return RolloutGroup(item, [Trajectory([1], [2], [1], [0.0], policy_version=v) for v in versions])


def test_staleness_is_the_rounds_between_sampling_weights_and_the_round_trained():
    stats = staleness_stats([_group([3, 3]), _group([2, 2])], round_index=4)  # ages 1, 1, 2, 2
    assert stats == {"rollout/staleness_mean": 1.5, "rollout/staleness_max": 2.0}
    assert staleness_stats([_group([4])], 4) == {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_staleness": -1}, "rollout.max_staleness=-1"),
        ({"max_staleness": 1.5}, "rollout.max_staleness=1.5"),
        ({"max_staleness": True}, "rollout.max_staleness=True"),
        ({"max_staleness": 1, "engine_threads": 0}, "rollout.engine_threads=0"),
        ({"partial_rollouts": True}, "partial_rollouts=true needs rollout.max_staleness >= 1"),
        ({"partial_rollouts": "yes", "max_staleness": 1}, "rollout.partial_rollouts='yes'"),
        ({"max_staleness": 1, "max_token_age": 3}, "rollout.max_token_age is set but"),
        ({"max_staleness": 2, "partial_rollouts": True, "max_token_age": 2}, "rollout.max_token_age=2"),
        ({"max_staleness": 1, "partial_rollouts": True, "agent": {"overflow": "compact"}}, "overflow=compact"),
    ],
)
def test_bad_staleness_settings_are_refused_at_build_time(kwargs, message):
    agent = kwargs.pop("agent", None)
    with pytest.raises(ValueError, match=message):
        RolloutCallback(None, agent, None, AlgorithmConfig(), ModelConfig(path="unused"), **kwargs)


def test_partial_rollouts_default_to_one_round_more_than_max_staleness():
    from dspo.rollout.settings import check_partial

    assert check_partial(False, None, 1) is None
    assert check_partial(True, None, 1) == 2 and check_partial(True, 4, 2) == 4


def test_a_round_outside_its_bounds_is_refused():
    from dspo.rollout.engine_process import check_round_bounds
    from dspo.rollout.messages import SampledRound

    carried = _group([1, 1])  # oldest tokens from the weights after 1 round
    check_round_bounds(SampledRound(3, [carried], {}, weights_round=2), max_staleness=1, max_token_age=2)
    with pytest.raises(RuntimeError, match="max token age 1"):  # without partial rollouts, max_staleness bounds both
        check_round_bounds(SampledRound(3, [carried], {}, weights_round=2), max_staleness=1, max_token_age=None)
    with pytest.raises(RuntimeError, match="rollout.max_staleness=1"):
        check_round_bounds(SampledRound(3, [_group([1])], {}, weights_round=1), max_staleness=1, max_token_age=2)


def test_an_engine_that_sleeps_during_the_update_cannot_run_ahead_of_it():
    from functools import partial

    engine = partial(recording_engine, sleep_during_update=True)
    with pytest.raises(ValueError, match="sleep_during_update=true with rollout.max_staleness>=1"):
        RolloutCallback(engine, None, None, AlgorithmConfig(), ModelConfig(path="unused"), max_staleness=1)


# ------------------------------------------------------------------------------------------------- the process
@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_rounds_run_ahead_by_at_most_k_and_wait_for_the_weights_they_need():
    """k = 1: rounds 0 and 1 come from the initial weights; round 2 waits for the weights after round 1 and carries
    their round count as every trajectory's policy_version, and the engine holds exactly the pushed tensors (shared
    memory, the default transport). Then the process is killed: the trainer's wait says so."""
    import json

    worker = EngineProcess(worker_spec(max_staleness=1, agent=weights_echo_agent))
    weights = [("w", torch.zeros(3))]
    try:
        worker.start(PromptSampler(toy_items(), seed=0), None, 0, weights)
        worker.push_weights(weights, 0, 0, (0, 10))
        first, second = worker.take_round(0)[0], worker.take_round(1)[0]
        assert (first.weights_round, second.weights_round) == (0, 0)
        with pytest.raises(queue.Empty):  # round 2 would be 2 rounds stale: not generated
            worker.results.get(timeout=2.0)
        worker.push_weights([("w", torch.ones(3))], 1, 1, (1, 10))
        third, _ = worker.take_round(2)
        assert third.weights_round == 1
        echoes = [json.loads(r.groups[0].trajectories[0].response_text) for r in (first, second, third)]
        assert echoes == [{"version": 0, "loads": 1, "sums": {"w": 0.0}}] * 2 + [
            {"version": 1, "loads": 2, "sums": {"w": 3.0}}
        ]
        assert {t.policy_version for g in third.groups for t in g.trajectories} == {1}
        # each round records where the next one starts (over-sampled prompts included): a sampler set to the previous
        # round's end state draws this round's prompts first
        start = PromptSampler(toy_items(), seed=0).state_dict()
        for sampled in (first, second, third):
            sampler = PromptSampler(toy_items(), seed=0)
            sampler.load_state_dict(start)
            assert [g.item.id for g in sampled.groups] == [item.id for _, item in sampler.take(len(sampled.groups))]
            start = sampled.sampler_state
        assert (start["epoch"], start["position"]) > (0, 6)  # three rounds of 2 groups, with over-sampling
        os.kill(worker.pid, signal.SIGKILL)  # killed (the OOM killer's signal) while the trainer waits for it
        with pytest.raises(EngineProcessDied, match=r"exited with code -9 while the trainer waited for round 5"):
            worker.take_round(5)
    finally:
        worker.close()
    assert worker.process is None


def _listening(pid: int) -> list[str]:
    """The addresses `pid`'s listening TCP sockets are bound to."""
    import psutil

    return [c.laddr.ip for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_weights_reach_the_engine_process_exactly_over_a_gloo_group():
    """`rollout.weight_transfer=gloo`: a two-member group between the trainer and its engine process (the code path
    NCCL takes on GPUs; shared memory is checked in the test above). The engine loads the pushed tensors exactly
    (two dtypes), once per new version: a push of the round count only (a skipped step) moves the bound without
    reloading. A killed engine process ends the run with `EngineProcessDied`, whether the push or the wait notices."""
    import json

    worker = EngineProcess(worker_spec(max_staleness=1, agent=weights_echo_agent, weight_transfer="gloo"))
    initial = [("a", torch.zeros(3)), ("b", torch.zeros(2, 2, dtype=torch.float64))]
    trained = [("a", torch.tensor([0.5, 1.25, 2.0])), ("b", torch.full((2, 2), 0.1, dtype=torch.float64))]

    def echo(index: int) -> dict:
        sampled, _ = worker.take_round(index)
        return {**json.loads(sampled.groups[0].trajectories[0].response_text), "round": sampled.weights_round}

    try:
        worker.start(PromptSampler(toy_items(), seed=0), None, 0, initial)
        worker.push_weights(initial, 0, 0, (0, 10))
        zeros = {"a": 0.0, "b": 0.0}
        assert [echo(0), echo(1)] == [{"version": 0, "loads": 1, "sums": zeros, "round": 0}] * 2
        worker.push_weights(trained, 1, 1, (1, 10))
        worker.push_weights(None, 2, 1, (2, 10))  # a skipped step: same weights, one more round completed
        sums = {"a": 3.75, "b": float(torch.full((2, 2), 0.1, dtype=torch.float64).sum())}
        assert echo(2)["sums"] == sums
        assert echo(3) == {"version": 1, "loads": 2, "sums": sums, "round": 2}
        # issue 39 (2): no socket of the transfer (its store, the gloo pairs) listens beyond this host
        assert _listening(os.getpid()) and _listening(worker.pid)
        assert all(ip in ("127.0.0.1", "::1") for ip in _listening(os.getpid()) + _listening(worker.pid))
        os.kill(worker.pid, signal.SIGKILL)  # the peer of the group is gone: the push or the next wait says so
        with pytest.raises(EngineProcessDied, match="exited with code -9 while the trainer"):
            worker.push_weights(trained, 3, 2, (3, 10))
            worker.take_round(4)
    finally:
        worker.close()
    assert worker.process is None


def test_weight_transfer_settings_are_checked():
    from dspo.rollout.transfer import check_transfer

    assert check_transfer("gloo", colocated=True, cuda=False) == "gloo"
    assert check_transfer("nccl", colocated=False, cuda=True) == "nccl"
    with pytest.raises(ValueError, match="rollout.weight_transfer='ipc': use one of shared_memory, gloo, nccl"):
        check_transfer("ipc")
    with pytest.raises(ValueError, match="nccl needs the trainer on CUDA GPUs; on CPU use gloo or shared_memory"):
        check_transfer("nccl", colocated=False, cuda=False)
    with pytest.raises(ValueError, match="NCCL cannot join two processes on one GPU.*rollout.engine_devices"):
        check_transfer("nccl", colocated=True, cuda=True)
    with pytest.raises(ValueError, match="rollout.weight_transfer='ipc'"):
        RolloutCallback(None, None, None, AlgorithmConfig(), ModelConfig("m"), weight_transfer="ipc")
    from functools import partial

    from dspo.engines import VLLMEngine
    from dspo.rollout.engine_process import _engine_dtype
    from dspo.rollout.transfer import CollectiveTransfer

    # floating tensors travel in the engine's dtype (rollout.engine.dtype), integers as they are
    assert _engine_dtype(partial(VLLMEngine, dtype="bfloat16")) == torch.bfloat16
    assert _engine_dtype(recording_engine) is None
    wire = CollectiveTransfer("gloo", wire_dtype=torch.bfloat16)
    assert (wire._wire(torch.float32), wire._wire(torch.int64)) == (torch.bfloat16, torch.int64)
    if not torch.cuda.is_available():  # a CPU build of torch has no NCCL: the group says so, naming the way out
        with pytest.raises(RuntimeError, match="this torch build has no NCCL .*use gloo"):
            CollectiveTransfer("nccl").group_type()


# ------------------------------------------------------------------------------------------------- training
class RoundLog(pl.Callback):
    """Per round: the prompts and the policy versions that sampled them (read from the environment callback)."""

    def __init__(self, environment: RolloutCallback) -> None:
        self.environment, self.rounds = environment, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        groups = self.environment.producer.state.current.groups
        versions = sorted({t.policy_version for g in groups for t in g.trajectories})
        self.rounds.append(([g.item.id for g in groups], versions))


def _fit(
    lm_dir: str,
    root: Path,
    steps: int,
    max_staleness: int,
    ckpt_path: str | None = None,
    every: int = 0,
    in_flight: bool = True,
):
    extra = (ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1),) if every else ()
    run = toy_run(lm_dir, str(root), steps, max_staleness=max_staleness, callbacks=extra)
    producer = run.callback.producer
    producer.spec = replace(producer.spec, in_flight=in_flight)  # checkpointing.in_flight
    log = RoundLog(run.callback)
    run.trainer.callbacks.append(log)
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)
    return run, log


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_one_round_ahead_trains_on_the_same_prompts_one_round_stale(lm_dir, tmp_path):
    """k = 1 changes which weights sample a round, not which prompts it takes: rounds 0 and 1 come from the initial
    weights, round r >= 1 from the weights after round r - 1; the engine process is gone after fit."""
    _, sync_log = _fit(lm_dir, tmp_path / "k0", 4, max_staleness=0)
    run, log = _fit(lm_dir, tmp_path / "k1", 4, max_staleness=1)
    assert run.trainer.global_step == 4 and run.module.weights_version == 4
    assert [versions for _, versions in log.rounds] == [[0], [0], [1], [2]]
    assert [versions for _, versions in sync_log.rounds] == [[0], [1], [2], [3]]
    assert [ids for ids, _ in log.rounds] == [ids for ids, _ in sync_log.rounds]
    assert run.callback.producer.side.worker is None
    from safetensors.torch import load_file

    start, end = load_file(str(Path(lm_dir) / "model.safetensors")), run.module.policy.state_dict()
    assert any(not torch.equal(start[name], end[name]) for name in start)  # the policy trained


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
@pytest.mark.parametrize("in_flight", [True, False])
def test_a_checkpoint_taken_mid_flight_resumes_to_the_same_step_count_and_prompts(lm_dir, tmp_path, in_flight):
    """With checkpointing.in_flight (the default) the round generated ahead is in the checkpoint and trained first,
    sampled by the weights it was sampled by (issue 74); without, the resumed run regenerates it from the saved start
    state (same prompts) at the restored weights. Either way it reaches the same step count."""
    _, full = _fit(lm_dir, tmp_path / "full", 4, max_staleness=1, every=1)
    checkpoint = next((tmp_path / "full" / "ckpt").glob("*step=2*.ckpt"))
    resumed, log = _fit(lm_dir, tmp_path / "resumed", 4, 1, ckpt_path=str(checkpoint), in_flight=in_flight)
    assert resumed.trainer.global_step == 4
    assert [ids for ids, _ in log.rounds] == [ids for ids, _ in full.rounds[2:]]
    # stored: as the run never stopped; regenerated at the restored weights, then k = 1
    assert [versions for _, versions in log.rounds] == ([[1], [2]] if in_flight else [[2], [2]])


class KillEngine(pl.Callback):
    def __init__(self, environment: RolloutCallback, at_step: int) -> None:
        self.environment, self.at_step = environment, at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            os.kill(self.environment.producer.side.worker.pid, signal.SIGKILL)


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_an_engine_process_that_dies_ends_the_run_with_a_failure_checkpoint(lm_dir, tmp_path):
    from dspo.train import fit_or_checkpoint

    run = toy_run(lm_dir, str(tmp_path), 6, max_staleness=1)
    run.trainer.callbacks.append(KillEngine(run.callback, at_step=2))
    with pytest.raises(EngineProcessDied, match="exited with code -9"):
        fit_or_checkpoint(run.trainer, run.module, run.datamodule, None)
    assert (tmp_path / "checkpoints" / "failure.ckpt").is_file()
    # killed after step 2: round 2 may already have been generated (one round ahead), round 3 never is
    assert run.trainer.global_step in (2, 3) and run.callback.producer.side.worker is None


def test_engine_devices_give_each_local_rank_its_own_engine_gpus():
    assert engine_devices_for(None, 0, 4) is None
    assert [engine_devices_for([4, 5, 6, 7], rank, 4) for rank in range(4)] == ["4", "5", "6", "7"]
    assert engine_devices_for(["2, 3"], 0, 1) == "2,3"  # one engine over two GPUs (tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"names 2 engine device\(s\) for 4 local rank\(s\)"):
        engine_devices_for([4, 5], 0, 4)
    with pytest.raises(ValueError, match=r"rollout.engine_devices\[0\]='cuda:4'"):
        engine_devices_for(["cuda:4"], 0, 1)


def test_a_colocated_engine_process_sits_on_its_ranks_gpu():
    from types import SimpleNamespace

    assert colocated_device(torch.device("cpu"), None) is None
    assert colocated_device(SimpleNamespace(type="cuda", index=1), None) == "1"
    assert colocated_device(SimpleNamespace(type="cuda", index=1), "2, 3") == "3"  # system index under the rank's mask
    assert colocated_device(SimpleNamespace(type="cuda", index=None), "5") == "5"
    with pytest.raises(ValueError, match="cuda:2 is not among CUDA_VISIBLE_DEVICES='0,1'"):
        colocated_device(SimpleNamespace(type="cuda", index=2), "0,1")


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_the_engine_process_runs_on_its_devices_and_a_failed_start_brings_its_traceback():
    worker = EngineProcess(worker_spec(visible_devices="7", agent=report_environment_agent))
    try:
        with pytest.raises(EngineProcessError, match="the engine to start") as error:
            worker.start(None, None, 0, [("w", torch.zeros(1))])
        assert "Traceback" in str(error.value) and "engine process sees CUDA_VISIBLE_DEVICES=7" in str(error.value)
    finally:
        process = worker.process
        worker.close()
    assert (
        process.exitcode == 0
    )  # it ended by itself once its error was sent (dspo.process.runtime.end_process), not killed


class Preempt(pl.Callback):
    def __init__(self, environment: RolloutCallback, at_step: int) -> None:
        self.environment, self.at_step, self.engine_pid = environment, at_step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at_step:
            self.engine_pid = self.environment.producer.side.worker.pid
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_preemption_saves_at_the_round_end_and_stops_the_engine_process(lm_dir, tmp_path):
    from dspo.callbacks.checkpoints import PreemptionCheckpoint

    saver = PreemptionCheckpoint(str(tmp_path / "ckpt"), steps_per_round=1)
    run = toy_run(lm_dir, str(tmp_path), 50, max_staleness=1, callbacks=(saver,))
    preempt = Preempt(run.callback, at_step=2)
    run.trainer.callbacks.append(preempt)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    # Preempt was appended after the Trainer put its checkpoint callbacks last, so the saver checked step 2's end
    # before the signal arrived: the next round (step 3) ends, is saved, and the run stops
    assert run.trainer.global_step == 3 and saver.saved_to == str(tmp_path / "ckpt" / "last.ckpt")
    assert torch.load(saver.saved_to, weights_only=False)["global_step"] == 3
    assert run.callback.producer.side.worker is None
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(preempt.engine_pid, 0)


ORPHAN = """
import sys, time, torch
from dspo.algorithms.config import AlgorithmConfig
from dspo.data.datamodule import PromptSampler
from dspo.models import ModelConfig
from dspo.rollout.spec import WorkerSpec
from dspo.rollout.engine_process import EngineProcess
from dspo.testing import StandInTokenizer, recording_engine, scripted_agent, toy_items

if __name__ == "__main__":
    algorithm = AlgorithmConfig(group_size=4, batch_groups=2, micro_batch_size=3)
    model = ModelConfig(path="unused")
    spec = WorkerSpec(recording_engine, scripted_agent, None, algorithm, model, 0, 1, tokenizer=StandInTokenizer())
    worker = EngineProcess(spec)
    worker.start(PromptSampler(toy_items(), seed=0), None, 0, [("w", torch.zeros(1))])
    worker.push_weights(None, 0, 0, (0, 1))
    worker.take_round(0)
    print(worker.pid, flush=True)
    time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whatever adopted it, maybe later)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_an_engine_process_whose_trainer_is_killed_exits_by_itself(tmp_path):
    import subprocess
    import sys
    import time

    script = tmp_path / "trainer.py"
    script.write_text(ORPHAN)
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(trainer.stdout.readline())
        trainer.kill()  # SIGKILL: no clean-up runs in the trainer
        trainer.wait(timeout=30)
        deadline = time.time() + 20
        while time.time() < deadline:
            if not _running(engine_pid):
                return
            time.sleep(0.2)
        raise AssertionError(f"engine process {engine_pid} still alive 20 s after its trainer was killed")
    finally:
        trainer.kill()


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_the_engine_processs_children_end_with_it_when_it_is_killed_mid_round(tmp_path, monkeypatch):
    """Issue 53 (6): a tool's child process (as vLLM's tensor-parallel workers or a tool's pool) outlived an engine
    process killed mid-round: orphaned, it kept its memory. `close` now ends the engine process's whole group."""
    from dspo.testing import child_agent

    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("DSPO_TEST_CHILD_PID", str(pid_file))
    worker = EngineProcess(worker_spec(max_staleness=1, agent=child_agent))
    try:
        worker.start(PromptSampler(toy_items(), seed=0), None, 0, [("w", torch.zeros(1))])
        child = int(pid_file.read_text())
        worker.push_weights(None, 0, 0, (0, 1))
        worker.take_round(0)  # round 1 is now generating, for a minute
        assert _running(child)
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessDied, match="exited with code -9"):
            worker.take_round(1)
    finally:
        worker.close()
    deadline = time.monotonic() + 5
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child), f"the tool's child {child} outlived its engine process"
