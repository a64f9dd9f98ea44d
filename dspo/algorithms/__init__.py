"""Pure-torch algorithm core: advantages (Eq. 10), group filters (Eq. 9), policy objectives (Eq. 2, 6, 11), KL,
rollout-training mismatch correction weights."""

from dspo.algorithms.advantages import group_advantages
from dspo.algorithms.filters import FILTERS, get_filter, keep_all, mixed_outcome
from dspo.algorithms.losses import POLICY_LOSSES, kl_penalty, policy_loss
from dspo.algorithms.rollout_correction import CORRECTION_MODES, correction_weights

__all__ = [
    "CORRECTION_MODES",
    "FILTERS",
    "POLICY_LOSSES",
    "correction_weights",
    "get_filter",
    "group_advantages",
    "keep_all",
    "kl_penalty",
    "mixed_outcome",
    "policy_loss",
]
