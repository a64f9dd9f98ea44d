"""Pure-torch algorithm core: objectives (Eq. 2, 6, 11), group filters (Eq. 9), advantage estimators (Eq. 10 and
variants), KL, rollout-training mismatch correction weights; each choice a record in a registry, the shared pieces
public building blocks (`dspo.algorithms.blocks`)."""

from dspo.algorithms.advantages import ADVANTAGES, AdvantageEstimator, group_advantages, register_advantage
from dspo.algorithms.filters import FILTERS, GroupFilter, keep_all, mixed_outcome, register_filter
from dspo.algorithms.losses import OBJECTIVES, ClipRange, Objective, kl_penalty, policy_loss, register_objective
from dspo.algorithms.rollout_correction import CORRECTION_MODES, correction_weights

__all__ = [
    "ADVANTAGES",
    "CORRECTION_MODES",
    "FILTERS",
    "OBJECTIVES",
    "AdvantageEstimator",
    "ClipRange",
    "GroupFilter",
    "Objective",
    "correction_weights",
    "group_advantages",
    "keep_all",
    "kl_penalty",
    "mixed_outcome",
    "policy_loss",
    "register_advantage",
    "register_filter",
    "register_objective",
]
