"""Dynamic outcome filter (DSPO Eq. 9) and the filter registry."""

import itertools

import pytest
import torch

from dspo.algorithms.filters import FILTERS, keep_all, mixed_outcome


def test_binary_cases() -> None:
    rewards = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # Σ = 0: all wrong → drop
            [1.0, 1.0, 1.0, 1.0],  # Σ = G: all right → drop
            [1.0, 0.0, 0.0, 0.0],  # Σ = 1 → keep
            [0.0, 1.0, 1.0, 1.0],  # Σ = 3 → keep
        ]
    )
    assert mixed_outcome(rewards).tolist() == [False, False, True, True]


def test_matches_equation_9_exhaustively_for_binary_groups() -> None:
    rows = torch.tensor(list(itertools.product([0.0, 1.0], repeat=3)))  # all 8 groups of G = 3
    total = rows.sum(dim=1)
    assert torch.equal(mixed_outcome(rows), (total > 0) & (total < 3))


def test_non_binary_rewards_keep_iff_not_all_equal() -> None:
    rewards = torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.2, 0.7], [0.0, 0.0, 0.1], [0.3, 0.3, 0.3]])
    assert mixed_outcome(rewards).tolist() == [False, True, True, False]


@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.float64])
def test_integer_and_bool_rewards(dtype: torch.dtype) -> None:
    rewards = torch.tensor([[1, 1], [1, 0]]).to(dtype)
    keep = mixed_outcome(rewards)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, True]


def test_empty_batch() -> None:
    assert mixed_outcome(torch.zeros(0, 4)).shape == (0,)


def test_keep_all_and_registry() -> None:
    rewards = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    assert keep_all(rewards).tolist() == [True, True]
    assert FILTERS["mixed_outcome"].keep is mixed_outcome and not FILTERS["mixed_outcome"].keeps_everything
    assert FILTERS["none"].keep is keep_all and FILTERS["none"].keeps_everything  # declared: no over-sampling
    assert FILTERS["none"](rewards).tolist() == [True, True]  # a record calls its function
    with pytest.raises(KeyError, match=r"unknown group filter 'mixed' \(config key algorithm.filter\)"):
        FILTERS["mixed"]


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match=r"\[N, G\]"):
        mixed_outcome(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"\[N, G\]"):
        keep_all(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="NaN"):
        mixed_outcome(torch.tensor([[1.0, float("nan")]]))
