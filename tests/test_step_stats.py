"""`MiniBatchStats`: the statistics of one optimizer step from its micro-batches, by hand (the module's own tests
check them against a whole training step)."""

from __future__ import annotations

import math

import pytest
import torch

from dspo.step_stats import MiniBatchStats
from dspo.types import PolicyBatch


def _batch(mask: list[list[float]]) -> PolicyBatch:
    m = torch.tensor(mask)
    n = m.shape[0]
    return PolicyBatch(
        input_ids=torch.zeros_like(m).long(),
        attention_mask=torch.ones_like(m).long(),
        loss_mask=m,
        advantages=torch.zeros(n),
    )


def test_sums_token_and_sequence_means_and_extremes():
    stats = MiniBatchStats(num_sequences=3, num_tokens=4.0, num_micro_batches=2)
    first, second = _batch([[0, 1, 1], [0, 1, 0]]), _batch([[0, 0, 1]])  # 2 sequences / 3 tokens, 1 / 1
    entropy = torch.full((2, 3), 2.0)
    stats.add(
        first,
        torch.tensor(0.5),
        torch.tensor(0.1),
        entropy,
        {"clipfrac": torch.tensor(0.5), "ratio_min": torch.tensor(0.9), "ratio_max": torch.tensor(1.1)},
        {"kl_k3": torch.tensor(0.2)},
    )
    stats.add(
        second,
        torch.tensor(0.25),
        torch.tensor(0.0),
        torch.full((1, 3), 4.0),
        {"clipfrac": torch.tensor(1.0), "ratio_min": torch.tensor(0.95), "ratio_max": torch.tensor(1.3)},
        {"kl_k3": torch.tensor(0.6)},
    )
    totals = stats.totals
    assert totals["train/loss"] == 0.75 and totals["loss/kl"] == pytest.approx(0.1)  # already mini-batch normalized
    assert totals["train/entropy"] == pytest.approx((3 * 2.0 + 1 * 4.0) / 4)  # token mean
    assert totals["loss/clipfrac"] == pytest.approx(0.5 * 2 / 3 + 1.0 / 3)  # sequence-weighted
    assert (totals["loss/ratio_min"], totals["loss/ratio_max"]) == pytest.approx((0.9, 1.3))  # extremes
    assert totals["mismatch/kl_k3"] == pytest.approx(0.2 * 3 / 4 + 0.6 / 4)  # token-weighted


def test_a_mini_batch_without_trained_tokens_weighs_micro_batches_equally():
    stats = MiniBatchStats(num_sequences=2, num_tokens=0.0, num_micro_batches=2)
    for _ in range(2):
        stats.add(
            _batch([[0, 0]]),
            torch.tensor(0.0),
            torch.tensor(0.0),
            torch.full((1, 2), 3.0),
            {"ratio_min": torch.tensor(1.0)},
            {"weight_mean": torch.tensor(1.0)},
        )
    assert stats.totals["train/entropy"] == 0.0 and not math.isnan(stats.totals["train/entropy"])
    assert stats.totals["mismatch/weight_mean"] == 1.0  # each micro-batch half
