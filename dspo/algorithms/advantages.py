"""Advantage estimators, one record each in `ADVANTAGES` (`algorithm.advantage`), each a function of a round's
outcome rewards [N, G] (one row per prompt group) returning advantages [N, G].

- `group_norm` (default; DSPO Eq. 10, as GRPO): Â_i = (R_i − mean R) / (std R + δ), with the unbiased standard
  deviation (`torch.std`, Bessel-corrected), the choice of verl and TRL, so that numbers compare with published runs.
  Setting: `eps` = δ (`algorithm.advantage_kwargs.eps`, default 1e-6).
- `group_mean` (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training"): Â_i = R_i − mean R, without the
  division by the std, which up-weights groups whose rewards barely differ (questions almost always or almost never
  solved).
- `rloo` (REINFORCE leave-one-out, Kool et al. 2019; Ahmadian et al. 2024): Â_i = R_i − mean_{j≠i} R_j, a baseline
  that does not include the sample itself (unbiased); equal to G/(G−1) · (R_i − mean R).

Every estimator needs G >= 2 and finite rewards, and gives exactly 0 to a group whose rewards are all equal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from dspo.algorithms.registry import Registry, make_settings

EstimatorFn = Callable[[torch.Tensor, Any], torch.Tensor]  # (rewards [N, G], settings) -> advantages [N, G]


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    estimate: EstimatorFn
    settings: Any = None  # default settings (a dataclass instance), None when the estimator has none

    def make_settings(self, kwargs: Mapping[str, Any] | None = None) -> Any:
        """The defaults with `algorithm.advantage_kwargs` applied (validated)."""
        return make_settings(self.settings, kwargs, "algorithm.advantage_kwargs", f"advantage estimator '{self.name}'")

    def __call__(self, rewards: torch.Tensor, settings: Any = None) -> torch.Tensor:
        return self.estimate(rewards, self.settings if settings is None else settings)


ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator", "algorithm.advantage")


def register_advantage(name: str, settings: Any = None) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: make `fn(rewards [N, G], settings) -> [N, G]` selectable as `algorithm.advantage: <name>`."""

    def wrap(fn: EstimatorFn) -> EstimatorFn:
        ADVANTAGES.add(name, AdvantageEstimator(name, fn, settings))
        return fn

    return wrap


def checked_rewards(rewards: torch.Tensor, where: str) -> torch.Tensor:
    """[N, G] rewards with G >= 2, finite, in at least float32 (float64 stays float64)."""
    if rewards.dim() != 2:
        raise ValueError(f"{where} expects rewards of shape [N, G], got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"group size G must be >= 2 for group-relative advantages, got G={rewards.shape[1]}")
    if rewards.dtype != torch.float64:
        rewards = rewards.float()  # bool/int/bf16 rewards: the std of a few 0/1 values needs float32 at least
    if not torch.isfinite(rewards).all():
        raise ValueError(f"{where}: rewards contain NaN/inf: {rewards.tolist()}; check the reward function")
    return rewards


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Â_i = (R_i − mean(R)) / (std(R) + eps) within each group (Eq. 10).

    Args:
        rewards: [N, G] rewards, one row per prompt group.
        eps: δ in Eq. 10; keeps all-equal groups (std 0) finite — their advantages are exactly 0.

    Returns:
        [N, G] advantages (float32 unless `rewards` is float64).
    """
    rewards = checked_rewards(rewards, "group_advantages")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)  # unbiased
    return (rewards - mean) / (std + eps)


def turn_advantages(
    step_rewards: list[list[float | None]],
    eps: float = 1e-6,
    estimator: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[list[float]]:
    """Advantages of the step rewards of one group's G trajectories (per-turn credit, as StepSearch's token-level
    process supervision): every turn of the group that has a step reward is one sample of a single group, scored by
    `estimator` (rewards [1, K] in float64 -> advantages [1, K]: the configured `algorithm.advantage`, so that the step
    part and the trajectory part of a token's advantage are on one scale); None = `group_norm` with δ = `eps`, each
    turn's (r − mean) / (std + eps). A turn without a step reward (None, e.g. the answer turn) gets 0, and so does every
    turn when the group has fewer than two step rewards.

    Args:
        step_rewards: [G][turns of trajectory i] step rewards, None where a turn has none.
    Returns:
        [G][turns] advantages.
    """
    values = torch.tensor([r for rewards in step_rewards for r in rewards if r is not None], dtype=torch.float64)
    if values.numel() and not torch.isfinite(values).all():
        raise ValueError(f"turn_advantages: step rewards contain NaN/inf: {step_rewards}; check the reward")
    if values.numel() < 2:
        return [[0.0] * len(rewards) for rewards in step_rewards]
    scored = (estimator or partial(group_advantages, eps=eps))(values[None, :])
    if tuple(scored.shape) != (1, values.numel()):
        shape = tuple(scored.shape)
        raise ValueError(f"algorithm.advantage: the estimator returned shape {shape} for rewards [1, {values.numel()}]")
    flat = iter(scored[0].tolist())
    return [[0.0 if r is None else next(flat) for r in rewards] for rewards in step_rewards]


@dataclass(frozen=True)
class GroupNorm:
    """`group_norm`'s setting: δ of Eq. 10."""

    eps: float = 1e-6

    def __post_init__(self) -> None:
        if not self.eps >= 0:
            raise ValueError(f"algorithm.advantage_kwargs.eps: must be >= 0 (δ of Eq. 10), got {self.eps}")


@register_advantage("group_norm", settings=GroupNorm())
def group_norm(rewards: torch.Tensor, settings: GroupNorm) -> torch.Tensor:
    """DSPO Eq. 10 (see the module docstring)."""
    return group_advantages(rewards, eps=settings.eps)


@register_advantage("group_mean")
def group_mean(rewards: torch.Tensor, settings: None = None) -> torch.Tensor:
    """Dr. GRPO: Â_i = R_i − mean R (no division by the standard deviation)."""
    rewards = checked_rewards(rewards, "group_mean")
    return rewards - rewards.mean(dim=1, keepdim=True)


@register_advantage("rloo")
def rloo(rewards: torch.Tensor, settings: None = None) -> torch.Tensor:
    """REINFORCE leave-one-out: Â_i = R_i − (Σ_j R_j − R_i) / (G − 1)."""
    rewards = checked_rewards(rewards, "rloo")
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / (rewards.shape[1] - 1)
    return rewards - others
