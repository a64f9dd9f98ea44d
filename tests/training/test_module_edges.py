"""Edge cases of `DSPOModule.training_step` found by review (issue 29): a micro-batch without trained tokens."""

from __future__ import annotations

import pytest
import torch

from dspo.testing import build_toy_lm, toy_run
from dspo.training.module import DSPOModule


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    return build_toy_lm(str(tmp_path_factory.mktemp("toy_lm")))


class EmptyLastMicroBatch(DSPOModule):
    """Trains nothing of the last micro-batch of every step (all its loss-mask positions 0)."""

    def training_step(self, slot, batch_idx):
        last = slot.micro_batches[-1]
        last.loss_mask = torch.zeros_like(last.loss_mask)
        self.kept = [b.loss_mask.clone() for b in slot.micro_batches]
        return super().training_step(slot, batch_idx)


def test_a_micro_batch_without_trained_tokens_is_a_zero_contribution(lm_dir, tmp_path):
    """It used to give a loss without grad_fn, and `manual_backward` raised; now it backpropagates zeros and the step
    is applied from the other micro-batches."""
    run = toy_run(lm_dir, str(tmp_path), 2, module_cls=EmptyLastMicroBatch)  # 8 sequences in micro-batches 3, 3, 2
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 2 and run.module.weights_version == 2
    assert float(run.module.kept[-1].sum()) == 0 and float(sum(m.sum() for m in run.module.kept)) > 0
    assert torch.isfinite(torch.tensor(float(run.trainer.callback_metrics["train/loss"])))


def test_a_run_resumed_with_another_learning_rate_trains_at_the_new_rate(lm_dir, tmp_path, caplog):
    """Issue 70 (2): Lightning restores the scheduler's base rates from the checkpoint, so `optimizer.lr` changed on
    resume was ignored (and the guard's next backoff used the new rate: a 10x drop instead of 2x). The resumed run
    trains at new lr x the guard's factor x the warm-up's, and says so."""
    import lightning.pytorch as pl

    from dspo.guard.rollback import set_lr_scale

    class Rates(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    first = toy_run(lm_dir, str(tmp_path / "a"), 2, lr=1e-2, warmup_steps=4)
    first.trainer.fit(first.module, datamodule=first.datamodule)
    set_lr_scale(first.module, 0.5)  # a guard backoff before the checkpoint
    ckpt = tmp_path / "a.ckpt"
    first.trainer.save_checkpoint(str(ckpt), weights_only=False)
    rates = Rates()
    again = toy_run(lm_dir, str(tmp_path / "b"), 3, lr=4e-2, warmup_steps=4, callbacks=(rates,))
    with caplog.at_level("WARNING", logger="dspo.training.module"):
        again.trainer.fit(again.module, datamodule=again.datamodule, ckpt_path=str(ckpt), weights_only=True)
    # step 2 of a 4-step warm-up: factor (2 + 1) / (4 + 1); the guard's 0.5 kept, the rate the new one
    assert rates.seen == [pytest.approx(4e-2 * 0.5 * 3 / 5)]
    assert again.trainer.lr_scheduler_configs[0].scheduler.base_lrs == [pytest.approx(4e-2 * 0.5)]
    assert "optimizer.lr changed on resume (0.01 -> 0.04)" in caplog.text
