"""The guard end to end (issue 55, point 2): a rollback at k = 1 and on 2 ranks, the guard's state across a resume,
and the stop after `guard.max_rollbacks`.

A detector is made to fire on purpose: `entropy` with a band of +-0.01 % around its warm-up level fires at the first
round after its warm-up rounds (an entropy never repeats to 4 digits). With one optimizer step per round at k = 0:
round 0 and 1 are clean (the step-1 checkpoint, version 1, sampled round 1: healthy at its end), round 2 fires and
rolls back to it. At k = 1 round r is sampled by version r - 1: the step-1 checkpoint is vouched for by round 2, so
the detector warms up 3 rounds and round 3 fires (issue 70: a clean round vouches for the weights that sampled it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from dspo.testing import run_to_exit

REPO = Path(__file__).resolve().parents[2]
FIRES_AT_ROUND_2 = [
    "guard.detectors.entropy.warmup=2",
    "guard.detectors.entropy.low=0.9999",
    "guard.detectors.entropy.high=1.0001",
]
FIRES_AT_ROUND_3 = [*FIRES_AT_ROUND_2[1:], "guard.detectors.entropy.warmup=3"]
ONE_STEP_ROUNDS = [
    "algorithm.num_minibatches=1",
    "trainer.val_check_interval=100",
    "callbacks.validate_at_start=null",
    "run_test=false",
    "logger=csv",
    "callbacks.checkpoint.keep_last=1",  # the healthy step-1 file outlives it
]


def _run_dir(outputs: Path, name: str) -> Path:
    (run,) = list((outputs / "train").glob(f"{name}_*"))
    return run


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "guard.jsonl").read_text().splitlines()]


def _same_policy(a: dict, b: dict) -> bool:
    keys = [k for k in a["state_dict"] if k.startswith("policy.")]
    return bool(keys) and all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in keys)


def _assert_rolled_back(run: Path, at_step: int, healthy_step: int) -> None:
    """The checkpoint written after the rollback holds the healthy checkpoint's weights and AdamW state, at half the
    learning rate, with the engine's weight version moved on."""
    ckpts = run / "checkpoints"
    healthy, after = _load(ckpts / f"step{healthy_step:05d}.ckpt"), _load(ckpts / f"step{at_step:05d}.ckpt")
    assert _same_policy(healthy, after)
    adam = [int(s["step"]) for s in after["optimizer_states"][0]["state"].values()]
    assert adam and set(adam) == {healthy_step}  # the optimizer restored, not just the weights
    assert after["lr_schedulers"][0]["base_lrs"] == [pytest.approx(0.5 * healthy["lr_schedulers"][0]["base_lrs"][0])]
    assert after["dspo"]["weights_version"] == at_step + 1  # moved: the engine gets the restored weights
    assert after["global_step"] == at_step  # the step count (and the sampler, the RNG) move on


@pytest.mark.slow
def test_rollback_at_k1_then_resume_keeps_the_guard_state_and_stops_after_max_rollbacks(
    toy_cache, run_train, short_default_hf, tmp_path
):
    outputs = tmp_path / "outputs"
    args = [*short_default_hf, *ONE_STEP_ROUNDS, *FIRES_AT_ROUND_3, "rollout.max_staleness=1", "run_name=guard_k1"]
    result = run_train([*args, "trainer.max_steps=4"], outputs)
    run = _run_dir(outputs, "guard_k1")
    (event,) = _events(run)
    assert event["action"] == "rollback" and event["step"] == 4 and event["round_index"] == 3
    # round 3 was sampled by version 2 (the step-2 checkpoint): the rollback goes to step 1, vouched for by round 2
    assert list(event["detectors"]) == ["entropy"] and event["restored_from"].endswith("step00001.ckpt")
    assert event["rollbacks"] == 1 and event["lr_scale"] == 0.5
    assert "guard: round 3 (step 4): entropy (entropy" in result.stdout + result.stderr
    _assert_rolled_back(run, at_step=4, healthy_step=1)
    assert not (run / "checkpoints" / "step00002.ckpt").exists()  # dropped once its bad round was judged
    header = next(run.rglob("metrics.csv")).read_text().splitlines()[0]
    assert {"guard/entropy", "guard/rollbacks", "guard/lr_scale", "guard/reward_drop"} <= set(header.split(","))

    # resumed with a lower cap: the guard remembers its rollback (and the detector its baseline, so it fires again
    # at once), so the next rollback asked for is over the cap: the run stops with a non-zero exit and says why
    cmd = [sys.executable, "-m", "dspo.train", *args, "trainer.max_steps=6", "ckpt_path=last", "guard.max_rollbacks=1"]
    env = {**os.environ, "DSPO_CACHE": str(toy_cache), "DSPO_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"}
    stopped = run_to_exit(cmd, env, 900, finished="dspo-train finished", cwd=REPO)
    assert stopped.returncode != 0
    assert "guard stopped the run at step 5" in stopped.stdout + stopped.stderr
    assert "guard.max_rollbacks=1" in stopped.stdout + stopped.stderr
    assert [e["action"] for e in _events(run)] == ["rollback", "stop"]


@pytest.mark.slow
def test_rollback_on_two_ranks_all_ranks_restore_the_same_checkpoint(run_train, short_default_hf, tmp_path):
    outputs = tmp_path / "outputs"
    args = [*short_default_hf, *ONE_STEP_ROUNDS, *FIRES_AT_ROUND_2, "trainer=ddp", "trainer.devices=2"]
    run_train([*args, "trainer.max_steps=3", "run_name=guard_ddp"], outputs)
    run = _run_dir(outputs, "guard_ddp")
    (event,) = _events(run)  # rank 0 writes; both ranks acted (else the replicas would differ)
    assert event["action"] == "rollback" and event["restored_from"].endswith("step00001.ckpt")
    _assert_rolled_back(run, at_step=3, healthy_step=1)
    replicas = json.loads((run / "replicas.json").read_text())
    assert replicas["identical_parameters"] and replicas["same_steps"]
