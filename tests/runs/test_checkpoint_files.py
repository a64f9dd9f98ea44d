"""Atomic checkpoint writes (a reader never sees a partial file) and the loadability check behind `ckpt_path=last`."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from dspo.runs.checkpoint_files import atomic_torch_save, checkpoint_problem, newest_loadable, resume_order
from dspo.training.checkpoint_io import AtomicCheckpointIO


def _checkpoint(step: int, numel: int = 1000) -> dict:
    return {"global_step": step, "state_dict": {"w": torch.full((numel,), float(step))}}


def test_atomic_save_replaces_the_target_only_when_complete(tmp_path, monkeypatch):
    target = tmp_path / "ckpts" / "last.ckpt"
    atomic_torch_save(_checkpoint(1), target)  # creates the folder
    assert torch.load(target, weights_only=True)["global_step"] == 1
    (target.parent / ".last.ckpt.tmp-99999").write_bytes(b"left by a killed writer")
    real_save = torch.save

    def dies_halfway(obj, handle):
        real_save(obj, handle)
        handle.truncate(handle.tell() // 2)
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save(_checkpoint(2), target)
    monkeypatch.undo()
    assert torch.load(target, weights_only=True)["global_step"] == 1  # the old file, whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]  # own and stale temporaries gone


WRITER = """
import sys, torch
from dspo.training.checkpoint_io import AtomicCheckpointIO
io, step = AtomicCheckpointIO(), 0
while True:
    step += 1
    checkpoint = {"global_step": step, "w": torch.full((16_000_000,), float(step))}
    print("saving", step, flush=True)  # after building it, so that the kill lands in the write itself
    io.save_checkpoint(checkpoint, sys.argv[1])
"""


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path):
    """SIGKILL lands while the third 64 MB save is being written (with plain torch.save to the target path, the file
    is then cut short); the target still holds the second checkpoint, whole."""
    target = tmp_path / "last.ckpt"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        for expected in ("saving 1", "saving 2", "saving 3"):
            assert writer.stdout.readline().strip() == expected
        time.sleep(0.01)  # into the write of the 64 MB file (tens of ms)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    assert checkpoint_problem(target) is None
    loaded = torch.load(target, weights_only=True)
    assert loaded["global_step"] in (2, 3) and loaded["w"].eq(float(loaded["global_step"])).all()


def test_checkpoint_problem_names_what_is_wrong(tmp_path):
    good = tmp_path / "good.ckpt"
    atomic_torch_save(_checkpoint(3, numel=100_000), good)
    assert checkpoint_problem(good) is None
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    assert checkpoint_problem(empty) == "empty file (0 bytes)"
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "truncated?" in checkpoint_problem(truncated)
    assert "cannot stat" in checkpoint_problem(tmp_path / "missing.ckpt")
    unsafe = tmp_path / "unsafe.ckpt"  # a whole archive that weights_only refuses (an arbitrary object)
    torch.save({"callback": logging.getLogger("x")}, unsafe)
    assert checkpoint_problem(unsafe).startswith("torch.load(weights_only=True) failed: UnpicklingError")


def test_newest_loadable_prefers_last_of_the_newest_run_and_skips_broken_ones(tmp_path, caplog):
    old_run, new_run = tmp_path / "run_a" / "checkpoints", tmp_path / "run_b" / "checkpoints"
    files = {}
    for when, (folder, name) in enumerate(
        [(old_run, "last.ckpt"), (new_run, "step00002.ckpt"), (new_run, "last.ckpt"), (new_run, "best-step00002.ckpt")]
    ):
        files[folder.parent.name, name] = path = folder / name
        atomic_torch_save(_checkpoint(when), path)
        os.utime(path, (1000 + when, 1000 + when))
    paths = list(files.values())
    order = [Path(p).relative_to(tmp_path).as_posix() for p in resume_order(reversed(paths))]
    assert order == [
        "run_b/checkpoints/last.ckpt",
        "run_b/checkpoints/best-step00002.ckpt",
        "run_b/checkpoints/step00002.ckpt",
        "run_a/checkpoints/last.ckpt",
    ]
    assert newest_loadable(paths) == str(files["run_b", "last.ckpt"])
    last = files["run_b", "last.ckpt"]
    last.write_bytes(last.read_bytes()[:100])  # cut mid-write by an old, non-atomic writer
    os.utime(last, (1002, 1002))
    files["run_b", "best-step00002.ckpt"].write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="dspo.runs.checkpoint_files"):
        assert newest_loadable(paths) == str(files["run_b", "step00002.ckpt"])
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 2 and str(last) in skipped[0] and "truncated?" in skipped[0]
    assert "0 bytes" in skipped[1]
    assert newest_loadable([files["run_b", "best-step00002.ckpt"]]) is None


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)


def test_trainer_saves_every_checkpoint_through_the_plugin(tmp_path, monkeypatch):
    written: list[str] = []
    original = AtomicCheckpointIO.save_checkpoint

    def spy(self, checkpoint, path, storage_options=None):
        written.append(Path(path).name)
        original(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", spy)
    callback = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True, save_top_k=1)
    trainer = pl.Trainer(
        max_steps=4,
        plugins=[AtomicCheckpointIO()],
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Tiny())
    trainer.save_checkpoint(str(tmp_path / "failure.ckpt"))  # what dspo.train does after an error
    assert {"last.ckpt", "failure.ckpt"} <= set(written) and any(n.startswith("epoch=") for n in written)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 4
