"""`AlgorithmConfig` validation: every rejected value gives the exact message naming its key; the boundary values
that are allowed construct."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from dspo.algorithms.advantages import ADVANTAGES, GroupNorm
from dspo.algorithms.config import AlgorithmConfig
from dspo.algorithms.filters import FILTERS
from dspo.algorithms.losses import KL_ESTIMATORS, OBJECTIVES, ClipRange

REJECTED = [
    ({"loss": "ppo"}, f"algorithm.loss: unknown objective 'ppo'; choose one of {sorted(OBJECTIVES)}"),
    ({"filter": "x"}, f"algorithm.filter: unknown group filter 'x'; choose one of {sorted(FILTERS)}"),
    ({"advantage": "x"}, f"algorithm.advantage: unknown advantage estimator 'x'; choose one of {sorted(ADVANTAGES)}"),
    ({"group_size": 1}, "algorithm.group_size: must be >= 2 for group-normalized advantages, got 1"),
    ({"batch_groups": 0}, "algorithm.batch_groups: must be >= 1, got 0"),
    ({"num_minibatches": 3}, "algorithm.num_minibatches: must divide B*G=40, got 3"),
    ({"num_minibatches": 0}, "algorithm.num_minibatches: must divide B*G=40, got 0"),
    ({"micro_batch_size": 0}, "algorithm.micro_batch_size: must be >= 1, got 0"),
    (
        {"loss_kwargs": {"clip_low": 1.0}},
        "algorithm.loss_kwargs.clip_low/clip_high: need 0 <= clip_low < 1 and clip_high >= 0, got 1.0/0.0004",
    ),
    (
        {"loss_kwargs": {"clip_low": -0.1}},
        "algorithm.loss_kwargs.clip_low/clip_high: need 0 <= clip_low < 1 and clip_high >= 0, got -0.1/0.0004",
    ),
    (
        {"loss_kwargs": {"clip_high": -0.1}},
        "algorithm.loss_kwargs.clip_low/clip_high: need 0 <= clip_low < 1 and clip_high >= 0, got 0.0003/-0.1",
    ),
    (
        {"loss_kwargs": {"epsilon": 0.2}},
        "algorithm.loss_kwargs.epsilon: objective 'dspo' has no setting 'epsilon' (its settings: clip_low, clip_high)",
    ),
    ({"loss_kwargs": 0.2}, "algorithm.loss_kwargs: must be a mapping of settings, got float"),
    (
        {"advantage": "rloo", "advantage_kwargs": {"eps": 1e-6}},
        "algorithm.advantage_kwargs.eps: advantage estimator 'rloo' has no setting 'eps' (it has no settings)",
    ),
    ({"advantage_kwargs": {"eps": -1.0}}, "algorithm.advantage_kwargs.eps: must be >= 0 (δ of Eq. 10), got -1.0"),
    ({"kl_coef": -0.5}, "algorithm.kl_coef: must be >= 0, got -0.5"),
    ({"kl_estimator": "k4"}, f"algorithm.kl_estimator: unknown estimator 'k4'; choose one of {sorted(KL_ESTIMATORS)}"),
    ({"temperature": 0.0}, "algorithm.temperature: must be > 0, got 0.0"),
]


@pytest.mark.parametrize("overrides,message", REJECTED, ids=[str(o) for o, _ in REJECTED])
def test_rejected_values_name_their_key(overrides, message):
    with pytest.raises(ValueError) as err:
        AlgorithmConfig(**overrides)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        {"group_size": 2},
        {"batch_groups": 1, "group_size": 2, "num_minibatches": 2},
        {"micro_batch_size": 1},
        {"loss_kwargs": {"clip_low": 0.0, "clip_high": 0.0}},
        {"advantage_kwargs": {"eps": 0.0}},
        {"kl_coef": 0.0},
        {"temperature": 1e-3},
        {"num_minibatches": 40},
    ],
)
def test_boundary_values_are_allowed(overrides):
    config = AlgorithmConfig(**overrides)
    assert all(getattr(config, key) == value for key, value in overrides.items())


def test_the_config_resolves_its_records_and_their_settings():
    """Issue 30: the objective's settings are its record's defaults with loss_kwargs applied; the same for the
    advantage estimator; the filter's record is the registered one."""
    config = AlgorithmConfig(loss="dapo", loss_kwargs={"clip_high": 0.3}, filter="none", advantage="rloo")
    assert config.objective is OBJECTIVES["dapo"] and config.objective_settings == ClipRange(0.2, 0.3)
    assert config.group_filter is FILTERS["none"] and config.estimator is ADVANTAGES["rloo"]
    rewards = torch.tensor([[1.0, 0.0, 0.0]])
    torch.testing.assert_close(config.advantages(rewards), torch.tensor([[1.0, -0.5, -0.5]]))  # 1 − 0, 0 − 1/2
    default = AlgorithmConfig()
    assert default.objective_settings == ClipRange(3e-4, 4e-4) and default.estimator is ADVANTAGES["group_norm"]
    assert AlgorithmConfig(advantage_kwargs={"eps": 0.5})._advantage_settings == GroupNorm(0.5)
    assert asdict(config)["loss_kwargs"] == {"clip_high": 0.3}  # plain: hyper-parameters and checkpoints


def test_rollout_correction_must_be_a_mapping():
    with pytest.raises(TypeError, match="^algorithm.rollout_correction must be a mapping with mode/low/high, got int$"):
        AlgorithmConfig(rollout_correction=5)


def test_check_world_size_messages():
    config = AlgorithmConfig(group_size=3, batch_groups=4, num_minibatches=4)
    config.check_world_size(1)
    with pytest.raises(ValueError) as err:
        config.check_world_size(2)
    assert str(err.value) == (
        "algorithm.num_minibatches=4 must divide the sequences per process (algorithm.batch_groups / trainer.devices)"
        " * algorithm.group_size = 6 with 2 processes; change one of these keys"
    )
    for world_size in (0, 3):
        with pytest.raises(ValueError) as err:
            config.check_world_size(world_size)
        assert str(err.value) == (
            f"algorithm.batch_groups=4 must be divisible by the process count (trainer.devices x nodes = {world_size})"
        )
    AlgorithmConfig(group_size=4, batch_groups=4, num_minibatches=4).check_world_size(4)  # 1 group x 4 per rank


def test_rollout_correction_bounds_include_their_ends():
    for low, high in ((0.0, 1.0), (1.0, 1.0), (0.5, 2.0)):
        config = AlgorithmConfig(rollout_correction={"mode": "seq_mis", "low": low, "high": high})
        assert (config.rollout_correction.low, config.rollout_correction.high) == (low, high)
    with pytest.raises(ValueError) as err:
        AlgorithmConfig(rollout_correction={"mode": "seq_mis", "low": 1.5, "high": 2.0})
    assert str(err.value) == (
        "algorithm.rollout_correction.low/high: need 0 <= low <= 1 <= high (finite) so that on-policy tokens "
        "(ratio 1) keep weight 1, got low=1.5, high=2.0"
    )


def test_the_estimators_settings_reach_the_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # std 0.5: eps 0.5 halves Eq. 10's advantages
    assert AlgorithmConfig().advantages(rewards)[0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    halved = AlgorithmConfig(advantage_kwargs={"eps": 0.5}).advantages(rewards)
    assert halved[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
