"""Round-counted checkpoints (interval, newest K kept, what a kill -9 loses) and save-and-stop on SIGTERM / SIGUSR1,
on a tiny Lightning model in a subprocess (real signals, real files)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dspo.callbacks.checkpoints import PreemptionCheckpoint, RoundCheckpoint

SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, lightning.pytorch as pl
    from pathlib import Path
    from dspo.callbacks.checkpoints import PreemptionCheckpoint, RoundCheckpoint

    out, delay = Path(sys.argv[1]), float(sys.argv[5])
    max_steps, every, per_round = (int(a) for a in sys.argv[2:5])
    resume = sys.argv[6] if len(sys.argv) > 6 else None

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
        def training_step(self, batch, batch_idx):
            time.sleep(delay)
            (out / "progress.tmp").write_text(str(self.global_step + 1))
            (out / "progress.tmp").replace(out / "progress")  # atomic: a reader never sees a truncated file
            return self.layer(batch).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(10_000, 4), batch_size=2)

    callbacks = [
        RoundCheckpoint(str(out / "ckpt"), every_n_rounds=every, steps_per_round=per_round, keep_last=2),
        PreemptionCheckpoint(str(out / "ckpt"), steps_per_round=per_round),
    ]
    trainer = pl.Trainer(max_steps=max_steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=str(out))
    trainer.fit(Tiny(), ckpt_path=resume)
    print("stopped at", trainer.global_step, "preempted:", callbacks[1].saved_to, flush=True)
    """
)


def _start(tmp_path: Path, *args: object) -> subprocess.Popen:
    script = tmp_path / "train_tiny.py"
    script.write_text(SCRIPT)
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _wait_for_step(tmp_path: Path, process: subprocess.Popen, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    progress = tmp_path / "progress"
    while time.time() < deadline:
        if progress.is_file() and int(progress.read_text()) >= step:
            return
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"training did not reach step {step} in {timeout} s")


def _global_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def test_round_checkpoint_saves_every_n_rounds_and_keeps_the_newest(tmp_path: Path) -> None:
    process = _start(tmp_path, 12, 2, 2, 0.0)  # 12 steps, every 2 rounds of 2 steps -> saves at 4, 8, 12
    _, err = process.communicate(timeout=180)
    assert process.returncode == 0, err[-3000:]
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["last.ckpt", "step00008.ckpt", "step00012.ckpt"]  # keep_last=2 pruned step00004
    assert _global_step(tmp_path / "ckpt" / "last.ckpt") == 12


def test_kill_9_loses_at_most_the_save_interval(tmp_path: Path) -> None:
    every, per_round = 3, 1
    process = _start(tmp_path, 10_000, every, per_round, 0.02)
    _wait_for_step(tmp_path, process, 17)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    killed_at = int((tmp_path / "progress").read_text())
    saved = _global_step(tmp_path / "ckpt" / "last.ckpt")
    assert saved % (every * per_round) == 0
    assert killed_at - every * per_round <= saved <= killed_at


def test_preemption_signal_saves_at_the_round_end_stops_cleanly_and_resumes(tmp_path: Path) -> None:
    """SIGUSR1 (SLURM's --signal=USR1). SIGTERM takes the same handler; it is sent to a real dspo-train in
    tests/test_train_multiprocess.py."""
    signum = signal.SIGUSR1
    per_round = 4
    process = _start(tmp_path, 10_000, 1000, per_round, 0.05)  # no periodic save within reach: only the signal's
    _wait_for_step(tmp_path, process, 5)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]  # a clean stop, not a death by signal
    assert "preempted: " + str(tmp_path / "ckpt" / "last.ckpt") in out
    assert f"{signal.Signals(signum).name} received" in err
    saved = _global_step(tmp_path / "ckpt" / "last.ckpt")
    assert saved % per_round == 0 and saved >= 8  # the round in progress finished, then it saved
    resumed = _start(tmp_path, saved + per_round, 1000, per_round, 0.0, tmp_path / "ckpt" / "last.ckpt")
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err[-3000:]
    assert f"stopped at {saved + per_round} preempted: None" in out


def test_slurm_job_is_requeued_after_the_save(tmp_path: Path) -> None:
    """Under SLURM rank 0 runs `scontrol requeue $SLURM_JOB_ID` after saving (a stand-in scontrol records the call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "scontrol_args"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    os.environ["PATH"], old_path = f"{bin_dir}:{os.environ['PATH']}", os.environ["PATH"]
    os.environ["SLURM_JOB_ID"] = "4242"
    try:
        process = _start(tmp_path, 10_000, 1000, 2, 0.05)
    finally:
        os.environ["PATH"] = old_path
        del os.environ["SLURM_JOB_ID"]
    _wait_for_step(tmp_path, process, 3)
    process.send_signal(signal.SIGUSR1)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    assert (tmp_path / "scontrol_args").read_text().split() == ["requeue", "4242"]
    assert "requeued SLURM job 4242" in err


def test_invalid_settings_name_their_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="callbacks.checkpoint.every_n_rounds"):
        RoundCheckpoint(str(tmp_path), every_n_rounds=0)
    with pytest.raises(ValueError, match="callbacks.checkpoint.keep_last"):
        RoundCheckpoint(str(tmp_path), keep_last=-2)
    with pytest.raises(ValueError, match="callbacks.preemption.signals"):
        PreemptionCheckpoint(str(tmp_path), signals=["SIGHUP"])
    checkpoint = RoundCheckpoint(str(tmp_path), every_n_rounds=3, steps_per_round=2, keep_last=5)
    assert (checkpoint._every_n_train_steps, checkpoint.save_top_k, checkpoint.monitor) == (6, 5, "step")


def test_round_checkpoints_stay_on_round_boundaries_after_a_skipped_step(tmp_path: Path) -> None:
    """Issue 29 (2): a skipped (non-finite) step leaves the global step one behind the slots; saves must still fall at
    the end of a round (the environment callback's cursor is 0 in every saved state), counted in rounds."""
    from dspo.testing import build_toy_lm, toy_run
    from dspo.training.module import DSPOModule

    class PoisonSecondStep(DSPOModule):
        def training_step(self, slot, batch_idx):
            if batch_idx == 1:  # round 0's second mini-batch: skipped
                for batch in slot.micro_batches:
                    batch.advantages = torch.full_like(batch.advantages, float("nan"))
            return super().training_step(slot, batch_idx)

    lm_dir = build_toy_lm(str(tmp_path / "lm"))
    checkpoint = RoundCheckpoint(str(tmp_path / "ckpt"), every_n_rounds=1, steps_per_round=2, keep_last=-1)
    run = toy_run(lm_dir, str(tmp_path), 5, module_cls=PoisonSecondStep, num_minibatches=2, callbacks=(checkpoint,))
    run.trainer.fit(run.module, datamodule=run.datamodule)
    saved = {}
    for path in sorted((tmp_path / "ckpt").glob("step*.ckpt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved[path.name] = (state["global_step"], state["callbacks"]["RolloutCallback"])
    # rounds end after slots 2, 4 and 6, i.e. at optimizer steps 1, 3 and 5 (one step of round 0 was skipped)
    assert sorted(saved) == ["step00001.ckpt", "step00003.ckpt", "step00005.ckpt"]
    assert [saved[k][0] for k in sorted(saved)] == [1, 3, 5]
    for name, (_, environment) in saved.items():
        assert environment["cursor"] == 0, f"{name} was saved mid-round"
    assert [saved[k][1]["rounds_completed"] for k in sorted(saved)] == [1, 2, 3]


def test_preemption_handlers_are_restored_when_training_ends(tmp_path: Path) -> None:
    """Issue 29 (6): after fit, SIGTERM must again do what it did before fit (end the process), not call the handler
    Lightning used during fit (Lightning restores its own before the callbacks' teardown)."""
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2)

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    callback = PreemptionCheckpoint(str(tmp_path / "ckpt"))
    trainer = pl.Trainer(
        max_steps=2, callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=True, accelerator="cpu", default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(Tiny())
    assert {s: signal.getsignal(s) for s in before} == before


def _guard_trainer(removed: list[str]):
    from types import SimpleNamespace

    strategy = SimpleNamespace(barrier=lambda name=None: None, remove_checkpoint=removed.append)
    return SimpleNamespace(is_global_zero=True, strategy=strategy)


def test_the_healthy_checkpoint_outlives_keep_last_and_is_dropped_when_a_newer_one_is_healthy(tmp_path):
    from dspo.callbacks.checkpoints import RoundCheckpoint

    callback, removed = RoundCheckpoint(str(tmp_path), keep_last=1), []
    trainer = _guard_trainer(removed)
    step1, step2, step3 = (str(tmp_path / f"step{i:05d}.ckpt") for i in (1, 2, 3))
    assert callback.keep(trainer, step1) == step1
    callback._remove_checkpoint(trainer, step1)  # what keep_last=1 does when step 2 is saved
    assert removed == []
    callback.best_k_models = {step3: 3}
    callback._remove_checkpoint(trainer, step2)
    assert callback.keep(trainer, step3) == step3 and removed == [step2, step1]  # the old healthy one goes


def test_with_keep_last_0_the_healthy_last_ckpt_is_kept_as_a_copy(tmp_path):
    from dspo.callbacks.checkpoints import RoundCheckpoint

    callback = RoundCheckpoint(str(tmp_path), keep_last=0)
    last = tmp_path / "last.ckpt"
    last.write_bytes(b"round 1")
    kept = callback.keep(_guard_trainer([]), str(last))
    last.write_bytes(b"round 2")  # the next round's save
    assert kept == str(tmp_path / "healthy.ckpt") and (tmp_path / "healthy.ckpt").read_bytes() == b"round 1"


def test_a_file_kept_as_best_is_not_dropped_when_the_healthy_role_moves_on(tmp_path):
    from dspo.callbacks.checkpoints import RoundCheckpoint

    callback, removed = RoundCheckpoint(str(tmp_path), keep_last=1), []
    trainer = _guard_trainer(removed)
    step1, step2, step3 = (str(tmp_path / f"step{i:05d}.ckpt") for i in (1, 2, 3))
    callback.keep(trainer, step1)
    callback.keep(trainer, step1, role="best")
    callback.keep(trainer, step2)  # healthy moves on: step 1 is still the best
    assert removed == [] and callback.kept == {"healthy": step2, "best": step1}
    callback.keep(trainer, step3, role="best")
    assert removed == [step1]  # held by no role now
    callback._remove_checkpoint(trainer, step2)
    assert removed == [step1]
