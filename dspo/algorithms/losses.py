"""Policy objectives, one record each in one registry (`OBJECTIVES`, selected by `algorithm.loss`), and KL estimators.

An objective is a pure function with its record (`Objective`): what the trainer's `normalizer` counts for it
(sequences or tokens), the level of its importance ratio (which rollout-correction modes it takes), and its own
settings, a dataclass whose defaults are the objective's (`algorithm.loss_kwargs` overrides them; an unknown key is
refused naming it). The four built-ins declare their clip ranges there: dspo and gspo 3e-4 / 4e-4 (GSPO's recipe:
sequence ratios live near 1), dapo 0.2 / 0.28 (clip-higher), grpo 0.2 / 0.2. Their bodies are built from the public
blocks of `dspo.algorithms.blocks`; grpo and dapo share one token-level body and differ only in the mean they take.

Conventions shared by every objective `fn(logprobs, old_logprobs, advantages, mask, settings, normalizer, weights)`:
    logprobs, old_logprobs, mask: [N, L]; mask is 1 on model-generated tokens only (retrieved text is never trained).
    advantages: [N], one per sequence (Eq. 10).
    settings: the objective's settings dataclass (e.g. `ClipRange`).
    normalizer: the number of units (sequences or tokens) in the whole *mini-batch*: summing the micro-batch losses of
        a gradient-accumulation step then gives exactly the mini-batch loss (None: the micro-batch's own count). Values
        below 1 count as 1 (an all-empty mini-batch gives loss 0, not 0/0); negative or non-finite ones are an error.
    weights: optional [N, L] rollout-correction weights (`dspo.algorithms.rollout_correction`), detached; they multiply
        the surrogate term, normalizers unchanged. Token-level objectives weigh each token; sequence-level ones take the
        sequence's value on its mask-1 tokens, which must be one value per sequence. None = no correction.
    Each returns the *loss* (negated objective) and a dict of detached statistics (`blocks.ratio_stats`).

Empty masks: a sequence with no trained token has log-ratio 0 (s_i = 1) and contributes 0 to the loss and its gradient;
no NaN anywhere.

Episodes, not rows (why dspo and gspo depart from a per-row implementation). A row of the batch is a *sample*, and an
episode may be trained as several of them (`Trajectory.segments`: a compacted context, an agent that rewrote its
history behind the endpoint, a partial rollout). Eq. 6 defines s_i over a whole response: a per-row ratio would give
each sample its own geometric mean and its own clip decision, so off-policy (every mini-batch after a round's first)
a split episode trains differently from the same tokens unsplit. Log-ratio deltas [+1e-3, +1e-3, -1e-3, -1e-3],
Â = 1, clip 3e-4 / 4e-4: unsplit, s = 1 and the gradient is -0.25 on each token; split 2 + 2, the first sample's
s = e^0.001 is clipped and the gradient is [0, 0, -0.2498, -0.2498]. So an objective declaring `takes_episodes`
receives `episodes` ([N] ids; rows that share one are one episode; None: each row its own) and pools its ratio over
the episode's rows (`blocks.episode_ratio`): one ratio, one clip decision and one statistic per episode. Its rows'
weights carry each sample's share |y_sample| / |y_episode| (`PolicyBatch.sample_scale`, applied by the trainer), which
add to 1, so the episode's surrogate counts once. Token-level objectives (grpo, dapo) need no ids: a token's ratio is
the same in any sample, and grpo's per-row mean scaled by the sample's share is the episode's token mean exactly.
Objectives that do not declare `takes_episodes` (user ones written before it) are called as before, without the ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dspo.algorithms.blocks import (
    LEVELS,
    Stats,
    check_shapes,
    clipped_surrogate,
    denominator,
    episode_ratio,
    loss_normalizer,
    masked_log_ratio,
    ratio_stats,
    sequence_weights,
    token_normalizer,
    token_weights,
)
from dspo.algorithms.registry import Registry, make_settings

__all__ = ["OBJECTIVES", "ClipRange", "Objective", "kl_penalty", "loss_normalizer", "policy_loss", "token_normalizer"]


class ObjectiveFn(Protocol):
    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        settings: Any,
        normalizer: float | None = None,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Stats]: ...


@dataclass(frozen=True)
class ClipRange:
    """ε_low / ε_high of a clipped ratio: the trust region is [1 − clip_low, 1 + clip_high] (Eq. 11)."""

    clip_low: float
    clip_high: float

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(
                "algorithm.loss_kwargs.clip_low/clip_high: need 0 <= clip_low < 1 and clip_high >= 0, got "
                f"{self.clip_low}/{self.clip_high}"
            )


@dataclass(frozen=True)
class Objective:
    """An objective and what the trainer needs to know about it (see the module docstring)."""

    name: str
    loss: ObjectiveFn
    normalizer_unit: str = "sequence"  # what the mini-batch `normalizer` counts: "sequence" or "token"
    ratio_level: str = "sequence"  # "sequence": one ratio per sequence, only sequence-level correction weights
    settings: Any = None  # the default settings (a dataclass instance), None for an objective without settings
    token_advantages: bool = False  # takes advantages [N, L] (per-turn credit, env.reward.credit=turn) as well as [N]
    takes_episodes: bool = False  # takes episodes=[N] ids: one ratio per episode however many rows it became

    def __post_init__(self) -> None:
        for key in ("normalizer_unit", "ratio_level"):
            if getattr(self, key) not in LEVELS:
                raise ValueError(f"objective '{self.name}': {key} must be one of {LEVELS}, got {getattr(self, key)!r}")

    def make_settings(self, kwargs: Mapping[str, Any] | None = None) -> Any:
        """The defaults with `algorithm.loss_kwargs` applied (validated)."""
        return make_settings(self.settings, kwargs, "algorithm.loss_kwargs", f"objective '{self.name}'")

    def compute(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        settings: Any,
        normalizer: float | None = None,
        weights: torch.Tensor | None = None,
        episodes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Stats]:
        """The objective's loss and statistics. `episodes` ([N] ids) reaches only an objective that declares
        `takes_episodes`, so one written with the signature without it keeps working (it ignores splits)."""
        extra = {"episodes": episodes} if self.takes_episodes else {}
        return self.loss(logprobs, old_logprobs, advantages, mask, settings, normalizer, weights=weights, **extra)


OBJECTIVES: Registry[Objective] = Registry("objective", "algorithm.loss")


def register_objective(
    *names: str,
    normalizer_unit: str = "sequence",
    ratio_level: str = "sequence",
    settings: Any = None,
    token_advantages: bool = False,
    takes_episodes: bool = False,
) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Register `fn` under `names` (values of algorithm.loss), with its record's facts and default `settings`.

    normalizer_unit: "sequence" (the loss is a mean over sequences) or "token" (a mean over all trained tokens).
    ratio_level: "sequence" (default) admits only none/seq_tis/seq_mis/seq_rs, whose weights are valid for every
        objective; declare "token" when the objective weighs tokens one by one and can take token_* modes too.
    settings: a dataclass instance holding the objective's own settings with their defaults (None: no settings).
    token_advantages: the objective weighs each token by its own advantage when given advantages [N, L] (per-turn
        credit); sequence-level objectives leave it False and get one advantage per sequence.
    takes_episodes: the objective takes a keyword `episodes` ([N] ids, None = each row its own episode) and computes
        one ratio per episode (`blocks.episode_ratio`), so that a split episode trains as it would unsplit.
    """

    for key, value in (("normalizer_unit", normalizer_unit), ("ratio_level", ratio_level)):
        if value not in LEVELS:  # refused where the decorator is written, before any function is registered
            raise ValueError(f"register_objective{names}: {key} must be one of {LEVELS}, got {value!r}")

    def wrap(fn: ObjectiveFn) -> ObjectiveFn:
        for name in names:
            record = Objective(name, fn, normalizer_unit, ratio_level, settings, token_advantages, takes_episodes)
            OBJECTIVES.add(name, record)
        return fn

    return wrap


def sequence_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: ClipRange,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Sequence-level clipped objective (DSPO Eq. 6 + Eq. 11; GSPO), one ratio and one clip decision per episode.

    s_e = exp( Σ_{i∈e} Σ_t m_it (logπθ − logπold) / Σ_{i∈e} Σ_t m_it )         (Eq. 6, over episode e's rows)
    J   = (1/N) Σ_i w_i min( s_e(i) Â_i, clip(s_e(i), 1−ε_low, 1+ε_high) Â_i )  (Eq. 11)

    Unsplit (`episodes` None, or each row its own id) row i is episode i: s_i over its tokens, w_i = 1 without
    correction. With groups of equal size G, the mean over all N = B·G sequences equals the mean over groups of the 1/G
    sum. Unclipped gradient (Eq. 8): ∇J = (1/N) Σ_i s_i Â_i · (1/|y_i|) Σ_t ∇logπθ(y_it).
    Split, N counts episodes and the weights w_i of an episode's rows add to its correction weight (each row's is
    scaled by its share |y_i| / |y_e|, `PolicyBatch.sample_scale`): the episode's clipped term counts once, and its
    gradient is the unsplit one, (1/N) w_e s_e Â_e · (1/|y_e|) Σ_{t∈e} ∇logπθ where not clipped.
    A row without trained tokens contributes 0; every row of an episode carries the episode's advantage.
    """
    check_shapes(logprobs, old_logprobs, advantages, mask)
    delta, mask_f = masked_log_ratio(logprobs, old_logprobs, mask)  # [N, L]
    seq_ratio, lengths, first = episode_ratio(delta, mask_f, episodes)  # [N] each: s_e, |y_e|, one row per episode
    surrogate, is_clipped = clipped_surrogate(seq_ratio, advantages, settings.clip_low, settings.clip_high)  # [N]
    surrogate = surrogate * (mask_f.sum(dim=1) > 0)  # an empty row would otherwise add the constant Â_i to the loss
    seq_weights = sequence_weights(weights, mask_f, "sequence_clip_loss")  # [N] or None
    if seq_weights is not None:
        surrogate = surrogate * seq_weights
    loss = -surrogate.sum() / denominator(normalizer, surrogate.shape[0], "sequence_clip_loss")
    return loss, ratio_stats(seq_ratio[first], (lengths > 0)[first], is_clipped[first])  # statistics of episodes


register_objective("dspo", "gspo", settings=ClipRange(clip_low=3e-4, clip_high=4e-4), takes_episodes=True)(
    sequence_clip_loss
)


def _token_clip_surrogate(
    logprobs, old_logprobs, advantages, mask, settings: ClipRange, weights, where: str
) -> tuple[torch.Tensor, torch.Tensor, Stats]:
    """The token-level body shared by grpo and dapo: per-token ratio r_it = πθ/πold, clipped per token, times the
    token's correction weight. Returns the surrogate [N, L], the float mask [N, L] and the ratio statistics."""
    check_shapes(logprobs, old_logprobs, advantages, mask, token_advantages=True)
    delta, mask_f = masked_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(delta)  # [N, L]; exactly 1 off-mask, then weighted 0 by the mask
    per_token = advantages if advantages.dim() == 2 else advantages[:, None]  # [N, L] (per-turn credit) or [N, 1]
    surrogate, is_clipped = clipped_surrogate(ratio, per_token, settings.clip_low, settings.clip_high)
    weights = token_weights(weights, mask_f, where)
    if weights is not None:
        surrogate = surrogate * weights
    return surrogate, mask_f, ratio_stats(ratio, mask_f > 0, is_clipped)


def token_clip_sequence_mean_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: ClipRange,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """GRPO (DSPO Eq. 2 without the KL term): the token-level clipped surrogate averaged over each sequence's masked
    tokens, then over sequences."""
    where = "token_clip_sequence_mean_loss"
    surrogate, mask_f, stats = _token_clip_surrogate(logprobs, old_logprobs, advantages, mask, settings, weights, where)
    per_sequence = (surrogate * mask_f).sum(dim=1) / mask_f.sum(dim=1).clamp(min=1.0)  # [N]
    return -per_sequence.sum() / denominator(normalizer, per_sequence.shape[0], where), stats


def token_clip_token_mean_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: ClipRange,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """DAPO: the token-level clipped surrogate (clip-higher: ε_high > ε_low), token-mean over all masked tokens of the
    batch (DAPO's token-level policy-gradient loss), so long responses weigh by their length."""
    where = "token_clip_token_mean_loss"
    surrogate, mask_f, stats = _token_clip_surrogate(logprobs, old_logprobs, advantages, mask, settings, weights, where)
    return -(surrogate * mask_f).sum() / denominator(normalizer, mask_f.sum(), where), stats


register_objective("grpo", ratio_level="token", settings=ClipRange(clip_low=0.2, clip_high=0.2), token_advantages=True)(
    token_clip_sequence_mean_loss
)
register_objective(
    "dapo",
    normalizer_unit="token",
    ratio_level="token",
    settings=ClipRange(clip_low=0.2, clip_high=0.28),
    token_advantages=True,
)(token_clip_token_mean_loss)


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: Any = None,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
    episodes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """The objective registered under `name`; `settings` is its settings object, a mapping of overrides of its
    defaults (as `algorithm.loss_kwargs`), or None for the defaults. `episodes`: [N] ids of the rows' episodes, for
    an objective that `takes_episodes` (see the module docstring); ignored by the others."""
    objective = OBJECTIVES[name]
    if settings is None or isinstance(settings, Mapping):
        settings = objective.make_settings(settings)
    return objective.compute(
        logprobs, old_logprobs, advantages, mask, settings, normalizer, weights=weights, episodes=episodes
    )


def _k1(delta: torch.Tensor) -> torch.Tensor:
    return -delta


def _k2(delta: torch.Tensor) -> torch.Tensor:
    return 0.5 * delta.square()


def _k3(delta: torch.Tensor) -> torch.Tensor:
    return torch.exp(delta) - delta - 1.0


# Per-token estimators of KL(πθ‖πref) as functions of delta = logπref − logπθ (Schulman, "Approximating KL divergence").
KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator", "algorithm.kl_estimator")
for _name, _estimator in (("k1", _k1), ("k2", _k2), ("k3", _k3)):
    KL_ESTIMATORS.add(_name, _estimator)


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
    estimator = KL_ESTIMATORS[kind]
    delta, mask_f = masked_log_ratio(ref_logprobs, logprobs, mask)  # logπref − logπθ, 0 off-mask
    per_token = estimator(delta) * mask_f
    return per_token.sum() / denominator(normalizer, mask_f.sum(), "kl_penalty")
