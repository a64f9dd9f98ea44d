"""A new policy objective, registered in a few lines: sequence-level CISPO (docs/extending.md, section 1).

CISPO (MiniMax-M1) clips the importance-sampling *weight* instead of the surrogate: the weight is detached, so every
trained token keeps its gradient, even when the ratio left the trust region (PPO/GRPO-style clipping zeroes those).
Here the ratio is DSPO's sequence ratio s_i (geometric mean of the token ratios, Eq. 6):

    s_i   = exp( Σ_t m_it (logπθ − logπold) / Σ_t m_it )
    J     = (1/N) Σ_i sg( clip(s_i, 1 − ε_low, 1 + ε_high) ) · Â_i · (1/|y_i|) Σ_t m_it logπθ(y_it)
    ∇J    = (1/N) Σ_i clip(s_i, ...) · Â_i · (1/|y_i|) Σ_t m_it ∇logπθ(y_it)

The loss value is a log-likelihood scale, not a surrogate near 0: compare gradients and rewards across objectives, not
`train/loss`. Use it with:

    PYTHONPATH=docs/examples dspo-train 'imports=[my_objective]' algorithm.loss=seq_cispo
"""

from __future__ import annotations

import torch

from dspo.algorithms.losses import register_loss


@register_loss("seq_cispo", normalizer_unit="sequence", ratio_level="sequence")
def sequence_cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sequence-level clipped-IS-weight policy gradient; conventions as in `dspo.algorithms.losses` (shapes [N, L],
    advantages [N], `normalizer` = sequences in the mini-batch, `weights` one value per sequence on its mask)."""
    keep = mask.bool()
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # sums of many log-ratios in >= float32
    lengths = keep.sum(dim=1).to(dtype)  # [N]
    per_token = torch.where(keep, logprobs.to(dtype), 0.0)  # select, not multiply: padding may hold -inf
    delta = per_token - torch.where(keep, old_logprobs.to(dtype), 0.0)
    mean_logprob = per_token.sum(dim=1) / lengths.clamp(min=1.0)  # [N]
    ratio = torch.exp(delta.sum(dim=1) / lengths.clamp(min=1.0)).detach()  # [N]
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    if weights is not None:  # rollout correction: sequence-level modes give one value per sequence
        weight = weight * torch.where(keep, weights.detach().to(dtype), 0.0).amax(dim=1)
    objective = torch.where(lengths > 0, weight * advantages.to(dtype) * mean_logprob, 0.0)
    count = float(normalizer) if normalizer is not None else float(objective.shape[0])
    loss = -objective.sum() / max(count, 1.0)
    trained = lengths > 0
    clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    one = torch.ones((), dtype=dtype, device=ratio.device)
    stats = {
        "clipfrac": clipped[trained].to(dtype).mean() if trained.any() else 0 * one,
        "ratio_mean": ratio[trained].mean() if trained.any() else one,
        "ratio_min": ratio[trained].min() if trained.any() else one,
        "ratio_max": ratio[trained].max() if trained.any() else one,
    }
    return loss, stats
