"""`MiniBatchStats`: the statistics of one optimizer step from its micro-batches, by hand (the module's own tests
check them against a whole training step)."""

from __future__ import annotations

import math

import pytest
import torch

from dspo.training.step_stats import MiniBatchStats
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


def test_weight_min_is_over_trained_micro_batches_and_ess_pools_the_mini_batch():
    """Micro-batch 1 has no trained token (its stats say weight_min 1, ess 1); micro-batch 2: sequences weighing 2 and
    1.5; micro-batch 3: one sequence of mean weight (0.5 + 1.5) / 2 = 1. weight_min: 1.5 then 0.5 (not the empty one's
    1). Pooled ESS over the sequences 2, 1.5, 1: 4.5² / (3 · 7.25) = 0.9310345 (the micro-batches' own: 1 and 1)."""
    stats = MiniBatchStats(num_sequences=4, num_tokens=5.0, num_micro_batches=3)
    parts = {"loss": torch.tensor(0.0), "kl": torch.tensor(0.0), "objective": {}}
    empty = _batch([[0, 0]])
    stats.add(empty, **parts, entropy=torch.zeros(1, 2), mismatch={"weight_min": torch.tensor(1.0),
              "ess": torch.tensor(1.0)}, correction=torch.zeros(1, 2))  # fmt: skip
    assert stats.totals["mismatch/weight_min"] == 1.0
    second = _batch([[1, 1], [0, 1]])
    stats.add(second, **parts, entropy=torch.zeros(2, 2), mismatch={"weight_min": torch.tensor(1.5),
              "ess": torch.tensor(0.98)}, correction=torch.tensor([[2.0, 2.0], [0.0, 1.5]]))  # fmt: skip
    assert stats.totals["mismatch/weight_min"] == 1.5
    third = _batch([[1, 1]])
    stats.add(third, **parts, entropy=torch.zeros(1, 2), mismatch={"weight_min": torch.tensor(0.5),
              "ess": torch.tensor(1.0)}, correction=torch.tensor([[0.5, 1.5]]))  # fmt: skip
    assert stats.totals["mismatch/weight_min"] == 0.5
    assert stats.totals["mismatch/ess"] == pytest.approx(4.5**2 / (3 * 7.25), rel=1e-6)


def test_objective_statistics_count_episodes_when_an_episode_is_split():
    """dspo and gspo take one ratio per episode (issue 70, item 3): a micro-batch of one episode split into 3 samples
    counts once. Episode-weighted: (1.0 x 1 + 0.0 x 1) / 2 episodes = 0.5, where rows would give 3/4."""
    split, whole = _batch([[0, 1], [0, 1], [0, 1]]), _batch([[0, 1]])
    split.episode_ids, whole.episode_ids = torch.tensor([7, 7, 7]), torch.tensor([8])
    stats = MiniBatchStats(num_sequences=4, num_tokens=4.0, num_micro_batches=2, num_episodes=2)
    zero = torch.tensor(0.0)
    stats.add(split, zero, zero, torch.zeros(3, 2), {"clipfrac": torch.tensor(1.0)}, {})
    stats.add(whole, zero, zero, torch.zeros(1, 2), {"clipfrac": torch.tensor(0.0)}, {})
    assert stats.totals["loss/clipfrac"] == pytest.approx(0.5)
