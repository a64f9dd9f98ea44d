"""A new policy objective with a setting of its own: sequence-level CISPO (docs/extending.md, section 1).

CISPO (MiniMax-M1) clips the importance-sampling *weight* instead of the surrogate: the weight is detached, so every
trained token keeps its gradient, even when the ratio left the trust region (PPO/GRPO-style clipping zeroes those).
Here the ratio is DSPO's sequence ratio s_i (geometric mean of the token ratios, Eq. 6):

    w_i   = sg( clip(s_i, 1 − ε_low, 1 + ε_high) )        (MiniMax-M1 sets no lower bound: lower_bound=false)
    J     = (1/N) Σ_i w_i · Â_i · (1/|y_i|) Σ_t m_it logπθ(y_it)

Its own setting, beside the clip range: `lower_bound`. The loss is on a log-likelihood scale, not a surrogate near 0:
compare objectives by reward and validation, not by `train/loss`. Use it with:

    PYTHONPATH=docs/examples dspo-train 'imports=[my_objective]' algorithm.loss=seq_cispo \
        algorithm.loss_kwargs.clip_high=0.28 +algorithm.loss_kwargs.lower_bound=true
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspo.algorithms import ClipRange, register_objective
from dspo.algorithms.blocks import masked_log_ratio, ratio_stats, sequence_ratio, sequence_weights


@dataclass(frozen=True)
class CispoSettings(ClipRange):
    lower_bound: bool = False  # clip the weight from below at 1 − clip_low too (MiniMax-M1: no lower bound)


@register_objective("seq_cispo", settings=CispoSettings(clip_low=0.2, clip_high=0.28))
def sequence_cispo_loss(logprobs, old_logprobs, advantages, mask, settings, normalizer=None, weights=None):
    delta, mask_f = masked_log_ratio(logprobs, old_logprobs, mask)  # [N, L], 0 off the mask
    ratio, lengths = sequence_ratio(delta, mask_f)  # s_i [N], |y_i| [N]
    ratio = ratio.detach()
    low = 1.0 - settings.clip_low if settings.lower_bound else 0.0
    weight = ratio.clamp(low, 1.0 + settings.clip_high)  # the detached IS weight
    per_token = torch.where(mask_f.bool(), logprobs.to(mask_f.dtype), 0.0)  # select: padding may hold -inf
    objective = weight * advantages.to(mask_f.dtype) * per_token.sum(dim=1) / lengths.clamp(min=1.0)  # [N]
    correction = sequence_weights(weights, mask_f, "sequence_cispo_loss")  # rollout correction, one per sequence
    if correction is not None:
        objective = objective * correction
    count = max(float(normalizer if normalizer is not None else objective.shape[0]), 1.0)
    clipped = (ratio < low) | (ratio > 1.0 + settings.clip_high)  # where the weight is not the ratio
    return -torch.where(lengths > 0, objective, 0.0).sum() / count, ratio_stats(ratio, lengths > 0, clipped)
