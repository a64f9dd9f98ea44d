"""Edge cases of `DSPOModule.training_step` found by review (issue 29): a micro-batch without trained tokens."""

from __future__ import annotations

import pytest
import torch

from dspo.module import DSPOModule
from dspo.testing import build_toy_lm, toy_run


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
