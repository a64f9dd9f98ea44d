"""Rollout-training mismatch correction: importance weights π_old / π_engine, truncated (TIS) or masked (MIS), and
rejection of outliers (RS).

The rollout engine samples with its own kernels (vLLM, bf16, batch-dependent reductions), the trainer recomputes
logprobs with another (FSDP, HF): the data is never exactly on-policy. With r_it = π_old(y_it) / π_engine(y_it) on
mask-1 tokens, the weights below multiply each objective's surrogate term (detached, normalizers unchanged).

    token_tis  w_it = min(r_it, high)                          (truncated IS, per token)
    token_mis  w_it = r_it · 1[low <= r_it <= high]             (masked IS, per token)
    token_rs   w_it = 1[low <= r_it <= high]                    (rejection of outlier tokens, no reweighting)
    seq_tis    w_it = min(ρ_i, high)  on every mask-1 token of sequence i
    seq_mis    w_it = ρ_i · 1[low <= ρ_i <= high]
    seq_rs     w_it = 1[low <= ρ_i <= high]
    none       w_it = 1

What each estimates. The IS modes (tis, mis) reweight samples drawn from π_engine by π_old/π_engine, so the gradient
estimates the gradient under π_old, with the bias of the truncation (tis: ratios above `high` count as `high`) or of
the mask (mis: samples outside [low, high] are dropped, the others keep their ratio, as verl's masked IS). The RS modes
only drop the samples whose ratio is out of bounds and weigh the rest 1: the gradient is the uncorrected one over the
samples the two policies roughly agree on, not an estimate under π_old. (Before issue 29 the `*_mis` names meant RS.)

ρ_i = exp( Σ_t m_it (logπ_old − logπ_engine) / Σ_t m_it ) is the length-normalized (geometric-mean) ratio, the same
normalization as s_i in DSPO Eq. 6, so a sequence-level correction weighs exactly the unit that Eq. 11 clips.
Shapes as in `dspo.algorithms.losses`: [N, L] inputs, weights [N, L], 0 off the mask and on empty sequences.
"""

from __future__ import annotations

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


CORRECTION_MODES: dict[str, CorrectionMode] = {
    "none": CorrectionMode("sequence", _none),  # constant within a sequence, so valid for every objective
    "token_tis": CorrectionMode("token", _token_tis),
    "token_mis": CorrectionMode("token", _token_mis),
    "token_rs": CorrectionMode("token", _token_rs),
    "seq_tis": CorrectionMode("sequence", _seq_tis),
    "seq_mis": CorrectionMode("sequence", _seq_mis),
    "seq_rs": CorrectionMode("sequence", _seq_rs),
}


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
) -> tuple[torch.Tensor, Stats]:
    """Importance weights correcting for sampling from π_engine instead of π_old, and mismatch statistics.

    Args:
        old_logprobs: [N, L] logπ_old as the objective uses it (the detached current logπ when M = 1, the
            round-start logπ when M > 1).
        engine_logprobs: [N, L] the engine's logprob of each sampled token (0 off the mask).
        mask: [N, L] 1 on trained (model-generated) tokens.
        mode: a key of CORRECTION_MODES; low, high: the bounds of `RolloutCorrectionConfig`.

    Returns:
        weights [N, L] (no gradient, 0 off the mask and on sequences without a mask-1 token) and detached scalars
        over mask-1 tokens: logprob_diff_abs_mean (mean |old − engine|), kl_k3 (mean k3 estimate of
        KL(π_engine‖π_old): r − log r − 1 with r = π_old/π_engine, the samples being the engine's), weight_mean, and
        masked_share (share of mask-1 tokens whose weight is 0). With no mask-1 token: 0, 0, 1, 0.
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
    weights = torch.where(keep, CORRECTION_MODES[mode].weigh(delta, mask_f, low, high), 0.0)  # [N, L]
    count = mask_f.sum()
    if count == 0:
        zero = torch.zeros((), dtype=dtype, device=delta.device)
        return weights, {
            "logprob_diff_abs_mean": zero,
            "kl_k3": zero.clone(),
            "weight_mean": torch.ones_like(zero),
            "masked_share": zero.clone(),
        }
    # k3 ≈ d²/2 cancels in float32 when |d| ~ 1e-7 (fp32 runs on CPU): measured negative there, so float64 + expm1
    wide = delta.double()
    k3 = torch.where(keep, torch.expm1(wide) - wide, 0.0)
    return weights, {
        "logprob_diff_abs_mean": delta.abs().sum() / count,
        "kl_k3": (k3.sum() / count).to(dtype),
        "weight_mean": weights.sum() / count,
        "masked_share": ((weights == 0) & keep).to(dtype).sum() / count,
    }
