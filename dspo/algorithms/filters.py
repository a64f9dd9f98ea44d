"""Group filters applied before a rollout group enters the batch, one record each in `FILTERS` (`algorithm.filter`).

`mixed_outcome` is DSPO's dynamic outcome filter (Eq. 9, also DAPO's "dynamic sampling"): groups whose G rewards are
all equal carry zero advantage and only dilute the batch, so they are dropped and the sampler draws more prompts.
A filter's record declares `keeps_everything` when it never drops a group: the sampler then draws exactly B prompts
per round instead of over-sampling for an expected keep-rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspo.algorithms.registry import Registry

FilterFn = Callable[[torch.Tensor], torch.Tensor]  # rewards [N, G] -> [N] bool: keep group i


@dataclass(frozen=True)
class GroupFilter:
    name: str
    keep: FilterFn
    keeps_everything: bool = False  # never drops a group: no over-sampling needed

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        return self.keep(rewards)


FILTERS: Registry[GroupFilter] = Registry("group filter", "algorithm.filter")


def register_filter(name: str, keeps_everything: bool = False) -> Callable[[FilterFn], FilterFn]:
    """Decorator: make a filter selectable as `algorithm.filter: <name>`."""

    def wrap(fn: FilterFn) -> FilterFn:
        FILTERS.add(name, GroupFilter(name, fn, keeps_everything))
        return fn

    return wrap


@register_filter("mixed_outcome")
def mixed_outcome(rewards: torch.Tensor) -> torch.Tensor:
    """Keep group i iff 0 < Σ_j R_ij < G (Eq. 9). For non-binary rewards: iff not all rewards are equal.

    Args:
        rewards: [N, G].
    Returns:
        [N] bool mask of groups to keep.
    """
    if rewards.dim() != 2:
        raise ValueError(f"mixed_outcome expects rewards of shape [N, G], got {tuple(rewards.shape)}")
    if rewards.is_floating_point() and not torch.isfinite(rewards).all():
        # NaN != NaN would keep the group and poison its advantages; fail where the bad reward is visible.
        raise ValueError(f"mixed_outcome: rewards contain NaN/inf: {rewards.tolist()}; check the reward function")
    return (rewards != rewards[:, :1]).any(dim=1)


@register_filter("none", keeps_everything=True)
def keep_all(rewards: torch.Tensor) -> torch.Tensor:
    """No filter (GRPO, GSPO = "DSPO w/o dynamic filter"): keep every group."""
    if rewards.dim() != 2:
        raise ValueError(f"keep_all expects rewards of shape [N, G], got {tuple(rewards.shape)}")
    return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
