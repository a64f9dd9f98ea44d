"""Issue 38: the run-ahead path (`rollout.max_staleness` >= 1) under faults, each injected at a named point
(`dspo.rollout.faults`, `DSPO_FAULT`). Every wait runs under a deadline: a hang fails the test instead of the suite.
The engine process runs the scripted agent and a recording engine (`dspo.testing`). Two ranks failing apart are in
tests/training/test_module_distributed.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dspo.algorithms.config import AlgorithmConfig
from dspo.data.datamodule import PromptSampler
from dspo.models import ModelConfig
from dspo.rollout.engine_process import EngineProcess, EngineProcessDied
from dspo.rollout.faults import FaultInjected, fault_point, parse_faults
from dspo.rollout.transfer import PeerGone, SharedMemoryTransfer
from dspo.testing import recording_engine, toy_items, toy_run, worker_spec
from dspo.testing import within as _within

REPO = Path(__file__).resolve().parents[2]


def _segments() -> set[str]:
    """Named shared-memory segments of torch and multiprocessing (what an orphan could leave behind)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if p.name.startswith(("torch_", "sem.mp", "psm_"))} if shm.is_dir() else set()


# ------------------------------------------------------------------------------------------------- the harness
def test_fault_specs_name_a_point_a_rank_a_hit_and_an_action(monkeypatch):
    (fault,) = parse_faults("engine.mid_load@1#3=raise")
    assert (fault.point, fault.rank, fault.hit, fault.action) == ("engine.mid_load", 1, 3, "raise")
    assert parse_faults("trainer.take")[0].action == "kill"
    for bad in ("engine.nowhere", "trainer.take=explode", "trainer.take#x", "trainer.take@one"):
        with pytest.raises(ValueError, match="DSPO_FAULT"):
            parse_faults(bad)
    monkeypatch.setenv("DSPO_FAULT", "trainer.take@1#2=raise")
    monkeypatch.setenv("RANK", "1")
    fault_point("trainer.take")  # hit 1: nothing
    with pytest.raises(FaultInjected, match="trainer.take on rank 1"):
        fault_point("trainer.take")
    monkeypatch.setenv("RANK", "0")
    fault_point("trainer.take")  # another rank: nothing
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("LOCAL_RANK", "1")  # Lightning's own DDP launcher sets only LOCAL_RANK
    monkeypatch.setenv("DSPO_FAULT", "trainer.push@1=raise")
    with pytest.raises(FaultInjected, match="trainer.push on rank 1"):
        fault_point("trainer.push")


# ------------------------------------------------------------------------------------------------- point 2
def _hold_and_die(lock) -> None:
    lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_weights_lock_left_held_by_a_killed_process_ends_either_sides_wait():
    """A process killed while it held the shared-memory lock never releases it: the trainer's send and the engine's
    receive end with `PeerGone` once they see their peer is gone (a blocking acquire waited forever)."""
    context = torch.multiprocessing.get_context("spawn")
    transfer = SharedMemoryTransfer(context)
    transfer.allocate([("w", torch.zeros(2))])
    holder = context.Process(target=_hold_and_die, args=(transfer.lock,))
    holder.start()
    holder.join(30)
    assert holder.exitcode == -signal.SIGKILL
    transfer.connect_trainer(holder.is_alive)
    with pytest.raises(PeerGone, match="send weights"):
        _within(10, lambda: transfer.send([("w", torch.ones(2))], 1, 1, 1))
    transfer.peer_alive = holder.is_alive  # the engine side, whose trainer died mid-send
    with pytest.raises(PeerGone, match="receive weights"):
        _within(10, lambda: transfer.receive(1, lambda named, version: None, None))


@pytest.mark.slow  # spawns an engine process per case (a Python start-up, seconds)
@pytest.mark.parametrize(
    "fault",
    [
        "engine.holding_weights#2",  # the lock held: hung before issue 38
        "engine.mid_load#2",  # inside the engine's load, the lock held: hung before issue 38
        "engine.generating#3",  # not a defect before either: the trainer's wait for the round notices
        "engine.waiting#3",  # not a defect before either: the next wait notices (#3: after push 2, so after step 1)
    ],
)
def test_the_trainer_ends_with_a_failure_checkpoint_wherever_the_engine_process_is_killed(
    lm_dir, tmp_path, monkeypatch, fault
):
    """Killed at each point, the engine process ends the run within 60 s (measured: under 10 s) with an error naming
    it and a failure checkpoint."""
    from dspo.train import fit_or_checkpoint

    monkeypatch.setenv("DSPO_FAULT", fault)  # inherited by the engine process at spawn
    run = toy_run(lm_dir, str(tmp_path), 8, max_staleness=1)
    with pytest.raises(EngineProcessDied, match=r"engine process \(pid \d+\) exited with code -9"):
        _within(60, lambda: fit_or_checkpoint(run.trainer, run.module, run.datamodule, None))
    assert (tmp_path / "checkpoints" / "failure.ckpt").is_file()
    assert run.trainer.global_step >= 1 and run.callback.producer.side.worker is None


ORPHAN = """
import sys, time, torch
from dspo.algorithms.config import AlgorithmConfig
from dspo.data.datamodule import PromptSampler
from dspo.models import ModelConfig
from dspo.rollout.spec import WorkerSpec
from dspo.rollout.engine_process import EngineProcess
from dspo.testing import StandInTokenizer, recording_engine, slow_agent, toy_items

if __name__ == "__main__":
    algorithm = AlgorithmConfig(group_size=4, batch_groups=2, micro_batch_size=3)
    spec = WorkerSpec(
        recording_engine, slow_agent, None, algorithm, ModelConfig(path="unused"), 0, 1, tokenizer=StandInTokenizer()
    )
    worker = EngineProcess(spec)
    worker.start(PromptSampler(toy_items(), seed=0), None, 0, [("w", torch.zeros(4)), ("v", torch.zeros(4))])
    worker.push_weights(None, 0, 0, (0, 1))
    worker.take_round(0)  # round 1 is now generating, slowly (a minute)
    print(worker.pid, flush=True)
    worker.push_weights([("w", torch.ones(4)), ("v", torch.ones(4))], 1, 1, (1, 1))  # DSPO_FAULT kills us mid-send
    time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_an_engine_process_orphaned_mid_generation_exits_at_once_and_leaves_no_shared_memory(tmp_path):
    """The trainer is killed mid-send, the weights lock held, while its engine process generates a minute-long round:
    the engine process exits within 10 s (its own watch of the trainer), not after the round (60 s)."""
    before = _segments()
    script = tmp_path / "trainer.py"
    script.write_text(ORPHAN)
    env = {**os.environ, "DSPO_FAULT": "trainer.mid_send#1"}
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        engine_pid = int(trainer.stdout.readline())
        assert trainer.wait(timeout=60) == -signal.SIGKILL  # killed itself at the fault point
        deadline = time.time() + 10
        while _running(engine_pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not _running(engine_pid), "the orphaned engine process is still running"
        # the trainer's named semaphores (its queues, the weights lock) go with the last process that used them
        while not _segments() <= before and time.time() < deadline + 10:
            time.sleep(0.2)
        assert _segments() <= before
    finally:
        trainer.kill()
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(engine_pid, signal.SIGKILL)


LEFT_OPEN = """
import sys, torch
from dspo.data.datamodule import PromptSampler
from dspo.rollout.engine_process import EngineProcess
from dspo.testing import toy_items, worker_spec

if __name__ == "__main__":
    worker = EngineProcess(worker_spec())
    worker.start(PromptSampler(toy_items(), seed=0), None, 0, [("w", torch.zeros(1))])
    worker.push_weights(None, 0, 0, (0, 1))
    worker.take_round(0)
    print(worker.pid, flush=True)
    sys.exit(0)  # no close(): a script or notebook that drove the engine process itself
"""


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_a_trainer_that_exits_without_closing_its_engine_process_still_exits(tmp_path):
    """The engine process is not daemonic: multiprocessing's exit hook would join it for ever (it waits for its
    trainer, which is alive and waiting in that join). dspo's own exit hook ends it first."""
    script = tmp_path / "left_open.py"
    script.write_text(LEFT_OPEN)
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        engine_pid = int(trainer.stdout.readline())
        assert trainer.wait(timeout=30) == 0
        assert not _running(engine_pid)
    finally:
        trainer.kill()


# ------------------------------------------------------------------------------------------------- points 3, 5, 7, 9
@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_the_engine_process_may_start_child_processes():
    """vLLM's multiprocess executor (tensor_parallel_size > 1) and process-pool tools start children there; a daemonic
    engine process could not ("daemonic processes are not allowed to have children")."""
    from dspo.testing import parent_agent

    worker = EngineProcess(worker_spec(agent=parent_agent))
    try:
        worker.start(PromptSampler(toy_items(), seed=0), None, 0, [("w", torch.zeros(1))])
        worker.push_weights(None, 0, 0, (0, 1))
        assert worker.take_round(0)[0].groups
    finally:
        worker.close()


FILTER_MODULE = """
import torch
from dspo.algorithms import register_filter

@register_filter("keep_all_issue38", keeps_everything=True)
def keep_all_issue38(rewards):
    return torch.ones(rewards.shape[0], dtype=torch.bool)
"""


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_user_plugins_registered_by_imports_exist_in_the_engine_process(tmp_path, monkeypatch):
    """`imports=[my_filter] algorithm.filter=my_filter rollout.max_staleness=1`: the engine process imports the run's
    modules before it builds the filter (it failed with an unknown filter)."""
    import importlib

    (tmp_path / "my_filter_issue38.py").write_text(FILTER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned process gets this sys.path
    importlib.import_module("my_filter_issue38")  # as dspo-train does in the trainer
    algorithm = AlgorithmConfig(group_size=4, batch_groups=2, micro_batch_size=3, filter="keep_all_issue38")
    worker = EngineProcess(worker_spec(algorithm=algorithm, imports=("my_filter_issue38",)))
    try:
        worker.start(PromptSampler(toy_items(), seed=0), None, 0, [("w", torch.zeros(1))])
        worker.push_weights(None, 0, 0, (0, 1))
        assert len(worker.take_round(0)[0].groups) == 2
    finally:
        worker.close()


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_closing_with_unread_rounds_in_the_pipe_ends_the_engine_process_promptly():
    """k = 2 with rounds of MBs that nobody takes: the engine process exits with code 0 within a second of `close`
    (it waited 2 s for its queue's feeder and was killed, code -9)."""
    from dspo.testing import bulky_agent

    worker = EngineProcess(worker_spec(max_staleness=2, agent=bulky_agent))
    worker.start(PromptSampler(toy_items(), seed=0), None, 0, [("w", torch.zeros(1))])
    worker.push_weights(None, 0, 0, (0, 1))
    worker.take_round(0)
    time.sleep(3.0)  # rounds 1 and 2 generated: their bytes fill the pipe
    process, started = worker.process, time.perf_counter()
    worker.close()
    assert process.exitcode == 0 and time.perf_counter() - started < 1.5


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_the_environment_is_built_in_the_engine_process_from_its_config(tmp_path):
    """At k >= 1 the trainer passes the `env` config, not the environment (an in-memory index was pickled and held
    twice); at k = 0 the environment is built in the trainer, when the callback is."""
    from dspo.callbacks.rollout_callback import RolloutCallback
    from dspo.env.spec import EnvironmentSpec

    built_in = tmp_path / "pids.txt"
    spec = EnvironmentSpec({"_target_": "dspo.testing.PidEnvironment", "path": str(built_in)})
    algorithm, model = AlgorithmConfig(), ModelConfig(path="unused")
    RolloutCallback(recording_engine, None, spec, algorithm, model, max_staleness=1)
    assert not built_in.exists()  # the trainer side keeps the config
    worker = EngineProcess(worker_spec(env=spec))
    try:
        worker.start(PromptSampler(toy_items(), seed=0), None, 0, [("w", torch.zeros(1))])
        assert built_in.read_text().split() == [str(worker.pid)] and worker.credit == "trajectory"
    finally:
        worker.close()
    RolloutCallback(recording_engine, None, spec, algorithm, model, max_staleness=0)
    assert built_in.read_text().split() == [str(worker.pid), str(os.getpid())]


# ------------------------------------------------------------------------------------------------- point 8
def test_an_engine_on_a_gpu_leaves_the_trainer_all_its_cores(monkeypatch):
    from dspo.rollout import placement

    calls: list = []
    monkeypatch.setattr(placement.os, "sched_setaffinity", lambda *args: calls.append(("affinity", args)))
    monkeypatch.setattr(placement.torch, "set_num_threads", lambda n: calls.append(("threads", n)))
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    threads, cores, restore = placement.share_the_cpu("split", None, 1, engine_on_cpu=False)
    assert calls == [] and cores is None and threads == 1 and restore[0] is None
    placement.share_the_cpu("split", None, 1)  # a CPU engine: split as before
    assert calls == [("affinity", (0, [0, 1])), ("threads", 2)]


# ------------------------------------------------------------------------------------------------- point 6
class _FailsAtStep:
    """Mixed into DSPOModule: the first mini-batch of round 2 runs out of memory (k = 1's failure case)."""

    def training_step(self, slot, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("CUDA out of memory (injected)")
        return super().training_step(slot, batch_idx)


def _sampler_state(path: Path) -> dict:
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    (key,) = [k for k in checkpoint if k.endswith("RolloutDataModule")]
    return checkpoint[key]["sampler"]


@pytest.mark.slow  # trains a few steps (and spawns an engine process at k = 1)
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_failure_checkpoint_keeps_the_prompts_of_the_round_it_did_not_train(lm_dir, tmp_path, max_staleness):
    """Round 2 fails before its first step is trained (k = 0: its generation fails; k = 1: its first mini-batch runs
    out of memory): the failure checkpoint's prompt sampler is where round 2 starts, as in an uninterrupted run's
    step-2 checkpoint, so a resume trains round 2's prompts (it skipped to round 3's)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dspo.train import fit_or_checkpoint
    from dspo.training.module import DSPOModule

    every = ModelCheckpoint(dirpath=tmp_path / "full" / "ckpt", every_n_train_steps=1, save_top_k=-1)
    full = toy_run(lm_dir, str(tmp_path / "full"), 3, max_staleness=max_staleness, callbacks=(every,))
    full.trainer.fit(full.module, datamodule=full.datamodule)
    expected = _sampler_state(next((tmp_path / "full" / "ckpt").glob("*step=2*.ckpt")))

    failing = type("FailsAtStep", (_FailsAtStep, DSPOModule), {}) if max_staleness else None
    run = toy_run(lm_dir, str(tmp_path / "failed"), 3, max_staleness=max_staleness, module_cls=failing)
    if not max_staleness:  # the agent's third call (round 2's generation) fails after the prompts were drawn
        agent = run.callback.producer.side.agent
        rollout = agent.rollout

        def fail_third(*args, **kwargs):
            if len(agent.calls) == 2:
                raise ConnectionError("retriever down (injected)")
            return rollout(*args, **kwargs)

        agent.rollout = fail_third
    with pytest.raises((RuntimeError, ConnectionError), match="injected"):
        _within(120, lambda: fit_or_checkpoint(run.trainer, run.module, run.datamodule, None))
    failure = tmp_path / "failed" / "checkpoints" / "failure.ckpt"
    assert _sampler_state(failure) == expected != _sampler_state(next((tmp_path / "full" / "ckpt").glob("*step=3*")))
    producer = torch.load(failure, map_location="cpu", weights_only=False)["callbacks"]
    (state,) = [v for k, v in producer.items() if "RolloutCallback" in k]
    assert (state["rounds_completed"], state["cursor"]) == (2, 0)
