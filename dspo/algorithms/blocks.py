"""Building blocks of policy objectives, public so that a new objective is a few lines of calls (docs/extending.md):
masked log-ratios, the sequence ratio (DSPO Eq. 6) of a row or of a whole episode split into rows, the clipped
surrogate (Eq. 11 / PPO), ratio statistics, the correction weights' shapes and the normalizers of a mini-batch.

Conventions (`dspo.algorithms.losses` has the rest): logprobs, old_logprobs, mask are [N, L] with mask 1 on
model-generated tokens only; off-mask positions are *selected away* (torch.where), never multiplied by 0, so padding
that holds -inf or NaN cannot leak (0 * -inf = NaN); sums of log-ratios run in at least float32, because a bf16 sum of
hundreds of them loses the small differences the clip acts on.
"""

from __future__ import annotations

import math

import torch

from dspo.algorithms.rollout_correction import sequence_modes

Stats = dict[str, torch.Tensor]
LEVELS = ("sequence", "token")


def check_shapes(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    token_advantages: bool = False,
) -> None:
    """logprobs, old_logprobs, mask: one [N, L]; advantages: [N] (one per sequence), or [N, L] (one per token, from
    per-turn credit) for an objective that takes `token_advantages`."""
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must share one [N, L] shape"
        )
    if token_advantages and advantages.shape == logprobs.shape:
        return
    if advantages.shape != logprobs.shape[:1]:
        hint = ""
        if advantages.dim() == 2:
            hint = " or [N, L]" if token_advantages else " (per-token advantages need a token-level objective)"
        raise ValueError(f"advantages must be [N]={logprobs.shape[0]}{hint}, got {tuple(advantages.shape)}")


def masked_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logπθ − logπold) on mask-1 tokens and exactly 0 elsewhere, in >= float32; plus the float mask. [N, L] each."""
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    keep = mask.bool()
    delta = torch.where(keep, logprobs.to(dtype) - old_logprobs.to(dtype), 0.0)
    return delta, keep.to(dtype)


def sequence_ratio(delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """s_i = exp(Σ_t m_it δ_it / Σ_t m_it) (DSPO Eq. 6, the geometric mean of the token ratios) [N], and the lengths
    |y_i| [N]. `delta` and the float `mask` as `masked_log_ratio` returns them; an empty sequence has s_i = 1."""
    lengths = mask.sum(dim=1)  # [N]
    return torch.exp(delta.sum(dim=1) / lengths.clamp(min=1.0)), lengths


def episode_ratio(
    delta: torch.Tensor, mask: torch.Tensor, episodes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DSPO's sequence ratio (Eq. 6) of a whole episode, whose samples are several rows of the batch:

        s_e = exp( Σ_{i∈e} Σ_t m_it δ_it / Σ_{i∈e} Σ_t m_it )

    the geometric mean of the token ratios over all the episode's trained tokens, what `sequence_ratio` gives the
    episode unsplit. `episodes` [N] ids: rows that share one are samples of one episode (a compacted context, an
    endpoint's prefix break, a partial rollout: `Trajectory.segments`), in any order; None: every row its own episode,
    where this is `sequence_ratio`. `delta` and the float `mask` as `masked_log_ratio` returns them.

    Returns, each [N]: the ratio of each row's episode (1 for an episode without trained tokens), its episode's
    length |y_e| (trained tokens of all its rows), and a bool that is True on one row per episode (the first), so that
    statistics count episodes. An unsplit episode's values are bit-identical to `sequence_ratio`'s: its pooled sums
    add one row's sum to 0, which is exact.
    """
    if episodes is None:
        ratio, lengths = sequence_ratio(delta, mask)
        return ratio, lengths, torch.ones_like(lengths, dtype=torch.bool)
    if episodes.shape != delta.shape[:1]:
        raise ValueError(f"episodes must be [N]={delta.shape[0]} ids, got {tuple(episodes.shape)}")
    _, inverse = torch.unique(episodes.to(delta.device), return_inverse=True)  # row -> its episode's index [N]
    count = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = delta.new_zeros(count).index_add_(0, inverse, delta.sum(dim=1))  # [E]: Σ over the episode's rows
    lengths = mask.new_zeros(count).index_add_(0, inverse, mask.sum(dim=1))  # [E]: |y_e|
    ratio = torch.exp(sums / lengths.clamp(min=1.0))  # [E], the same expression as sequence_ratio's
    rows = torch.arange(inverse.numel(), device=inverse.device)
    first_row = torch.full((count,), inverse.numel(), device=inverse.device).scatter_reduce_(0, inverse, rows, "amin")
    first = torch.zeros_like(inverse, dtype=torch.bool).index_fill_(0, first_row, True)
    return ratio[inverse], lengths[inverse], first


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """min(ratio·A, clip(ratio, 1−ε_low, 1+ε_high)·A) (Eq. 11; PPO's), and a bool tensor: where the clipped branch is
    active (there the term has no gradient). Broadcasts: ratio [N] with A [N], or ratio [N, L] with A [N, 1]."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    is_clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
    return surrogate, is_clipped


def ratio_stats(ratio: torch.Tensor, valid: torch.Tensor, is_clipped: torch.Tensor) -> Stats:
    """clipfrac, ratio_mean, ratio_min, ratio_max over the `valid` entries (detached); the neutral ratio 1 and
    clipfrac 0 when none is valid. The trainer logs these as `loss/*` (min and max as the mini-batch's extremes)."""
    ratio, valid = ratio.detach(), valid.bool()
    if valid.any():
        r = ratio[valid]
        return {
            "clipfrac": is_clipped[valid].to(ratio.dtype).mean(),
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
        }
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)  # no trained token: report the neutral ratio
    return {"clipfrac": torch.zeros_like(one), "ratio_mean": one, "ratio_min": one, "ratio_max": one}


def token_weights(weights: torch.Tensor | None, mask: torch.Tensor, where: str) -> torch.Tensor | None:
    """Detached correction weights on mask-1 tokens, exactly 0 elsewhere, in the mask's dtype. [N, L] or None."""
    if weights is None:
        return None
    if weights.shape != mask.shape:
        raise ValueError(f"{where}: weights {tuple(weights.shape)} must have the mask's shape {tuple(mask.shape)}")
    return torch.where(mask.bool(), weights.detach().to(mask.dtype), 0.0)


def sequence_weights(weights: torch.Tensor | None, mask: torch.Tensor, where: str) -> torch.Tensor | None:
    """One weight per sequence [N]: the value on its mask-1 tokens (0 for an empty sequence); refused when it varies
    within a sequence (a token-level correction given to a sequence-level objective)."""
    token = token_weights(weights, mask, where)
    if token is None:
        return None
    keep = mask.bool()
    high = torch.where(keep, token, -math.inf).amax(dim=1)
    low = torch.where(keep, token, math.inf).amin(dim=1)
    if bool(((high != low) & keep.any(dim=1)).any()):
        raise ValueError(
            f"{where} is sequence-level: its weights must be constant over each sequence's trained tokens "
            f"(use a sequence-level algorithm.rollout_correction.mode: {sequence_modes()})"
        )
    return torch.where(keep.any(dim=1), high, 0.0)


def denominator(normalizer: float | None, own_count: float, where: str) -> float:
    """The loss divisor: `normalizer` (the whole mini-batch's count of the objective's unit) if given, else this
    micro-batch's own count; at least 1 (an all-empty mini-batch gives loss 0, not 0/0). Negative or non-finite
    normalizers are an error. Summing micro-batch losses divided this way gives the mini-batch loss exactly."""
    if normalizer is None:
        return max(float(own_count), 1.0)
    value = float(normalizer)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: normalizer must be a finite count >= 0 (units in the mini-batch), got {normalizer}")
    return max(value, 1.0)


def token_normalizer(num_tokens: float, world_size: int = 1) -> float:
    """Token-mean normalizer of one process's loss under data parallelism (DDP/FSDP average gradients over W ranks).

    `num_tokens` is the masked-token count T of the whole mini-batch over all W ranks (all-reduced). Rank r's loss
    −Σ_r/(T/W), averaged over ranks by DDP, gives −Σ_r Σ_r/T: the global token mean, not a mean of per-rank means.
    """
    if world_size < 1:
        raise ValueError(f"token_normalizer: world_size must be >= 1, got {world_size}")
    return float(max(num_tokens, 1)) / world_size


def loss_normalizer(unit: str, num_sequences: float, num_tokens: float, world_size: int = 1) -> float:
    """The `normalizer` of an objective whose loss averages over `unit` ("sequence" or "token"), for a mini-batch with
    these counts (at least 1). `num_sequences` is this process's share of the mini-batch's episodes (all ranks' count
    divided by `world_size`: DDP's average is then the global mean, whatever each rank holds; an episode split into
    samples counts once); `num_tokens` is the count over all `world_size` processes (see `token_normalizer`)."""
    if unit not in LEVELS:
        raise ValueError(f"loss_normalizer: unit must be one of {LEVELS}, got {unit!r}")
    return float(max(num_sequences, 1)) if unit == "sequence" else token_normalizer(num_tokens, world_size)
