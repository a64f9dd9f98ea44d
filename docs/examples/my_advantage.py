"""A new advantage estimator: REINFORCE++'s baseline form (docs/extending.md, section 2).

REINFORCE++-baseline (Hu et al. 2025) keeps GRPO's group mean as the baseline but divides by the standard deviation
of the whole *batch* of centred rewards rather than of each group, so that a group whose rewards barely differ is not
blown up to unit scale:

    Â_ij = (R_ij − mean_j R_i·) / (std over all i, j of (R_ij − mean_j R_i·) + eps)

Use it with:

    PYTHONPATH=docs/examples dspo-train 'imports=[my_advantage]' algorithm.advantage=batch_std
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspo.algorithms import register_advantage
from dspo.algorithms.advantages import checked_rewards


@dataclass(frozen=True)
class BatchStd:
    eps: float = 1e-6


@register_advantage("batch_std", settings=BatchStd())
def batch_std_advantages(rewards: torch.Tensor, settings: BatchStd) -> torch.Tensor:
    rewards = checked_rewards(rewards, "batch_std")  # [N, G], G >= 2, finite, float
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (centred.std() + settings.eps)  # one (unbiased) std for the whole round
