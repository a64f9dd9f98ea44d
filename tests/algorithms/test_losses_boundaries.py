"""Boundaries of the objectives found by mutation testing (docs/testing.md): which tokens count as clipped, the
registry dispatch, the minimum denominators, dtypes of the statistics and the exact error messages."""

from __future__ import annotations

import pytest
import torch

from dspo.algorithms.blocks import loss_normalizer, token_normalizer
from dspo.algorithms.filters import FILTERS
from dspo.algorithms.losses import (
    OBJECTIVES,
    ClipRange,
    kl_penalty,
    policy_loss,
    sequence_clip_loss,
    token_clip_token_mean_loss,
)


def _one_token_each(deltas: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences of two positions, the second trained: logprobs, old logprobs, mask, each [N, 2]."""
    old = torch.full((len(deltas), 2), -1.0)
    logprobs = old.clone()
    logprobs[:, 1] += torch.tensor(deltas)
    mask = torch.tensor([[0.0, 1.0]] * len(deltas))
    return logprobs, old, mask


def test_clipped_tokens_are_only_those_whose_clip_binds():
    """A token counts as clipped when its advantage sign makes the clip bind: A > 0 above 1+ε_high, A < 0 below
    1−ε_low. Zero advantages never clip; a positive advantage below 1−ε_low does not."""
    advantages = torch.tensor([0.0, 0.0, 0.5, 0.5, -1.0])
    logprobs, old, mask = _one_token_each([0.5, -0.5, -0.5, 0.5, -0.5])
    _, stats = policy_loss("dapo", logprobs, old, advantages, mask, {"clip_low": 0.2, "clip_high": 0.2})
    assert float(stats["clipfrac"]) == pytest.approx(2 / 5)


def test_a_ratio_on_the_clip_bound_is_not_clipped():
    logprobs, old, mask = _one_token_each([0.0, 0.0])  # ratio exactly 1 = 1 ± 0
    for name in ("dapo", "dspo"):
        _, stats = policy_loss(
            name, logprobs, old, torch.tensor([1.0, -1.0]), mask, {"clip_low": 0.0, "clip_high": 0.0}
        )
        assert float(stats["clipfrac"]) == 0.0


def test_every_registered_objective_and_filter_dispatches():
    logprobs, old, mask = _one_token_each([0.1, -0.2, 0.05])
    advantages = torch.tensor([1.0, -0.5, 0.25])
    for name, objective in OBJECTIVES.items():
        assert callable(objective.loss) and objective.name == name
        direct, _ = objective.loss(logprobs, old, advantages, mask, ClipRange(0.2, 0.3))
        dispatched, _ = policy_loss(name, logprobs, old, advantages, mask, {"clip_low": 0.2, "clip_high": 0.3})
        assert torch.equal(direct, dispatched)
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    for name in FILTERS:
        assert FILTERS[name](rewards).shape == (2,)


def test_denominators_are_at_least_one_but_not_more():
    logprobs, old, mask = _one_token_each([0.0])
    advantage = torch.tensor([0.8])
    for normalizer in (None, 1.0, 0.5):  # one sequence / one token: the loss is −Â
        for objective in (sequence_clip_loss, token_clip_token_mean_loss):
            loss, _ = objective(logprobs, old, advantage, mask, ClipRange(0.2, 0.2), normalizer=normalizer)
            assert float(loss) == pytest.approx(-0.8)
    assert loss_normalizer("sequence", 1, 5.0) == 1.0 and loss_normalizer("token", 1, 0.5) == 1.0


def test_shape_and_count_errors_are_exact():
    flat = torch.zeros(3)
    with pytest.raises(ValueError, match=r"must share one \[N, L\] shape"):
        policy_loss("dspo", flat, flat, torch.zeros(3), flat, {"clip_low": 0.2, "clip_high": 0.2})
    wide = torch.zeros(2, 5)  # N = 2, L = 5: the message must give N
    with pytest.raises(ValueError) as err:
        policy_loss("dspo", wide, wide, torch.zeros(3), wide, {"clip_low": 0.2, "clip_high": 0.2})
    assert str(err.value) == "advantages must be [N]=2, got (3,)"
    logprobs, old, mask = _one_token_each([0.0, 0.0])
    with pytest.raises(ValueError, match=r"^kl_penalty: normalizer must be a finite count >= 0"):
        kl_penalty(logprobs, old, mask, normalizer=-1.0)
    with pytest.raises(ValueError) as err:
        token_normalizer(5.0, 0)
    assert str(err.value) == "token_normalizer: world_size must be >= 1, got 0"


def test_statistics_of_an_empty_mask_keep_the_dtype():
    logprobs = torch.zeros(2, 3, dtype=torch.float64)
    loss, stats = policy_loss(
        "dspo",
        logprobs,
        logprobs,
        torch.ones(2, dtype=torch.float64),
        torch.zeros(2, 3),
        {"clip_low": 0.2, "clip_high": 0.2},
    )
    assert float(loss) == 0.0
    assert all(value.dtype == torch.float64 for value in stats.values())
    assert float(stats["ratio_mean"]) == 1.0 and float(stats["clipfrac"]) == 0.0


def test_sequence_weights_ignore_empty_sequences_and_name_the_objective():
    logprobs, old, mask = _one_token_each([0.1, 0.0])
    mask[1] = 0.0  # the second sequence has no trained token
    weights = torch.full_like(mask, 0.5)
    loss, _ = policy_loss(
        "dspo", logprobs, old, torch.tensor([1.0, -1.0]), mask, {"clip_low": 0.2, "clip_high": 0.2}, weights=weights
    )
    assert float(loss) == pytest.approx(-0.5 * min(torch.exp(torch.tensor(0.1)).item(), 1.2) / 2)
    two_tokens = torch.tensor([[0.0, 1.0, 1.0]])
    with pytest.raises(ValueError) as err:
        policy_loss(
            "dspo",
            torch.zeros(1, 3),
            torch.zeros(1, 3),
            torch.ones(1),
            two_tokens,
            {"clip_low": 0.2, "clip_high": 0.2},
            weights=torch.rand(1, 3),
        )
    assert str(err.value) == (
        "sequence_clip_loss is sequence-level: its weights must be constant over each sequence's trained tokens "
        "(use a sequence-level algorithm.rollout_correction.mode: none, seq_mis, seq_prod_mis, seq_prod_rs, "
        "seq_prod_tis, seq_rs or seq_tis)"
    )


def test_token_weights_take_the_masks_dtype():
    logprobs, old, mask = _one_token_each([0.1])
    loss, _ = policy_loss(
        "dapo",
        logprobs,
        old,
        torch.ones(1),
        mask,
        {"clip_low": 0.2, "clip_high": 0.2},
        weights=torch.ones(1, 2).double(),
    )
    assert loss.dtype == torch.float32


def test_the_ratio_is_computed_in_the_promoted_dtype_of_the_new_logprobs():
    """float32 logprobs against float64 old ones: the log-ratio (and loss) stay float32, as for a bf16 policy."""
    logprobs, old, mask = _one_token_each([0.1, -0.1])
    loss, _ = policy_loss(
        "dapo", logprobs, old.double(), torch.tensor([1.0, -1.0]), mask, {"clip_low": 0.2, "clip_high": 0.2}
    )
    assert loss.dtype == torch.float32


def test_weights_of_the_wrong_shape_name_the_objective():
    logprobs, old, mask = _one_token_each([0.1])
    with pytest.raises(ValueError) as err:
        policy_loss(
            "dspo", logprobs, old, torch.ones(1), mask, {"clip_low": 0.2, "clip_high": 0.2}, weights=torch.ones(1, 3)
        )
    assert str(err.value) == "sequence_clip_loss: weights (1, 3) must have the mask's shape (1, 2)"


def test_registering_fills_every_table():
    """The decorators themselves, called at test time (the built-in entries were registered at import, before a
    mutation-testing run switches a mutant on). The entries added here are removed at the end."""
    from dspo.algorithms import losses
    from dspo.algorithms.advantages import ADVANTAGES, register_advantage

    added = {"toy_a", "toy_b", "toy_c"}
    try:
        wrap = losses.register_objective("toy_a", "toy_b", normalizer_unit="token", ratio_level="token")
        assert wrap(sequence_clip_loss) is sequence_clip_loss
        losses.register_objective("toy_c", settings=ClipRange(0.1, 0.2))(sequence_clip_loss)
        for name in ("toy_a", "toy_b"):
            record = losses.OBJECTIVES[name]
            assert (record.name, record.loss, record.settings) == (name, sequence_clip_loss, None)
            assert record.normalizer_unit == record.ratio_level == "token"
        toy_c = losses.OBJECTIVES["toy_c"]
        assert toy_c.normalizer_unit == toy_c.ratio_level == "sequence" and toy_c.settings == ClipRange(0.1, 0.2)
        with pytest.raises(ValueError) as err:
            losses.register_objective("toy_d", ratio_level="word")
        assert str(err.value) == (
            "register_objective('toy_d',): ratio_level must be one of ('sequence', 'token'), got 'word'"
        )
        with pytest.raises(ValueError, match="normalizer_unit must be one of"):
            losses.register_objective("toy_d", normalizer_unit="Sequence")
        assert "toy_d" not in losses.OBJECTIVES

        def keep_all(rewards: torch.Tensor) -> torch.Tensor:
            return torch.ones(rewards.shape[0], dtype=torch.bool)

        from dspo.algorithms.filters import register_filter

        assert register_filter("toy_a", keeps_everything=True)(keep_all) is keep_all
        assert FILTERS["toy_a"].keep is keep_all and FILTERS["toy_a"].keeps_everything
        assert not FILTERS["mixed_outcome"].keeps_everything and FILTERS["none"].keeps_everything

        def centred(rewards: torch.Tensor, settings) -> torch.Tensor:
            return rewards - rewards.mean(dim=1, keepdim=True)

        assert register_advantage("toy_a")(centred) is centred and ADVANTAGES["toy_a"].estimate is centred
    finally:
        for table in (losses.OBJECTIVES, FILTERS, ADVANTAGES):
            for name in added:
                table.pop(name, None)


@pytest.mark.parametrize(
    ("name", "where"),
    [("dspo", "sequence_clip_loss"), ("grpo", "token_clip_sequence_mean_loss"), ("dapo", "token_clip_token_mean_loss")],
)
def test_each_objectives_errors_name_the_objective(name, where):
    logprobs, old, mask = _one_token_each([0.0, 0.0])
    advantages = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError) as err:
        policy_loss(name, logprobs, old, advantages, mask, normalizer=-1.0)
    assert str(err.value) == f"{where}: normalizer must be a finite count >= 0 (units in the mini-batch), got -1.0"
    with pytest.raises(ValueError) as err:
        policy_loss(name, logprobs, old, advantages, mask, weights=torch.ones(2, 3))
    assert str(err.value) == f"{where}: weights (2, 3) must have the mask's shape (2, 2)"


def test_a_one_token_sequence_counts_in_the_ratio_statistics():
    """Sequences with a single trained token are valid for the statistics (lengths > 0, not > 1)."""
    logprobs, old, mask = _one_token_each([0.1, -0.3])
    _, stats = policy_loss("dspo", logprobs, old, torch.tensor([1.0, 1.0]), mask, ClipRange(0.2, 0.2))
    assert float(stats["ratio_min"]) == pytest.approx(torch.exp(torch.tensor(-0.3)).item())
    assert float(stats["ratio_max"]) == pytest.approx(torch.exp(torch.tensor(0.1)).item())
