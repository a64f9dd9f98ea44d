"""Rollout-training mismatch correction: importance weights π_old / μ, truncated (TIS) or masked (MIS), and rejection
of outliers (RS). μ is the policy that sampled: the engine's (its own kernels: vLLM, bf16, batch-dependent reductions)
and, at `rollout.max_staleness` = k >= 1, the weights of up to k rounds earlier. The trainer recomputes logπ_old with
its own kernels: the data is never exactly on-policy. With r_it = π_old(y_it) / μ(y_it) on mask-1 tokens, the
weights below multiply each objective's surrogate term (detached, normalizers unchanged).

    token_tis      w_it = min(r_it, high)                          (truncated IS, per token)
    token_mis      w_it = r_it · 1[low <= r_it <= high]             (masked IS, per token)
    token_rs       w_it = 1[low <= r_it <= high]                    (rejection of outlier tokens, no reweighting)
    seq_tis        w_it = min(ρ_i, high)  on every mask-1 token of sequence i
    seq_mis        w_it = ρ_i · 1[low <= ρ_i <= high]
    seq_rs         w_it = 1[low <= ρ_i <= high]
    seq_prod_tis   w_it = exp(min(S_i, log high)) = min(P_i, high)
    seq_prod_mis   w_it = P_i · 1[log low <= S_i <= log high]
    seq_prod_rs    w_it = 1[log low <= S_i <= log high]
    none           w_it = 1

with, over the mask-1 tokens of sequence i (|y_i| of them),
    S_i = Σ_t m_it (logπ_old − logμ)     P_i = exp(S_i) = Π_t r_it          (the sequence's importance weight)
    ρ_i = exp(S_i / |y_i|) = P_i^(1/|y_i|)                                  (its geometric mean)
The product is computed in log space and clamped before the exp (exp(min(S_i, log high))), so it cannot overflow.

What each estimates.
- Product modes (`seq_prod_*`): P_i = π_old(y_i)/μ(y_i) is the importance weight of the whole sequence, so E_μ[P_i f]
  = E_π_old[f]: unbiased before truncation. Truncation (tis) biases it down where P_i > high; the mask (mis) drops the
  samples outside [low, high]. Their price is variance: log P_i is a sum of |y_i| log-ratios, so for roughly
  independent tokens Var(P_i)/E[P_i]² ≈ exp(|y_i|·Var(log r)) − 1, growing like exp(L·Var(log r)) with the length L;
  the truncation bounds it by high², and `mismatch/ess` measures what is left.
- Geometric-mean modes (`seq_tis`, `seq_mis`): ρ_i is not an importance weight: it is the length-normalized ratio
  (DSPO's s_i in Eq. 6, the unit Eq. 11 clips). It stays near 1 as sequences grow, so it under-corrects long sequences
  systematically: 300 trained tokens with mean log(π_old/μ) = −0.01 have importance weight e^−3 ≈ 0.050 and
  ρ_i = e^−0.01 ≈ 0.990. It corrects small, per-token-like numeric differences between engine and trainer, barely
  the policy gap of stale rounds (k >= 1).
- Token modes: r_it corrects each token's term, what a token-level objective's ratio needs (PPO/DAPO-style truncated
  IS); not an estimate under π_old of a sequence-level objective, which refuses them.
- Rejection modes (`*_rs`) and `none` do not reweight: the gradient is the uncorrected one over the samples the two
  policies roughly agree on (all of them for `none`), not an estimate under π_old. (Before issue 29 the `*_mis` names
  meant RS.)
Shapes as in `dspo.algorithms.losses`: [N, L] inputs, weights [N, L], 0 off the mask and on empty sequences.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Stats = dict[str, torch.Tensor]
# (log-ratio old − engine [N, L] 0 off-mask, float mask [N, L], low, high) -> weights [N, L] on every position
WeightFn = Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]


@dataclass(frozen=True)
class CorrectionMode:
    level: str  # "token" | "sequence": sequence modes give one weight per sequence (all its mask-1 tokens)
    weigh: WeightFn
    # what it does for rounds sampled by older weights (rollout.max_staleness >= 1): "corrects" (an importance weight),
    # "numerics" (the geometric mean: engine/trainer numerics, barely the staleness), "ignores" (no reweighting)
    staleness: str = "corrects"


def _sequence_ratio(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ρ_i broadcast to [N, L]: exp of the mean log-ratio over the sequence's mask-1 tokens (1 for an empty one)."""
    mean = delta.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # [N]
    return torch.exp(mean)[:, None].expand_as(delta)


def _inside(ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return ((ratio >= low) & (ratio <= high)).to(ratio.dtype)


def _none(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.ones_like(delta)


def _token_tis(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.exp(delta).clamp(max=high)


def _token_mis(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    ratio = torch.exp(delta)
    return ratio * _inside(ratio, low, high)


def _token_rs(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return _inside(torch.exp(delta), low, high)


def _seq_tis(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return _sequence_ratio(delta, mask).clamp(max=high)


def _seq_mis(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    ratio = _sequence_ratio(delta, mask)
    return ratio * _inside(ratio, low, high)


def _seq_rs(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return _inside(_sequence_ratio(delta, mask), low, high)


def _log_product(delta: torch.Tensor) -> torch.Tensor:
    """S_i = Σ_t m_it (logπ_old − logμ) broadcast to [N, L] (delta is 0 off the mask): log of the product of ratios."""
    return delta.sum(dim=1, keepdim=True).expand_as(delta)


def _log_inside(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """1[low <= e^log_ratio <= high], compared in log space (the ratio itself may overflow)."""
    log_low = math.log(low) if low > 0 else -math.inf
    return ((log_ratio >= log_low) & (log_ratio <= math.log(high))).to(log_ratio.dtype)


def _seq_prod_tis(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.exp(_log_product(delta).clamp(max=math.log(high)))


def _seq_prod_mis(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    log_p = _log_product(delta)
    inside = _log_inside(log_p, low, high)
    return torch.exp(log_p.clamp(max=math.log(high))) * inside  # clamped: no inf · 0 outside


def _seq_prod_rs(delta: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return _log_inside(_log_product(delta), low, high)


CORRECTION_MODES: dict[str, CorrectionMode] = {
    "none": CorrectionMode("sequence", _none, "ignores"),  # constant within a sequence, so valid for every objective
    "token_tis": CorrectionMode("token", _token_tis),
    "token_mis": CorrectionMode("token", _token_mis),
    "token_rs": CorrectionMode("token", _token_rs, "ignores"),
    "seq_tis": CorrectionMode("sequence", _seq_tis, "numerics"),
    "seq_mis": CorrectionMode("sequence", _seq_mis, "numerics"),
    "seq_rs": CorrectionMode("sequence", _seq_rs, "ignores"),
    "seq_prod_tis": CorrectionMode("sequence", _seq_prod_tis),
    "seq_prod_mis": CorrectionMode("sequence", _seq_prod_mis),
    "seq_prod_rs": CorrectionMode("sequence", _seq_prod_rs, "ignores"),
}


def sequence_modes() -> str:
    """The modes a sequence-level objective takes, for error messages: "none, seq_mis, ... or seq_tis"."""
    names = sorted(m for m, c in CORRECTION_MODES.items() if c.level == "sequence")
    return f"{', '.join(names[:-1])} or {names[-1]}"


def correction_level(mode: str) -> str:
    """ "token" or "sequence" for a mode name; KeyError naming the config key for an unknown one."""
    try:
        return CORRECTION_MODES[mode].level
    except KeyError:
        raise KeyError(
            f"unknown rollout correction '{mode}' (config key algorithm.rollout_correction.mode); "
            f"choose one of {sorted(CORRECTION_MODES)}"
        ) from None


@dataclass
class RolloutCorrectionConfig:
    """`algorithm.rollout_correction`: which weights (see the module docstring) and their bounds [low, high]."""

    mode: str = "none"
    low: float = 0.5  # MIS / RS lower bound (unused by TIS)
    high: float = 2.0  # TIS cap, MIS / RS upper bound

    def __post_init__(self) -> None:
        correction_level(self.mode)
        low, high = float(self.low), float(self.high)
        if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= 1.0 <= high):
            raise ValueError(
                "algorithm.rollout_correction.low/high: need 0 <= low <= 1 <= high (finite) so that on-policy "
                f"tokens (ratio 1) keep weight 1, got low={self.low}, high={self.high}"
            )
        self.low, self.high = low, high


@torch.no_grad()
def correction_weights(
    old_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    low: float = 0.5,
    high: float = 2.0,
    episodes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Importance weights correcting for sampling from π_engine instead of π_old, and mismatch statistics.

    Args:
        old_logprobs: [N, L] logπ_old as the objective uses it (the detached current logπ when M = 1, the
            round-start logπ when M > 1).
        engine_logprobs: [N, L] the engine's logprob of each sampled token (0 off the mask).
        mask: [N, L] 1 on trained (model-generated) tokens.
        mode: a key of CORRECTION_MODES; low, high: the bounds of `RolloutCorrectionConfig`.
        episodes: [N] long, the episode of each row (None: one each), an episode's rows consecutive. The rows of one
            episode (its samples: a compacted context, an endpoint's prefix break) share one sequence-level weight,
            computed over all their mask-1 tokens: S_i and |y_i| above are the episode's, whose advantage every
            sample carries.

    Returns:
        weights [N, L] (no gradient, 0 off the mask and on sequences without a mask-1 token) and detached scalars
        over mask-1 tokens: logprob_diff_abs_mean (mean |old − engine|), kl_k3 (mean k3 estimate of
        KL(π_engine‖π_old): r − log r − 1 with r = π_old/π_engine, the samples being the engine's), weight_mean,
        masked_share (share of mask-1 tokens whose weight is 0), weight_min (the smallest weight on a mask-1 token:
        over sequences for sequence modes) and ess (`effective_sample_size` of the per-sequence weights). With no
        mask-1 token: 0, 0, 1, 0, 1, 1.
    """
    if old_logprobs.shape != engine_logprobs.shape or old_logprobs.shape != mask.shape or mask.dim() != 2:
        raise ValueError(
            f"correction_weights: old_logprobs {tuple(old_logprobs.shape)}, engine_logprobs "
            f"{tuple(engine_logprobs.shape)} and mask {tuple(mask.shape)} must share one [N, L] shape"
        )
    correction_level(mode)  # unknown mode: the error names the config key
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    keep = mask.bool()
    # selected, not multiplied: off-mask positions may hold -inf or NaN (0 * -inf = NaN)
    delta = torch.where(keep, old_logprobs.detach().to(dtype) - engine_logprobs.to(dtype), 0.0)  # [N, L]
    mask_f = keep.to(dtype)
    correction = CORRECTION_MODES[mode]
    if correction.level == "sequence" and episodes is not None and _has_split_episode(episodes):
        # the weigh functions reduce over dim 1: an [N, 1] column of the episode's log-ratio sum over its length
        # (a count, not a 0/1 mask) gives the episode's S_i and ρ_i on each of its rows
        episode_delta, episode_length = _per_episode(delta.sum(dim=1), mask_f.sum(dim=1), episodes)
        per_row = correction.weigh(episode_delta[:, None], episode_length[:, None], low, high)  # [N, 1]
        weights = torch.where(keep, per_row.expand_as(delta), 0.0)
    else:
        weights = torch.where(keep, correction.weigh(delta, mask_f, low, high), 0.0)  # [N, L]
    count = mask_f.sum()
    if count == 0:
        zero = torch.zeros((), dtype=dtype, device=delta.device)
        return weights, {
            "logprob_diff_abs_mean": zero,
            "kl_k3": zero.clone(),
            "weight_mean": torch.ones_like(zero),
            "masked_share": zero.clone(),
            "weight_min": torch.ones_like(zero),
            "ess": torch.ones_like(zero),
        }
    # k3 ≈ d²/2 cancels in float32 when |d| ~ 1e-7 (fp32 runs on CPU): measured negative there, so float64 + expm1
    wide = delta.double()
    k3 = torch.where(keep, torch.expm1(wide) - wide, 0.0)
    return weights, {
        "logprob_diff_abs_mean": delta.abs().sum() / count,
        "kl_k3": (k3.sum() / count).to(dtype),
        "weight_mean": weights.sum() / count,
        "masked_share": ((weights == 0) & keep).to(dtype).sum() / count,
        "weight_min": torch.where(keep, weights, math.inf).min(),
        "ess": effective_sample_size(sequence_mean_weights(weights, mask_f, episodes)),
    }


def _first_rows(episodes: torch.Tensor) -> torch.Tensor:
    """[N] bool: the first row of each episode (its rows are consecutive, as `collate_trajectories` puts them)."""
    first = torch.ones_like(episodes, dtype=torch.bool)
    first[1:] = episodes[1:] != episodes[:-1]
    return first


def _has_split_episode(episodes: torch.Tensor) -> bool:
    return not bool(_first_rows(episodes).all())


def _per_episode(
    row_sums: torch.Tensor, row_lengths: torch.Tensor, episodes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's episode totals [N], [N]: the sums of `row_sums` and `row_lengths` over the rows of its episode."""
    inverse = _first_rows(episodes).cumsum(0) - 1  # the episode's position among the batch's episodes
    count = int(inverse[-1]) + 1
    sums = torch.zeros(count, dtype=row_sums.dtype, device=row_sums.device).index_add_(0, inverse, row_sums)
    lengths = torch.zeros(count, dtype=row_lengths.dtype, device=row_lengths.device).index_add_(0, inverse, row_lengths)
    return sums[inverse], lengths[inverse]


def sequence_mean_weights(
    weights: torch.Tensor, mask: torch.Tensor, episodes: torch.Tensor | None = None
) -> torch.Tensor:
    """w_i = Σ_t m_it w_it / Σ_t m_it for the sequences with at least one mask-1 token [N'] (a sequence mode's own
    weight; a token mode's mean weight over the sequence). With `episodes` ([N], as `correction_weights` takes it), one
    value per episode over all its rows' tokens: an episode split into samples is one sample of the estimate."""
    mask = mask.to(weights.dtype)
    totals, count = (weights * mask).sum(dim=1), mask.sum(dim=1)
    if episodes is not None and _has_split_episode(episodes):
        first = _first_rows(episodes)
        totals, count = _per_episode(totals, count, episodes)
        totals, count = totals[first], count[first]
    return (totals / count.clamp(min=1.0))[count > 0]


def effective_sample_size(seq_weights: torch.Tensor) -> torch.Tensor:
    """Normalized effective sample size ESS = (Σ_i w_i)² / (N · Σ_i w_i²) of N sequence weights, in [0, 1]: 1 when all
    weights are equal (or N = 0), 1/N when one sequence holds all the weight, 0 when every weight is 0."""
    if seq_weights.numel() == 0:
        return torch.ones((), dtype=seq_weights.dtype, device=seq_weights.device)
    # scale-free: divided by the largest weight in float64 (product weights e^-60 would square to 0 in float32)
    wide = seq_weights.double()
    largest = wide.max()
    if largest <= 0:
        return torch.zeros((), dtype=seq_weights.dtype, device=seq_weights.device)
    scaled = wide / largest
    return (scaled.sum().square() / (scaled.numel() * scaled.square().sum())).to(seq_weights.dtype)


def staleness_notice(mode: str, max_staleness: int) -> tuple[int, str] | None:
    """What to tell a user whose correction `mode` does not (fully) correct rounds sampled by weights up to
    `max_staleness` rounds old: (logging level, message), or None (k = 0, or a mode that corrects). Checked when the
    run is built (`RolloutCallback`), where both keys are known."""
    if max_staleness < 1:
        return None
    staleness = CORRECTION_MODES[mode].staleness if mode in CORRECTION_MODES else "corrects"
    keys = f"algorithm.rollout_correction.mode={mode} with rollout.max_staleness={max_staleness}"
    if staleness == "ignores":
        return logging.WARNING, (
            f"{keys}: the mode does not reweight, so rounds sampled by weights up to {max_staleness} round(s) old "
            "train uncorrected (the gradient is not an estimate under the round-start policy π_old). Use "
            "algorithm.rollout_correction.mode=seq_prod_tis (the truncated sequence importance weight; token_tis "
            "for a token-level objective), or rollout.max_staleness=0 (docs/async.md)"
        )
    if staleness == "numerics":
        return logging.INFO, (
            f"note: {keys}: the mode weighs a sequence by the geometric mean of its token ratios π_old/μ, which "
            "corrects the engine/trainer numerics but barely the staleness (the importance weight is their product: "
            "algorithm.rollout_correction.mode=seq_prod_tis; bench/correction.py compares them, docs/async.md)"
        )
    return None
