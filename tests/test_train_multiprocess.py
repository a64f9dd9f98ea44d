"""`dspo-train` as a scheduler runs it: two DDP processes (gloo, one engine each) and a preemption signal.

Each test is a real subprocess on the toy default (shortened), like a user's command line, on the transformers engine
(`short_default_hf`: what is tested here is not generation; multi-process vLLM runs in
tests/training/test_strategies.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def _start_train(args: list[str], env: dict[str, str], **io) -> subprocess.Popen:
    """`python -m dspo.train ARGS` in the background, as a scheduler starts it (`io`: Popen's output settings)."""
    return subprocess.Popen([sys.executable, "-m", "dspo.train", *args], env=env, cwd=REPO, **io)


def _run_dir(outputs: Path, name: str) -> Path:
    (run,) = list((outputs / "train").glob(f"{name}_*"))
    return run


@pytest.mark.slow
def test_ddp_two_processes_split_the_round_stay_identical_and_resume(run_train, short_default_hf, tmp_path):
    outputs = tmp_path / "outputs"
    # B = 2 groups per round: one per rank; G = 4, M = 2 -> 2 sequences per rank and optimizer step. DAPO, so that the
    # token-mean normalizer is all-reduced across the ranks (dspo's sequence-level path runs multi-process in test_fsdp)
    args = [*short_default_hf, "trainer=ddp", "trainer.devices=2", "trainer.max_steps=2", "run_name=ddp"]
    args.append("algorithm=dapo")
    result = run_train(args, outputs)
    assert "dspo-train finished" in result.stdout
    run = _run_dir(outputs, "ddp")
    replicas = json.loads((run / "replicas.json").read_text())
    assert replicas["world_size"] == 2 and replicas["identical_parameters"] and replicas["same_steps"]
    assert [r["global_step"] for r in replicas["ranks"]] == [2, 2]
    assert [r["sequences_per_step"] for r in replicas["ranks"]] == [[2, 2], [2, 2]]
    assert _step(run / "checkpoints" / "last.ckpt") == 2
    assert len(list((run / "model").glob("*.safetensors"))) == 1  # exported once (rank 0)
    assert (run / "test" / "results.json").is_file()  # the test pass ran on both ranks' shares
    run_train([*args, "trainer.max_steps=4", "ckpt_path=last", "run_test=false"], outputs)
    assert _step(run / "checkpoints" / "last.ckpt") == 4
    resumed = json.loads((run / "replicas.json").read_text())
    assert resumed["identical_parameters"] and [r["global_step"] for r in resumed["ranks"]] == [4, 4]
    assert [r["sequences_per_step"] for r in resumed["ranks"]] == [[2, 2], [2, 2]]  # the resumed run's own steps


@pytest.mark.slow
def test_sigterm_stops_at_the_round_end_then_kill_9_loses_no_step_past_the_last_checkpoint(
    toy_cache, run_train, short_default_hf, tmp_path
):
    """A scheduler's two ways to end a run: SIGTERM (saved at the round end, a clean exit, then resumed), and on the
    resumed run SIGKILL of its process group (no save; resumed from the last checkpoint to the same final step, with
    the AdamW moments carried across both)."""
    outputs = tmp_path / "outputs"
    args = [*short_default_hf, "trainer.val_check_interval=100", "run_name=preempted", "run_test=false"]
    env = {**os.environ, "DSPO_CACHE": str(toy_cache), "DSPO_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"}
    piped = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    process = _start_train([*args, "trainer.max_steps=40"], env, **piped)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not list((outputs / "train").glob("preempted_*/checkpoints/step00002.ckpt")):
            assert process.poll() is None, process.communicate()[1][-4000:]
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)  # what a scheduler sends first; SLURM's --signal=USR1 behaves the same
        out, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err[-4000:]
    assert "SIGTERM received" in out and "stopped by a preemption signal" in out  # Hydra logs to stdout
    run = _run_dir(outputs, "preempted")
    last = run / "checkpoints" / "last.ckpt"
    saved = _step(last)
    assert saved % 2 == 0 and 2 <= saved < 40  # at a round boundary (M = 2), long before max_steps
    assert not (run / "test").exists() and not (run / "model").exists()  # a preempted run skips test and export

    final = saved + 8  # 4 rounds: the kill comes rounds before the end even on a fast machine
    resumed = [*args, f"trainer.max_steps={final}", "ckpt_path=last"]
    process = _start_train(resumed, env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # the resumed run's first checkpoint, then last.ckpt rewritten after it (atomically): a kill between the two
        # files is tests/runs/test_checkpoint_files.py's case
        first = run / "checkpoints" / f"step{saved + 2:05d}.ckpt"
        deadline = time.time() + 600
        while time.time() < deadline and not (first.is_file() and last.stat().st_mtime_ns >= first.stat().st_mtime_ns):
            assert process.poll() is None, "the resumed run exited before it could be killed"
            time.sleep(0.5)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    killed_at = _step(last)
    assert saved + 2 <= killed_at < final
    run_train(resumed, outputs)
    after = torch.load(last, weights_only=False, map_location="cpu")
    assert after["global_step"] == final
    state = after["optimizer_states"][0]["state"]
    assert state and all(int(s["step"]) == final for s in state.values())  # AdamW moments carried across both stops
