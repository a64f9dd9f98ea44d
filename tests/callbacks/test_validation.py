"""ValidateAtStart: validation metrics at step 0 through the logger, before any optimizer step; none on resume."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from dspo.callbacks.validation import ValidateAtStart
from dspo.testing import recording_logger


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.updates_seen_by_validation: list[float] = []

    def training_step(self, batch, batch_idx):
        return ((self.weight - 1.0) ** 2).sum() + batch.sum() * 0

    def validation_step(self, batch, batch_idx):
        self.updates_seen_by_validation.append(float(self.weight))
        self.log("val/score", self.weight.detach().sum() + 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.zeros(64, 1), batch_size=1)

    def val_dataloader(self):
        return DataLoader(torch.zeros(2, 1), batch_size=1)


def _trainer(tmp_path, logger, max_steps: int, callbacks) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", max_steps=max_steps, val_check_interval=2, logger=logger, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
        enable_checkpointing=False,
    )  # fmt: skip


def _val_steps(logger) -> list[int]:
    return [step for step, metrics in logger.records if "val/score" in metrics]


def test_validation_is_logged_at_step_zero_before_the_first_update(tmp_path) -> None:
    logger, module, callback = recording_logger(), Tiny(), ValidateAtStart()
    _trainer(tmp_path, logger, 4, [callback]).fit(module)
    assert callback.ran
    # Lightning logs a validation run after k updates at x = k - 1 (its batch index); the one before any is at 0
    assert _val_steps(logger) == [0, 1, 3]
    assert module.updates_seen_by_validation[:2] == [0.0, 0.0]  # the untouched weights were scored at step 0


def test_without_the_callback_lightning_starts_at_the_first_interval(tmp_path) -> None:
    logger = recording_logger()
    _trainer(tmp_path, logger, 4, []).fit(Tiny())
    assert _val_steps(logger) == [1, 3]


def test_disabled_and_resumed_runs_skip_it(tmp_path) -> None:
    logger = recording_logger()
    _trainer(tmp_path, logger, 2, [ValidateAtStart(enabled=False)]).fit(Tiny())
    assert _val_steps(logger) == [1]
    first = _trainer(tmp_path, recording_logger(), 2, [ValidateAtStart()])
    module = Tiny()
    first.fit(module)
    first.save_checkpoint(tmp_path / "step2.ckpt")
    resumed_logger, callback = recording_logger(), ValidateAtStart()
    _trainer(tmp_path, resumed_logger, 4, [callback]).fit(Tiny(), ckpt_path=tmp_path / "step2.ckpt")
    assert not callback.ran and len(_val_steps(resumed_logger)) == 1  # the step-4 validation only
