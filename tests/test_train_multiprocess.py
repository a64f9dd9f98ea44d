"""`dspo-train` as a scheduler runs it: two DDP processes (gloo, one engine each) and a preemption signal.

Each test is a real subprocess on the toy default (shortened), like a user's command line, on the transformers engine
(`short_default_hf`: what is tested here is not generation; multi-process vLLM runs in tests/test_fsdp.py)."""

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


def _run_dir(outputs: Path, name: str) -> Path:
    (run,) = list((outputs / "train").glob(f"{name}_*"))
    return run


@pytest.mark.slow
def test_ddp_two_processes_split_the_round_stay_identical_and_resume(run_train, short_default_hf, tmp_path):
    outputs = tmp_path / "outputs"
    # B = 2 groups per round: one per rank; G = 4, M = 2 -> 2 sequences per rank and optimizer step. DAPO, so that the
    # token-mean normalizer is all-reduced across the ranks (dspo's sequence-level path runs multi-process in test_fsdp)
    args = [*short_default_hf, "trainer=ddp", "trainer.devices=2", "trainer.max_steps=4", "run_name=ddp"]
    args.append("algorithm=dapo")
    result = run_train(args, outputs)
    assert "dspo-train finished" in result.stdout
    run = _run_dir(outputs, "ddp")
    replicas = json.loads((run / "replicas.json").read_text())
    assert replicas["world_size"] == 2 and replicas["identical_parameters"] and replicas["same_steps"]
    assert [r["global_step"] for r in replicas["ranks"]] == [4, 4]
    assert [r["sequences_per_step"] for r in replicas["ranks"]] == [[2, 2, 2, 2], [2, 2, 2, 2]]
    assert _step(run / "checkpoints" / "last.ckpt") == 4
    assert len(list((run / "model").glob("*.safetensors"))) == 1  # exported once (rank 0)
    assert (run / "test" / "results.json").is_file()  # the test pass ran on both ranks' shares
    run_train([*args, "trainer.max_steps=6", "ckpt_path=last", "run_test=false"], outputs)
    assert _step(run / "checkpoints" / "last.ckpt") == 6
    resumed = json.loads((run / "replicas.json").read_text())
    assert resumed["identical_parameters"] and [r["global_step"] for r in resumed["ranks"]] == [6, 6]


@pytest.mark.slow
def test_sigterm_saves_at_the_round_end_stops_cleanly_and_resumes(toy_cache, run_train, short_default_hf, tmp_path):
    outputs = tmp_path / "outputs"
    args = [*short_default_hf, "trainer.max_steps=40", "trainer.val_check_interval=100", "run_name=preempted"]
    env = {**os.environ, "DSPO_CACHE": str(toy_cache), "DSPO_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "dspo.train", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    saved = _step(run / "checkpoints" / "last.ckpt")
    assert saved % 2 == 0 and 2 <= saved < 40  # at a round boundary (M = 2), long before max_steps
    assert not (run / "test").exists() and not (run / "model").exists()  # a preempted run skips test and export
    run_train([*args, f"trainer.max_steps={saved + 2}", "ckpt_path=last", "run_test=false"], outputs)
    assert _step(run / "checkpoints" / "last.ckpt") == saved + 2
