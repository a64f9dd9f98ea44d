"""Policy objectives (one pure function each, selected by name) and KL estimators.

Conventions shared by every objective:
    logprobs, old_logprobs, mask: [N, L]; mask is 1 on model-generated tokens only (retrieved text is never trained).
    advantages: [N], one per sequence (Eq. 10).
    weights: optional [N, L] rollout-correction weights (`dspo.algorithms.rollout_correction`), detached; they multiply
        the surrogate term, normalizers unchanged. Token-level objectives weigh each token; sequence-level ones take the
        sequence's value on its mask-1 tokens, which must be one value per sequence. None = no correction.
    Each objective returns the *loss* (negated objective) and a dict of detached statistics.

Departure from a single-batch formula, on purpose: every objective accepts `normalizer`, the number of units (sequences
or tokens) in the whole *mini-batch*. With micro-batches and gradient accumulation, summing the micro-batch losses then
gives exactly the mini-batch loss; without it (None) the micro-batch's own count is used. It is a count: values below 1
are treated as 1 (an all-empty mini-batch then gives loss 0, not 0/0), negative or non-finite values are an error.

Empty masks: a sequence with no trained token has log-ratio 0 (s_i = 1) and contributes 0 to the loss and its gradient;
no NaN anywhere. Off-mask positions are *selected away* (torch.where), not multiplied by 0, so padding that holds -inf
or NaN logprobs cannot leak into the loss (0 * -inf = NaN).

Precision: ratios and sums are computed in at least float32 (bf16 logprobs are upcast; float64 stays float64), because a
bf16 sum of hundreds of log-ratios loses the small differences that the clip acts on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

Stats = dict[str, torch.Tensor]


class PolicyObjective(Protocol):
    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip_low: float,
        clip_high: float,
        normalizer: float | None = None,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Stats]: ...


POLICY_LOSSES: dict[str, PolicyObjective] = {}
# Unit over which each objective averages: the `normalizer` of a mini-batch counts these.
NORMALIZER_UNITS: dict[str, str] = {}
# Level of each objective's importance ratio: a sequence-level one accepts only sequence-level correction weights.
RATIO_LEVELS: dict[str, str] = {}
LEVELS = ("sequence", "token")


def register_loss(
    *names: str, normalizer_unit: str = "sequence", ratio_level: str = "sequence"
) -> Callable[[PolicyObjective], PolicyObjective]:
    """Register an objective under `names` (values of algorithm.loss) and fill the tables the trainer reads.

    normalizer_unit: what the mini-batch `normalizer` counts, "sequence" (mean over sequences) or "token" (mean over
        all trained tokens); the trainer computes it with `loss_normalizer`.
    ratio_level: "sequence" or "token", the rollout-correction modes the objective accepts (`AlgorithmConfig`).
        The default "sequence" admits only none/seq_tis/seq_mis/seq_rs, whose weights are valid for every objective;
        declare "token" when the objective weighs tokens one by one and can take token_tis/token_mis/token_rs.
    """
    for key, value in (("normalizer_unit", normalizer_unit), ("ratio_level", ratio_level)):
        if value not in LEVELS:
            raise ValueError(f"register_loss{names}: {key} must be one of {LEVELS}, got {value!r}")

    def wrap(fn: PolicyObjective) -> PolicyObjective:
        for name in names:
            POLICY_LOSSES[name] = fn
            NORMALIZER_UNITS[name] = normalizer_unit
            RATIO_LEVELS[name] = ratio_level
        return fn

    return wrap


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """min(ratio·A, clip(ratio, 1−ε_low, 1+ε_high)·A) and a bool tensor: where the clipped branch is active."""
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    is_clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
    return surrogate, is_clipped


def _ratio_stats(ratio: torch.Tensor, valid: torch.Tensor, is_clipped: torch.Tensor) -> Stats:
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


def _check_shapes(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor):
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must share one [N, L] shape"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [N]={logprobs.shape[0]}, got {tuple(advantages.shape)}")


def _masked_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logπθ − logπold) on mask-1 tokens and exactly 0 elsewhere, in >= float32; plus the float mask. [N, L] each."""
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    keep = mask.bool()
    delta = torch.where(keep, logprobs.to(dtype) - old_logprobs.to(dtype), 0.0)
    return delta, keep.to(dtype)


def _token_weights(weights: torch.Tensor | None, mask: torch.Tensor, where: str) -> torch.Tensor | None:
    """Detached correction weights on mask-1 tokens, exactly 0 elsewhere, in the mask's dtype. [N, L] or None."""
    if weights is None:
        return None
    if weights.shape != mask.shape:
        raise ValueError(f"{where}: weights {tuple(weights.shape)} must have the mask's shape {tuple(mask.shape)}")
    return torch.where(mask.bool(), weights.detach().to(mask.dtype), 0.0)


def _sequence_weights(weights: torch.Tensor | None, mask: torch.Tensor, where: str) -> torch.Tensor | None:
    """One weight per sequence [N]: the value on its mask-1 tokens (0 for an empty sequence)."""
    token = _token_weights(weights, mask, where)
    if token is None:
        return None
    keep = mask.bool()
    high = torch.where(keep, token, -math.inf).amax(dim=1)
    low = torch.where(keep, token, math.inf).amin(dim=1)
    if bool(((high != low) & keep.any(dim=1)).any()):
        raise ValueError(
            f"{where} is sequence-level: its weights must be constant over each sequence's trained tokens "
            "(use a sequence-level algorithm.rollout_correction.mode: none, seq_tis, seq_mis or seq_rs)"
        )
    return torch.where(keep.any(dim=1), high, 0.0)


def _denominator(normalizer: float | None, own_count: float, where: str) -> float:
    """The loss divisor: `normalizer` (mini-batch count) if given, else this micro-batch's count; at least 1."""
    if normalizer is None:
        return max(float(own_count), 1.0)
    value = float(normalizer)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: normalizer must be a finite count >= 0 (units in the mini-batch), got {normalizer}")
    return max(value, 1.0)


@register_loss("dspo", "gspo", normalizer_unit="sequence", ratio_level="sequence")
def sequence_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Sequence-level clipped objective (DSPO Eq. 6 + Eq. 11; GSPO).

    s_i = exp( Σ_t m_it (logπθ − logπold) / Σ_t m_it )                         (Eq. 6)
    J   = (1/N) Σ_i min( s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i )           (Eq. 11)

    With groups of equal size G, the mean over all N = B·G sequences equals the mean over groups of the 1/G sum.
    Unclipped gradient (Eq. 8): ∇J = (1/N) Σ_i s_i Â_i · (1/|y_i|) Σ_t ∇logπθ(y_it).
    With rollout-correction weights, the term of sequence i is multiplied by its weight w_i.
    """
    _check_shapes(logprobs, old_logprobs, advantages, mask)
    delta, mask_f = _masked_log_ratio(logprobs, old_logprobs, mask)  # [N, L]
    lengths = mask_f.sum(dim=1)  # [N]
    seq_ratio = torch.exp(delta.sum(dim=1) / lengths.clamp(min=1.0))  # [N]
    surrogate, is_clipped = _clipped_surrogate(seq_ratio, advantages, clip_low, clip_high)  # [N]
    surrogate = surrogate * (lengths > 0)  # an empty sequence would otherwise add the constant Â_i to the loss
    seq_weights = _sequence_weights(weights, mask_f, "sequence_clip_loss")  # [N] or None
    if seq_weights is not None:
        surrogate = surrogate * seq_weights
    loss = -surrogate.sum() / _denominator(normalizer, surrogate.shape[0], "sequence_clip_loss")
    return loss, _ratio_stats(seq_ratio, lengths > 0, is_clipped)


@register_loss("grpo", normalizer_unit="sequence", ratio_level="token")
def token_clip_sequence_mean_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """GRPO (DSPO Eq. 2 without the KL term): per-token ratio r_it = πθ/πold, clipped per token,
    averaged over each sequence's masked tokens, then over sequences.
    """
    _check_shapes(logprobs, old_logprobs, advantages, mask)
    delta, mask_f = _masked_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(delta)  # [N, L]; exactly 1 off-mask, then weighted 0 below
    surrogate, is_clipped = _clipped_surrogate(ratio, advantages[:, None], clip_low, clip_high)
    token_weights = _token_weights(weights, mask_f, "token_clip_sequence_mean_loss")
    if token_weights is not None:
        surrogate = surrogate * token_weights
    per_sequence = (surrogate * mask_f).sum(dim=1) / mask_f.sum(dim=1).clamp(min=1.0)  # [N]
    loss = -per_sequence.sum() / _denominator(normalizer, per_sequence.shape[0], "token_clip_sequence_mean_loss")
    return loss, _ratio_stats(ratio, mask_f > 0, is_clipped)


@register_loss("dapo", normalizer_unit="token", ratio_level="token")
def token_clip_token_mean_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """DAPO: per-token ratio with clip-higher (ε_high > ε_low), token-mean over all masked tokens of the batch
    (DAPO's token-level policy-gradient loss), so long responses weigh by their length.
    """
    _check_shapes(logprobs, old_logprobs, advantages, mask)
    delta, mask_f = _masked_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(delta)  # [N, L]
    surrogate, is_clipped = _clipped_surrogate(ratio, advantages[:, None], clip_low, clip_high)
    token_weights = _token_weights(weights, mask_f, "token_clip_token_mean_loss")
    if token_weights is not None:
        surrogate = surrogate * token_weights
    loss = -(surrogate * mask_f).sum() / _denominator(normalizer, mask_f.sum(), "token_clip_token_mean_loss")
    return loss, _ratio_stats(ratio, mask_f > 0, is_clipped)


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Dispatch to the objective registered under `name` (dspo, gspo, grpo, dapo)."""
    try:
        objective = POLICY_LOSSES[name]
    except KeyError:
        raise KeyError(
            f"unknown policy loss '{name}' (config key algorithm.loss); choose one of {sorted(POLICY_LOSSES)}"
        ) from None
    return objective(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, normalizer, weights=weights)


def _k1(delta: torch.Tensor) -> torch.Tensor:
    return -delta


def _k2(delta: torch.Tensor) -> torch.Tensor:
    return 0.5 * delta.square()


def _k3(delta: torch.Tensor) -> torch.Tensor:
    return torch.exp(delta) - delta - 1.0


# Per-token estimators of KL(πθ‖πref) as functions of delta = logπref − logπθ (Schulman, "Approximating KL divergence").
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k3",
    normalizer: float | None = None,
) -> torch.Tensor:
    """Per-token KL(πθ‖πref) estimator, masked token-mean (Schulman's k1 / k2 / k3; GRPO uses k3).

    k1 = logπθ − logπref                             (unbiased, can be negative)
    k2 = ½ (logπθ − logπref)²                        (biased, low variance, ≥ 0)
    k3 = exp(logπref − logπθ) − (logπref − logπθ) − 1 (unbiased, always ≥ 0)

    `normalizer` is the mini-batch's masked-token count (see the module docstring).
    """
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"kl_penalty: logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must share one shape"
        )
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise KeyError(
            f"unknown KL estimator '{kind}' (config key algorithm.kl_estimator); choose one of {sorted(KL_ESTIMATORS)}"
        ) from None
    delta, mask_f = _masked_log_ratio(ref_logprobs, logprobs, mask)  # logπref − logπθ, 0 off-mask
    per_token = estimator(delta) * mask_f
    return per_token.sum() / _denominator(normalizer, mask_f.sum(), "kl_penalty")


def token_normalizer(num_tokens: float, world_size: int = 1) -> float:
    """Token-mean normalizer of one process's loss under data parallelism (DDP/FSDP average gradients over W ranks).

    `num_tokens` is the masked-token count T of the whole mini-batch over all W ranks (all-reduced). Rank r's loss
    −Σ_r/(T/W), averaged over ranks by DDP, gives −Σ_r Σ_r/T: the global token mean, not a mean of per-rank means.
    """
    if world_size < 1:
        raise ValueError(f"token_normalizer: world_size must be >= 1, got {world_size}")
    return float(max(num_tokens, 1)) / world_size


def loss_normalizer(name: str, num_sequences: int, num_tokens: float, world_size: int = 1) -> float:
    """The `normalizer` argument for objective `name` over a mini-batch with these counts (at least 1).

    `num_sequences` is this process's count (equal on every rank, so DDP's average is already the global mean);
    `num_tokens` is the count over all `world_size` processes (see `token_normalizer`).
    """
    unit = NORMALIZER_UNITS.get(name)
    if unit is None:
        raise KeyError(
            f"objective {name!r} has no normalizer unit; register it with register_loss(..., normalizer_unit=...)"
        )
    return float(max(num_sequences, 1)) if unit == "sequence" else token_normalizer(num_tokens, world_size)
