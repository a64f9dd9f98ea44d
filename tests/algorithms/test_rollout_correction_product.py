"""Issue 38: the product (importance-weight) sequence modes against hand values, the weight statistics (weight_min,
ESS), and the notice for corrections that do not correct stale rounds (`rollout.max_staleness` >= 1).

A sequence's importance weight is P_i = Π_t r_it = e^(Σ_t d_it) with d = logπ_old − logμ; the geometric mean
ρ_i = e^(mean_t d_it) (seq_tis) is not one."""

import logging
import math

import pytest
import torch

from dspo.algorithms.config import AlgorithmConfig
from dspo.algorithms.losses import policy_loss
from dspo.algorithms.rollout_correction import (
    CORRECTION_MODES,
    correction_level,
    correction_weights,
    effective_sample_size,
    staleness_notice,
)

PRODUCT_MODES = ("seq_prod_tis", "seq_prod_mis", "seq_prod_rs")


def _weights(diff: list[list[float]], mask: list[list[float]], mode: str, low: float = 0.5, high: float = 2.0):
    d, m = torch.tensor(diff, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64)
    engine = torch.full_like(d, -2.0)
    return correction_weights(engine + d, engine, m, mode, low=low, high=high)


def test_product_modes_are_sequence_level_registry_entries() -> None:
    assert all(correction_level(mode) == "sequence" for mode in PRODUCT_MODES)
    assert set(PRODUCT_MODES) <= set(CORRECTION_MODES)
    for mode in PRODUCT_MODES:  # a sequence-level objective takes them, and their weights pass its constancy check
        AlgorithmConfig(loss="dspo", rollout_correction={"mode": mode})
        mask = [[1, 1, 1], [1, 1, 0]]
        weights, _ = _weights([[-0.1, 0.2, -0.3], [0.1, 0.0, 0.0]], mask, mode)
        logprobs, advantages = torch.full((2, 3), -1.0, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
        clip = {"clip_low": 3e-4, "clip_high": 4e-4}
        mask_t = torch.tensor(mask, dtype=torch.float64)
        policy_loss("dspo", logprobs, logprobs, advantages, mask_t, clip, weights=weights)


def test_three_tokens_product_is_e_to_the_sum_and_geometric_mean_is_not() -> None:
    """d = −0.1, 0.2, −0.3: P = e^−0.2 = 0.8187308, ρ = e^(−0.2/3) = 0.9355070; P inside [0.5, 2]."""
    diff, mask = [[-0.1, 0.2, -0.3]], [[1, 1, 1]]
    for mode in ("seq_prod_tis", "seq_prod_mis"):
        weights, _ = _weights(diff, mask, mode)
        assert weights.tolist()[0] == pytest.approx([0.8187307531] * 3, abs=1e-9)
    assert _weights(diff, mask, "seq_prod_rs")[0].tolist() == [[1.0, 1.0, 1.0]]
    assert _weights(diff, mask, "seq_tis")[0].tolist()[0] == pytest.approx([0.9355069850] * 3, abs=1e-9)


def test_truncation_mask_and_rejection_when_the_product_leaves_the_bounds() -> None:
    """d = 0.5 x 3: P = e^1.5 = 4.4816891 > high = 2 -> tis 2, mis 0, rs 0; d = −0.4 x 2: P = e^−0.8 = 0.449 < 0.5."""
    high = _weights([[0.5, 0.5, 0.5]], [[1, 1, 1]], "seq_prod_tis")[0]
    torch.testing.assert_close(high, torch.full((1, 3), 2.0, dtype=torch.float64))
    assert _weights([[0.5, 0.5, 0.5]], [[1, 1, 1]], "seq_prod_mis")[0].eq(0).all()
    assert _weights([[0.5, 0.5, 0.5]], [[1, 1, 1]], "seq_prod_rs")[0].eq(0).all()
    assert _weights([[0.5, 0.5, 0.5]], [[1, 1, 1]], "seq_prod_tis", high=5.0)[0][0, 0].item() == pytest.approx(
        4.4816890703
    )
    low = [[-0.4, -0.4, 0.0]], [[1, 1, 0]]
    assert _weights(*low, "seq_prod_tis")[0][0].tolist() == pytest.approx([0.4493289641, 0.4493289641, 0.0])
    assert _weights(*low, "seq_prod_mis")[0].eq(0).all() and _weights(*low, "seq_prod_rs")[0].eq(0).all()
    assert _weights(*low, "seq_prod_mis", low=0.0)[0][0].tolist() == pytest.approx([0.4493289641] * 2 + [0.0])


def test_masked_positions_are_ignored_and_an_empty_sequence_weighs_zero() -> None:
    """Off-mask positions hold garbage (a huge ratio, NaN): the product is over mask-1 tokens only."""
    old = torch.tensor([[-2.1, 40.0, -1.8], [float("nan"), 7.0, 3.0]])  # engine −2: d = −0.1, (off), 0.2
    engine = torch.full((2, 3), -2.0)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    for mode in PRODUCT_MODES:
        weights, stats = correction_weights(old, engine, mask, mode)
        expected = 1.0 if mode == "seq_prod_rs" else math.exp(0.1)
        expected_weights = torch.tensor([[expected, 0.0, expected], [0.0, 0.0, 0.0]])
        torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=0)
        assert all(torch.isfinite(v) for v in stats.values())
        assert stats["ess"].item() == pytest.approx(1.0)  # one non-empty sequence: the empty one does not count


def test_300_tokens_importance_weight_is_e_minus_3_not_the_geometric_mean() -> None:
    """Mean log-ratio −0.01 over 300 tokens: importance weight e^−3 = 0.0498; the geometric mean e^−0.01 = 0.990."""
    diff, mask = [[-0.01] * 300], [[1.0] * 300]
    product, _ = _weights(diff, mask, "seq_prod_tis", low=0.0)
    geometric, _ = _weights(diff, mask, "seq_tis")
    assert product[0, 0].item() == pytest.approx(math.exp(-3.0), rel=1e-9) and product[0, 0].item() == pytest.approx(
        0.0498, abs=1e-4
    )
    assert geometric[0, 0].item() == pytest.approx(0.9900498337, rel=1e-9)
    assert _weights(diff, mask, "seq_prod_mis", low=0.0)[0][0, -1].item() == pytest.approx(math.exp(-3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_huge_positive_sum_does_not_overflow(dtype: torch.dtype) -> None:
    """Σ d = 1000 (e^1000 is inf even in float64): tis caps at high, mis and rs reject, nothing is inf or NaN."""
    engine = torch.zeros(1, 1000, dtype=dtype)
    old, mask = engine + 1.0, torch.ones(1, 1000, dtype=dtype)
    expected = {"seq_prod_tis": 2.0, "seq_prod_mis": 0.0, "seq_prod_rs": 0.0}
    for mode, value in expected.items():
        weights, stats = correction_weights(old, engine, mask, mode)
        assert torch.isfinite(weights).all() and all(torch.isfinite(v) for v in stats.values())
        assert weights.tolist()[0] == pytest.approx([value] * 1000, rel=1e-6)
    weights, _ = correction_weights(engine - 1.0, engine, mask, "seq_prod_tis")  # Σ = −1000: underflows to 0
    assert weights.eq(0).all()


# ---------------------------------------------------------------------------------------------- weight statistics
def test_weight_min_and_ess_by_hand_for_a_sequence_mode() -> None:
    """seq_prod_tis (high 4): S = 0, log 2, log 0.5 -> w = 1, 2, 0.5; the 4th sequence is empty.
    ESS = (1 + 2 + 0.5)² / (3 · (1 + 4 + 0.25)) = 12.25 / 15.75 = 0.7777778; weight_min = 0.5."""
    log2 = math.log(2.0)
    diff = [[0.3, -0.3, 0.0], [log2, 0.0, 0.0], [-log2, 0.0, 0.0], [9.0, 9.0, 9.0]]
    mask = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]
    _, stats = _weights(diff, mask, "seq_prod_tis", high=4.0)
    assert stats["ess"].item() == pytest.approx(12.25 / 15.75, abs=1e-9)
    assert stats["weight_min"].item() == pytest.approx(0.5, abs=1e-9)


def test_weight_min_and_ess_by_hand_for_a_token_mode() -> None:
    """token_tis (high 4): sequence 0 has ratios 1 and 3 (mean 2), sequence 1 ratio 1: ESS over the per-sequence
    means = (2 + 1)² / (2 · (4 + 1)) = 0.9; weight_min over tokens = 1."""
    _, stats = _weights([[0.0, math.log(3.0)], [0.0, 5.0]], [[1, 1], [1, 0]], "token_tis", high=4.0)
    assert stats["ess"].item() == pytest.approx(0.9, abs=1e-9)
    assert stats["weight_min"].item() == pytest.approx(1.0, abs=1e-9)


def test_effective_sample_size_edges() -> None:
    def ess(values: list[float]) -> float:
        return effective_sample_size(torch.tensor(values, dtype=torch.float64)).item()

    assert ess([0.7, 0.7, 0.7]) == pytest.approx(1.0) and ess([]) == 1.0  # equal weights / no sequence
    assert ess([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)  # one sequence holds all the weight
    assert ess([0.0, 0.0]) == 0.0  # everything rejected
    _, stats = _weights([[1.0], [-1.0]], [[1], [1]], "seq_prod_rs", low=0.9, high=1.1)
    assert stats["ess"].item() == 0.0 and stats["weight_min"].item() == 0.0


# ---------------------------------------------------------------------------------------- staleness notice
@pytest.mark.parametrize("mode", ["none", "token_rs", "seq_rs", "seq_prod_rs"])
def test_modes_that_do_not_reweight_warn_at_k_ge_1_only(mode: str) -> None:
    assert staleness_notice(mode, 0) is None
    level, message = staleness_notice(mode, 2)
    assert level == logging.WARNING
    assert f"algorithm.rollout_correction.mode={mode}" in message and "rollout.max_staleness=2" in message
    assert "algorithm.rollout_correction.mode=seq_prod_tis" in message  # what to use instead


@pytest.mark.parametrize("mode", ["seq_tis", "seq_mis"])
def test_geometric_mean_modes_get_a_softer_note_at_k_ge_1(mode: str) -> None:
    assert staleness_notice(mode, 0) is None
    level, message = staleness_notice(mode, 1)
    assert level == logging.INFO and "geometric mean" in message and "seq_prod_tis" in message
    assert "warn" not in message.lower()  # a k >= 1 default run's console has no warning (tests/test_train.py)


@pytest.mark.parametrize("mode", ["seq_prod_tis", "seq_prod_mis", "token_tis", "token_mis"])
def test_importance_weight_modes_say_nothing(mode: str) -> None:
    assert staleness_notice(mode, 0) is None and staleness_notice(mode, 3) is None


def test_the_effective_sample_size_does_not_depend_on_the_weights_scale():
    """Equal product weights of e^-60 (their squares underflow in float32) are as effective as equal weights of 1."""
    from dspo.algorithms.rollout_correction import effective_sample_size

    tiny = torch.full((4,), math.exp(-60.0), dtype=torch.float32)
    assert float(effective_sample_size(tiny)) == pytest.approx(1.0)
    uneven = torch.tensor([1.0, 0.0, 0.0, 0.0]) * math.exp(-60.0)
    assert float(effective_sample_size(uneven)) == pytest.approx(0.25)


@pytest.mark.parametrize("mode", ["seq_prod_tis", "seq_prod_mis", "seq_prod_rs", "seq_tis", "seq_mis", "seq_rs"])
def test_a_split_episode_has_one_importance_weight_over_all_its_tokens(mode: str) -> None:
    """Issue 52 (4): an episode trained as two samples (log-ratio sums −1.0 over 2 tokens and +0.5 over 1 token) gets
    the episode's weight on both: S = −0.5 over 3 tokens, P = e^−0.5 = 0.607, ρ = e^(−0.5/3) = 0.846. Before, each
    sample was weighed alone: e^−1.0 = 0.37 and e^0.5 = 1.65. A third row, an unsplit episode, keeps its own."""
    old = torch.tensor([[-1.5, -1.5, 0.0], [-0.5, 0.0, 0.0], [-0.2, -0.2, 0.0]])
    engine = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0], [-0.1, -0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    episodes = torch.tensor([4, 4, 9])
    weights, stats = correction_weights(old, engine, mask, mode, low=0.5, high=2.0, episodes=episodes)
    product, geometric = math.exp(-0.5), math.exp(-0.5 / 3)
    by_hand = {
        "seq_prod_tis": (product, math.exp(-0.2)),
        "seq_prod_mis": (product, math.exp(-0.2)),
        "seq_prod_rs": (1.0, 1.0),
        "seq_tis": (geometric, math.exp(-0.1)),
        "seq_mis": (geometric, math.exp(-0.1)),
        "seq_rs": (1.0, 1.0),
    }[mode]
    expected = torch.tensor([[by_hand[0]] * 2 + [0.0], [by_hand[0], 0.0, 0.0], [by_hand[1]] * 2 + [0.0]])
    torch.testing.assert_close(weights, expected)
    # one sample of the estimate per episode: two episodes, not three rows
    w = torch.tensor(by_hand, dtype=torch.float64)
    assert float(stats["ess"]) == pytest.approx(float(w.sum() ** 2 / (2 * w.square().sum())), rel=1e-5)
    alone, _ = correction_weights(old, engine, mask, mode, low=0.5, high=2.0)  # without episodes: row by row
    if mode == "seq_prod_tis":
        assert alone[0, 0] == pytest.approx(math.exp(-1.0)) and alone[1, 0] == pytest.approx(math.exp(0.5))
