"""Group-normalized advantages (DSPO Eq. 10): hand-computed values, unbiased std, dtypes, errors."""

import pytest
import torch

from dspo.algorithms.advantages import group_advantages


def test_mixed_groups_hand_values() -> None:
    rewards = torch.tensor(
        [
            [
                1.0,
                0.0,
                0.0,
                0.0,
            ],  # mean 0.25; Σ(R−mean)² = 0.5625 + 3·0.0625 = 0.75; var 0.75/3 → std 0.5
            [1.0, 1.0, 0.0, 0.0],  # mean 0.5; Σ(R−mean)² = 4·0.25 = 1; var 1/3 → std 0.5773503
        ]
    )
    adv = group_advantages(rewards, eps=0.0)
    expected = torch.tensor(
        [
            [1.5, -0.5, -0.5, -0.5],  # 0.75/0.5, −0.25/0.5
            [0.8660254, 0.8660254, -0.8660254, -0.8660254],  # 0.5/0.5773503 = √3/2
        ]
    )
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_uses_unbiased_std() -> None:
    # The biased (population) std of [1,0,0,0] is √(0.75/4) = 0.4330127, which would give 0.75/0.4330127 = 1.7320508.
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    assert adv[0, 0].item() == pytest.approx(1.5, abs=1e-6)


def test_group_of_two() -> None:
    # mean 0.5, unbiased std √((0.25 + 0.25)/1) = 0.7071068 → ±0.5/0.7071068 = ±0.7071068
    adv = group_advantages(torch.tensor([[1.0, 0.0]]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.7071068, -0.7071068]]), atol=1e-6, rtol=0)


def test_eps_enters_denominator() -> None:
    # std 0.5 (see above) + eps 0.5 = 1.0 → advantages equal the centred rewards
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


@pytest.mark.parametrize("value", [0.0, 1.0, 0.3])
def test_all_equal_group_gives_exact_zeros(value: float) -> None:
    adv = group_advantages(torch.full((2, 5), value))
    assert torch.equal(adv, torch.zeros(2, 5))


def test_non_binary_rewards() -> None:
    # mean 0.5, unbiased std √((0.25 + 0 + 0.25)/2) = 0.5 → [−1, 0, 1]
    adv = group_advantages(torch.tensor([[0.0, 0.5, 1.0]]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0]]))


def test_groups_are_independent_and_centred() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    adv = group_advantages(rewards)
    torch.testing.assert_close(adv.sum(dim=1), torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv[0], group_advantages(rewards[:1])[0])
    # [1,1,1,0] mirrors [0,0,0,1]: −0.5 for the three 1s, +1.5 for the 0 (up to eps)
    torch.testing.assert_close(adv[2], torch.tensor([0.5, 0.5, 0.5, -1.5]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.bool, torch.float32),
        (torch.long, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_output_dtype(dtype: torch.dtype, expected: torch.dtype) -> None:
    adv = group_advantages(torch.tensor([[1, 0, 0, 0]]).to(dtype), eps=0.0)
    assert adv.dtype == expected
    assert adv[0, 0].item() == pytest.approx(1.5, abs=1e-6)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match=r"\[N, G\]"):
        group_advantages(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="G must be >= 2"):
        group_advantages(torch.tensor([[1.0], [0.0]]))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))


def test_turn_advantages_by_hand() -> None:
    """One group: step rewards 0.5, 1.0 (trajectory 0), none on the answer turn, -0.5 (trajectory 1). Over the three
    values: mean 1/3, unbiased std sqrt(((1/6)^2 + (2/3)^2 + (5/6)^2) / 2) = sqrt(7/12) = 0.7637626."""
    from dspo.algorithms.advantages import turn_advantages

    out = turn_advantages([[0.5, 1.0, None], [-0.5, None]], eps=0.0)
    std = (7 / 12) ** 0.5
    assert out[0][2] == 0.0 and out[1][1] == 0.0  # no step reward: no step advantage
    assert out[0][:2] == pytest.approx([(0.5 - 1 / 3) / std, (1.0 - 1 / 3) / std])
    assert out[1][0] == pytest.approx((-0.5 - 1 / 3) / std)
    assert turn_advantages([[1.0, None], [None]]) == [[0.0, 0.0], [0.0]]  # fewer than two step rewards: nothing
    assert turn_advantages([[0.2], [0.2]], eps=1e-6) == [[0.0], [0.0]]  # all equal: 0 / (0 + eps)
    with pytest.raises(ValueError, match="step rewards contain NaN"):
        turn_advantages([[float("nan"), 1.0]])


def test_group_mean_and_rloo_by_hand() -> None:
    from dspo.algorithms.advantages import ADVANTAGES

    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert ADVANTAGES["group_mean"](rewards).tolist() == [[0.75, -0.25, -0.25, -0.25]]  # R − mean
    # R_i − mean of the others: 1 − 0, 0 − 1/3, ...
    torch.testing.assert_close(ADVANTAGES["rloo"](rewards), torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))
    torch.testing.assert_close(ADVANTAGES["rloo"](rewards), ADVANTAGES["group_mean"](rewards) * 4 / 3)  # G/(G−1)
    for name in ("group_mean", "rloo", "group_norm"):
        assert torch.equal(ADVANTAGES[name](torch.ones(2, 3)), torch.zeros(2, 3))  # all equal: exactly 0
        with pytest.raises(
            ValueError, match=f"{name if name != 'group_norm' else 'group_advantages'}: rewards contain"
        ):
            ADVANTAGES[name](torch.tensor([[1.0, float("inf")]]))
    estimator = ADVANTAGES["group_norm"]
    assert (
        estimator(torch.tensor([[1.0, 0.0]])).tolist()
        != estimator(torch.tensor([[1.0, 0.0]]), type(estimator.settings)(eps=1.0)).tolist()
    )


def test_turn_advantages_of_the_default_estimator_are_bitwise_the_former_formula() -> None:
    """Issue 39 (6): per-turn step advantages now go through the configured estimator; for the default (group_norm,
    δ = 1e-6) every number is bit for bit what the former (r − mean) / (std + eps) in Python floats gave."""
    import random

    from dspo.algorithms.advantages import turn_advantages
    from dspo.algorithms.config import AlgorithmConfig

    default = AlgorithmConfig().advantages
    for seed in range(200):
        rng = random.Random(seed)
        steps = [[rng.choice([None, rng.uniform(-2, 2), 0.5, -0.25]) for _ in range(rng.randint(1, 4))] for _ in "abcd"]
        values = torch.tensor([r for row in steps for r in row if r is not None], dtype=torch.float64)
        if values.numel() < 2:
            continue
        mean, std = float(values.mean()), float(values.std())
        former = [[0.0 if r is None else (r - mean) / (std + 1e-6) for r in row] for row in steps]
        assert turn_advantages(steps, estimator=default) == former
        assert turn_advantages(steps) == former


def test_turn_advantages_pool_a_ragged_group_not_per_turn_index() -> None:
    """Issue 43 (4): trajectories with 1, 3 and 5 turns. The step rewards of the whole group are one pool:
    A [1.0], B [0.0, None, 1.0], C [0.0, 0.0, 1.0, None, None] -> values 1, 0, 1, 0, 0, 1 (six), mean 0.5, every
    deviation ±0.5, unbiased var 6 * 0.25 / 5 = 0.3, std sqrt(0.3) = 0.5477226 -> ±0.5 / 0.5477226 = ±0.9128709.
    Per turn index it would differ: index 0 alone is [1, 0, 0] (A's first turn would get +1.1547, not +0.9129)."""
    from dspo.algorithms.advantages import turn_advantages

    out = turn_advantages([[1.0], [0.0, None, 1.0], [0.0, 0.0, 1.0, None, None]], eps=0.0)
    a = 0.9128709
    assert [len(row) for row in out] == [1, 3, 5]
    assert out[0] == pytest.approx([a])
    assert out[1] == pytest.approx([-a, 0.0, a])
    assert out[2] == pytest.approx([-a, -a, a, 0.0, 0.0])
