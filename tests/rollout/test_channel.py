"""Issue 53 (4): every wait on the engine process is bounded by its liveness, a message it was writing when it died
included; a failed weight receiver ends it at once. The engine process runs the stand-ins (`dspo.testing`); killed at
named points (`DSPO_FAULT`) and at random moments of a k = 1 run (seeded trials), every run ends with
`EngineProcessDied` (or the engine's own error) and a failure checkpoint within seconds."""

from __future__ import annotations

import os
import queue
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from dspo.data.datamodule import PromptSampler
from dspo.rollout.engine_process import EngineProcess, EngineProcessDied, EngineProcessError
from dspo.testing import midsize_agent, toy_items, toy_run, worker_spec
from dspo.testing import within as _within

SETTLE_S = 10.0  # from the kill to the trainer's error: the liveness polls are 0.5 s; measured well under 2 s


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_an_engine_process_killed_mid_write_of_a_round_ends_the_trainers_wait(monkeypatch):
    """Killed with half a reply in the pipe: before, the trainer's `Queue.get` read the first bytes and waited for the
    rest for ever (its own queue held the write end open, so no EOF came)."""
    monkeypatch.setenv("DSPO_FAULT", "engine.mid_write_round#2")  # inherited by the engine process at spawn
    worker = EngineProcess(worker_spec(max_staleness=1))
    try:
        worker.start(PromptSampler(toy_items(), seed=0), None, 0, [("w", torch.zeros(4))])
        monkeypatch.delenv("DSPO_FAULT")
        worker.push_weights(None, 0, 0, (0, 1))
        with pytest.raises(EngineProcessDied, match="exited with code -9"):
            _within(SETTLE_S + 10, lambda: [worker.take_round(i) for i in range(2)])
    finally:
        worker.close()


@pytest.mark.parametrize("point", ["engine.mid_write_predictions", "engine.mid_write_round"])
def test_a_reply_cut_short_blocks_no_reader(monkeypatch, point):
    """A process killed with half a reply (256 kB: several pipe buffers) written: the reader's `get` returns empty in
    its slice, then sees the EOF; only its own thread ever waited on the missing bytes."""
    import multiprocessing

    from dspo.rollout.channel import Replies, ReplySender
    from dspo.testing import send_reply

    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    monkeypatch.setenv("DSPO_FAULT", point)
    process = ctx.Process(target=send_reply, args=(ReplySender(writer), {"answers": "x" * 262_144}, point))
    process.start()
    writer.close()
    replies = Replies(reader)
    process.join(30)
    assert process.exitcode == -signal.SIGKILL
    start = time.perf_counter()
    for _ in range(3):
        with pytest.raises(queue.Empty):
            replies.get(timeout=0.2)
    assert time.perf_counter() - start < 2.0 and replies.closed
    replies.close()


@pytest.mark.slow  # spawns an engine process (a Python start-up, seconds)
def test_a_failed_weight_receiver_ends_the_engine_process_at_once(monkeypatch):
    """The gloo receiver thread fails at push 2 (as on a CUDA out-of-memory of its staging buffers): before, the
    failure waited in the engine process for a `LoadWeights` queued after the trainer's broadcast, which waited for a
    receiver that was gone (24 h). Now the engine process reports it and exits; the trainer's push or wait says so."""
    monkeypatch.setenv("DSPO_FAULT", "engine.receiver#2=raise")
    worker = EngineProcess(worker_spec(max_staleness=1, weight_transfer="gloo"))
    weights = [("w", torch.zeros(64))]
    try:
        worker.start(PromptSampler(toy_items(), seed=0), None, 0, weights)
        monkeypatch.delenv("DSPO_FAULT")
        worker.push_weights(weights, 0, 0, (0, 4))
        worker.take_round(0)

        def push_and_wait() -> None:
            worker.push_weights([("w", torch.ones(64))], 1, 1, (1, 4))
            for index in range(1, 4):
                worker.take_round(index)

        start = time.perf_counter()
        with pytest.raises((EngineProcessDied, EngineProcessError)) as error:
            _within(SETTLE_S + 10, push_and_wait)
        assert time.perf_counter() - start < SETTLE_S
        if isinstance(error.value, EngineProcessError):
            assert "weight receiver failed" in str(error.value) and "FaultInjected" in str(error.value)
    finally:
        worker.close()


TRIALS = int(os.environ.get("DSPO_KILL_TRIALS", "6"))  # DSPO_KILL_TRIALS=50 for a deeper search


@pytest.mark.slow  # a k = 1 toy run per trial (an engine process start-up each): about 10 s a trial
def test_the_engine_process_killed_at_random_moments_always_ends_the_run(lm_dir, tmp_path):
    """Seeded random kill times over a k = 1 run (steps, weight pushes, rounds written while the trainer updates):
    every trial ends with `EngineProcessDied` and a failure checkpoint within `SETTLE_S` of the kill."""
    from dspo.train import fit_or_checkpoint

    rng, settled = random.Random(53), []
    for trial in range(TRIALS):
        root = tmp_path / f"trial{trial}"
        run = toy_run(lm_dir, str(root), 200, max_staleness=1)
        # rounds larger than a pipe holds: the engine process is mid-write whenever the trainer is busy training
        run.callback.producer.spec.agent = midsize_agent
        delay, killed = rng.uniform(0.0, 4.0), {}

        def kill(run=run, delay=delay, killed=killed) -> None:
            while True:  # once the engine process has produced its first round
                worker = getattr(getattr(run.callback, "producer", None), "side", None)
                worker = getattr(worker, "worker", None)
                if worker is not None and worker.pid is not None:
                    break
                time.sleep(0.01)
            time.sleep(delay)
            killed["at"] = time.perf_counter()
            os.kill(worker.pid, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        with pytest.raises(EngineProcessDied, match="exited with code -9"):
            _within(30, lambda run=run: fit_or_checkpoint(run.trainer, run.module, run.datamodule, None))
        settled.append(time.perf_counter() - killed["at"])
        assert Path(root, "checkpoints", "failure.ckpt").is_file(), f"trial {trial} (kill after {delay:.2f} s)"
        assert settled[-1] < SETTLE_S, f"trial {trial}: {settled[-1]:.1f} s from the kill to the error"
    print(f"{TRIALS} kills, kill -> EngineProcessDied: max {max(settled):.2f} s")
