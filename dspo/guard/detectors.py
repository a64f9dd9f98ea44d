"""Collapse detectors (`guard.detectors`): each watches one signal of a round and returns a `Verdict` (issue 55).

A detector is a small class registered by name in `DETECTORS` (like objectives and filters): its `Settings` dataclass
holds its thresholds (defaults are the entry's, validated by `make_settings` naming `guard.detectors.<name>.<key>`),
`observe(signals)` takes one round's `RoundSignals` and returns a `Verdict` whose `score` is logged as
`guard/<name>` every round and whose `fired` asks the guard to act (`Settings.action`: warn, rollback or stop). Its
running state (EMAs, bests, baselines) is plain numbers, so that it is saved in checkpoints (`state_dict`) and loads
with torch's `weights_only`.

The signals are what a round already logs (`rollout/*`, `train/*`, `val/subem_mean`); a detector never reads the
model. Baselines are taken over the first `warmup` rounds, since the toy's rounds start from a warm start whose own
level is the reference (not a universal constant).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, ClassVar

from dspo.algorithms.registry import Registry

ACTIONS = ("warn", "rollback", "stop")


@dataclass(frozen=True)
class RoundSignals:
    """One round's numbers, as logged (None: not logged this round, e.g. no validation since the last round)."""

    round_index: int
    step: int
    sampled_reward: float | None = None  # rollout/sampled_reward_mean
    entropy: float | None = None  # train/entropy, mean over the round's steps
    response_tokens: float | None = None  # train/response_tokens_mean, mean over the round's steps
    truncated_share: float | None = None  # rollout/truncated_share
    grad_norm: float | None = None  # train/grad_norm, largest of the round's steps (before clipping)
    no_search_share: float | None = None  # rollout/no_search_share: episodes that answered without a tool call
    searched_reward: float | None = None  # rollout/searched_reward_mean: reward of the episodes that searched
    validation: float | None = None  # val/subem_mean, when a validation ended since the last round
    validation_noise: float | None = None  # the standard error of a difference of two such validations (None: unknown)
    skipped_steps: int = 0  # steps skipped for a non-finite loss or gradient in this round


@dataclass(frozen=True)
class Verdict:
    """A detector's answer for one round: its `score` (logged), whether it `fired`, and the numbers behind it.
    `suspect`: the round looks bad though the detector does not fire yet (its patience runs): the checkpoint that
    sampled it must not become the rollback target."""

    score: float
    fired: bool = False
    reason: str = ""
    suspect: bool = False


@dataclass
class DetectorSettings:
    """Settings every detector has: what the guard does when it fires, and the rounds it only watches."""

    action: str = "rollback"
    warmup: int = 3  # rounds that set the baseline; the detector cannot fire during them

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action={self.action!r}: choose one of {', '.join(ACTIONS)}")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")


class Detector:
    """Base: `state` is a dict of plain numbers (checkpointed); subclasses implement `observe`."""

    Settings: ClassVar[type[DetectorSettings]] = DetectorSettings

    def __init__(self, settings: DetectorSettings | None = None) -> None:
        self.settings = settings or self.Settings()
        self.state: dict[str, Any] = {"seen": 0}

    def observe(self, signals: RoundSignals) -> Verdict:
        raise NotImplementedError

    def warming_up(self) -> bool:
        self.state["seen"] += 1
        return self.state["seen"] <= self.settings.warmup

    def baseline(self, key: str, value: float) -> float:
        """Mean of `value` over the warm-up rounds (the reference a ratio is taken against)."""
        if self.state["seen"] <= max(self.settings.warmup, 1):
            n = self.state.get(f"{key}_n", 0)
            self.state[key] = (self.state.get(key, 0.0) * n + value) / (n + 1)
            self.state[f"{key}_n"] = n + 1
        return self.state[key]

    def after_rollback(self) -> None:
        """The policy was restored: forget what describes the rounds since (baselines and bests stay)."""

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


DETECTORS: Registry[type[Detector]] = Registry("guard detector", "guard.detectors")


def register_detector(name: str):
    def wrap(cls: type[Detector]) -> type[Detector]:
        DETECTORS.add(name, cls)
        cls.name = name
        return cls

    return wrap


@register_detector("reward_drop")
class RewardDrop(Detector):
    """The sampled reward's EMA more than `drop` (a share) below the best EMA, for `patience` rounds in a row.

    Relative, because reward levels differ by task and by how hard the data is: the toy's warm start samples 0.2-0.5,
    and at optimizer.lr=2e-3 it fell to 0.02-0.06 while an absolute margin of 0.2 never fired (measured, issue 55);
    half, because a healthy toy run's EMA dipped at most 20 % below its best. An EMA (alpha 0.3: about 3 rounds)
    because one round's reward is a mean of a few dozen 0/1 outcomes; a patience of 3 so that one bad round does not
    roll back. Score: 1 - EMA / best EMA."""

    @dataclass
    class Settings(DetectorSettings):
        alpha: float = 0.3
        drop: float = 0.5
        patience: int = 3

    def after_rollback(self) -> None:
        # the EMA holds the collapsed rounds: kept, it would stay below the bar for rounds after the restored policy
        # is back to its level and roll back again at once
        self.state.pop("ema", None)
        self.state["below"] = 0

    def observe(self, signals: RoundSignals) -> Verdict:
        if not _finite(signals.sampled_reward):  # non_finite's case; a NaN would stay in the EMA for good
            return Verdict(0.0)
        s, st = self.settings, self.state
        ema = st.get("ema", signals.sampled_reward)
        st["ema"] = ema = (1 - s.alpha) * ema + s.alpha * signals.sampled_reward
        warm = self.warming_up()
        st["best"] = best = max(st.get("best", ema), ema)
        score = 1 - ema / best if best > 0 else 0.0
        st["below"] = st.get("below", 0) + 1 if score > s.drop and not warm else 0
        fired = st["below"] >= s.patience
        # the round's own reward under the bar (warm-up too): the weights that sampled it are no rollback target, even
        # before the EMA crosses (a collapse is rounds old when it does)
        suspect = best > 0 and signals.sampled_reward < best * (1 - s.drop)
        reason = f"reward EMA {ema:.3f} is {score:.0%} below its best {best:.3f}"
        return Verdict(score, fired, reason, suspect=suspect)


@register_detector("val_drop")
class ValidationDrop(Detector):
    """Validation (`val/subem_mean`) more than `margin` below its best so far, step 0 included, and more than `z`
    standard errors of a difference of two validations (`RoundSignals.validation_noise`, from the validation set's
    size): on a few dozen questions a drop of 0.25 is noise, which `margin` alone would act on.

    0.1 because the toy's validation set is small (its step-to-step noise is a few points) and a real collapse drops
    it by tens of points; on its 2 x 100 questions 2 standard errors are 0.10 too. No warm-up: the step-0 value is a
    sound baseline. Score: best - latest."""

    @dataclass
    class Settings(DetectorSettings):
        warmup: int = 0
        margin: float = 0.1
        z: float = 2.0

    def observe(self, signals: RoundSignals) -> Verdict:
        st = self.state
        if not _finite(signals.validation):
            return Verdict(st.get("best", 0.0) - st.get("last", st.get("best", 0.0)))
        st["last"] = signals.validation
        st["best"] = max(st.get("best", signals.validation), signals.validation)
        score = st["best"] - signals.validation
        bar = max(self.settings.margin, self.settings.z * (signals.validation_noise or 0.0))
        fired = score > bar
        reason = f"validation {signals.validation:.3f} is {score:.3f} below its best {st['best']:.3f} (bar {bar:.3f})"
        return Verdict(score, fired, reason)


@register_detector("entropy")
class EntropyCollapse(Detector):
    """The policy's token entropy collapsing (below `low` x its warm-up level) or exploding (above `high` x).

    RL sharpens a policy, so a drop to half is normal; a 10x drop means it emits near-deterministic text, and a 3x
    rise means it lost its distribution (a too-large step). Score: |log(entropy / baseline)|."""

    @dataclass
    class Settings(DetectorSettings):
        low: float = 0.1
        high: float = 3.0

    def observe(self, signals: RoundSignals) -> Verdict:
        if not _finite(signals.entropy):
            return Verdict(0.0)
        warm = self.warming_up()
        base = self.baseline("baseline", signals.entropy)
        ratio = signals.entropy / base if base > 0 else 1.0
        score = abs(math.log(max(ratio, 1e-12)))
        fired = not warm and (ratio < self.settings.low or ratio > self.settings.high)
        return Verdict(score, fired, f"entropy {signals.entropy:.4f} is {ratio:.2f}x its warm-up level {base:.4f}")


@register_detector("length")
class LengthExplosion(Detector):
    """Response length above `max_ratio` x its warm-up level, or the truncated share `max_truncated_rise` above its
    warm-up level: a policy that rambles until the token or turn budget ends it.

    3x: the toy's episodes vary by well under 2x as training proceeds; 0.3: a third more episodes cut off.
    Score: length / warm-up length."""

    @dataclass
    class Settings(DetectorSettings):
        max_ratio: float = 3.0
        max_truncated_rise: float = 0.3

    def observe(self, signals: RoundSignals) -> Verdict:
        if not _finite(signals.response_tokens):
            return Verdict(0.0)
        warm = self.warming_up()
        base = self.baseline("tokens", signals.response_tokens)
        ratio = signals.response_tokens / base if base > 0 else 1.0
        rise = 0.0
        if _finite(signals.truncated_share):
            rise = signals.truncated_share - self.baseline("truncated", signals.truncated_share)
        fired = not warm and (ratio > self.settings.max_ratio or rise > self.settings.max_truncated_rise)
        return Verdict(ratio, fired, f"length {ratio:.2f}x its warm-up level, truncated share +{rise:.2f}")


@register_detector("grad_spike")
class GradSpike(Detector):
    """A gradient norm (before clipping) above `factor` x the median of the last `window` rounds.

    A median, not a mean, so that one spike does not raise its own bar; 10x because the norm of a healthy run moves by
    2-3x between rounds. Warn by default: clipping already bounds the step, a spike is a sign, not damage.
    Score: norm / running median."""

    @dataclass
    class Settings(DetectorSettings):
        action: str = "warn"
        warmup: int = 5
        factor: float = 10.0
        window: int = 20

    def observe(self, signals: RoundSignals) -> Verdict:
        norm = signals.grad_norm
        if not _finite(norm):
            return Verdict(0.0)
        warm = self.warming_up()
        history: list[float] = self.state.setdefault("history", [])
        median = statistics.median(history) if history else norm
        ratio = norm / median if median > 0 else 1.0
        history.append(norm)
        del history[: -self.settings.window]
        fired = not warm and ratio > self.settings.factor
        return Verdict(ratio, fired, f"grad norm {norm:.3g} is {ratio:.1f}x the running median {median:.3g}")


@register_detector("non_finite")
class NonFinite(Detector):
    """Any non-finite signal, or a step skipped for a non-finite loss or gradient (`optimizer.max_consecutive_skips`
    stops the run after a few in a row; this rolls back at the first). Score: count."""

    @dataclass
    class Settings(DetectorSettings):
        warmup: int = 0

    def observe(self, signals: RoundSignals) -> Verdict:
        values = [v for k, v in dataclasses.asdict(signals).items() if isinstance(v, float)]
        bad = sum(not math.isfinite(v) for v in values) + signals.skipped_steps
        return Verdict(float(bad), bad > 0, f"{signals.skipped_steps} skipped steps, {bad} non-finite values")


@register_detector("no_search")
class NoSearch(Detector):
    """Reward hacking by not searching: the share of episodes answering without a tool call `max_rise` above its
    warm-up level while the reward of the episodes that searched holds (within `hold` of its warm-up level), i.e.
    the policy learns to guess rather than search. Warn by default: on easy questions answering directly is right.
    Score: the rise of the no-search share."""

    @dataclass
    class Settings(DetectorSettings):
        action: str = "warn"
        max_rise: float = 0.3
        hold: float = 0.1

    def observe(self, signals: RoundSignals) -> Verdict:
        if not _finite(signals.no_search_share):
            return Verdict(0.0)
        warm = self.warming_up()
        rise = signals.no_search_share - self.baseline("share", signals.no_search_share)
        holds = True
        if _finite(signals.searched_reward):
            holds = signals.searched_reward >= self.baseline("searched", signals.searched_reward) - self.settings.hold
        fired = not warm and rise > self.settings.max_rise and holds
        return Verdict(rise, fired, f"no-search share {signals.no_search_share:.2f} (+{rise:.2f}), searched holds")


def build_detectors(config: dict[str, dict[str, Any] | None] | None) -> dict[str, Detector]:
    """The detectors of `guard.detectors` (name -> keyword settings; null turns one off), every registered one by
    default; an unknown name or setting is refused naming its config key."""
    from dspo.algorithms.registry import make_settings

    config = dict(config) if config is not None else dict.fromkeys(DETECTORS, {})
    detectors = {}
    for name, kwargs in config.items():
        if kwargs is None or kwargs is False:
            continue
        cls = DETECTORS[name]
        key = f"guard.detectors.{name}"
        try:
            settings = make_settings(cls.Settings(), kwargs, key, f"detector '{name}'")
        except (TypeError, ValueError) as error:
            message = str(error)
            raise ValueError(message if message.startswith(key) else f"{key}: {message}") from None
        detectors[name] = cls(settings)
    return detectors
