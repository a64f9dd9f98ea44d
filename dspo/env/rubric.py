"""`RubricReward`: the reward as a weighted sum of named criteria (`env/reward=rubric`), each logged as a component.

    rubric = Σ_c weight_c · criterion_c(episode)

Criteria are a registry (`CRITERIA`): `subem`, `em`, `f1` of the scored answer against the gold answers; `format` (1
when the episode ends in an answer and no call was malformed); `length` (1 when the answer is at most `length_cap`
words: an answer-length cap that pays for short answers instead of zeroing long ones, as `max_answer_words` does);
`searches` (the number of calls that ran: a negative weight makes it a search cost); `judge` (the verdict of
`env/reward=judge`, which must then be selected too); `outcome` and `shaping` (the env's own reward's terms, so that
a rubric can extend IKEA's or the planner's reward instead of replacing it). Any other name is read from the env's
reward's components (e.g. `plan_quality` of env=planner), and fails at the first round, naming the key, if it has none
such.

The dynamic filter (Eq. 9) keeps groups whose OUTCOMES differ; `outcome` picks what it tests: `total` (the rubric's sum,
the default the issue asked for) or one criterion's name (e.g. `subem`: the rubric shapes the advantage, correctness
decides which groups train). Departure from a plain sum: a total that holds a continuous criterion (`f1`, `searches`)
makes nearly every group "mixed", which switches the filter off; `outcome=<a 0/1 criterion>` keeps it working.

The reward's total is the rubric's sum (plus the env's step rewards): `outcome` is the tested value and `shaping` the
rest of the sum, so that `RewardResult.total` (what the group advantage uses) equals it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dspo.env.rewards import EpisodeRecord, Reward, RewardResult
from dspo.metrics import exact_match, normalize_answer, sub_exact_match, token_f1


@dataclass(frozen=True)
class Scored:
    """What a criterion reads: the episode, the env's own reward's result for it, and the answer that is scored (the
    env's answer when its reward gave one, e.g. env=planner's answerer's, else the policy's)."""

    episode: EpisodeRecord
    result: RewardResult
    answer: str | None
    length_cap: int | None


def _answer_words(scored: Scored) -> int:
    return len(normalize_answer(scored.answer or "").split())


CRITERIA: dict[str, Callable[[Scored], float]] = {
    "subem": lambda s: sub_exact_match(s.answer, s.episode.item.golden_answers) if s.answer else 0.0,
    "em": lambda s: exact_match(s.answer, s.episode.item.golden_answers) if s.answer else 0.0,
    "f1": lambda s: token_f1(s.answer, s.episode.item.golden_answers) if s.answer else 0.0,
    "format": lambda s: float(bool(s.answer) and not any(turn.invalid for turn in s.episode.turns)),
    "length": lambda s: float(bool(s.answer) and (s.length_cap is None or _answer_words(s) <= s.length_cap)),
    "searches": lambda s: float(len(s.episode.searches)),
    "outcome": lambda s: s.result.outcome,
    "shaping": lambda s: s.result.shaping,
}
NEEDS_LAYER = {"judge": "judge"}  # a criterion read from a reward layer, and the layer's env/reward option


class RubricReward:
    """Args:
    base: the env's reward (with the judge on top when `env/reward=[judge,rubric]`).
    criteria: {criterion name: weight}; names from `CRITERIA`, `judge`, or a component of the base reward.
    outcome: `total` or a criterion's name: what the dynamic filter tests.
    length_cap: the `length` criterion's cap in words (None: any answer passes).
    """

    name = "rubric"

    def __init__(
        self,
        base: Reward,
        criteria: Mapping[str, float],
        outcome: str = "total",
        length_cap: int | None = None,
    ) -> None:
        self.base, self.credit = base, getattr(base, "credit", "trajectory")
        self.criteria = _checked_criteria(criteria, base)
        if outcome != "total" and outcome not in self.criteria:
            raise ValueError(
                f"env.reward.rubric.outcome={outcome!r}: choose `total` or one of the rubric's criteria "
                f"{sorted(self.criteria)} (env.reward.rubric.criteria)"
            )
        if length_cap is not None and length_cap < 1:
            raise ValueError(f"env.reward.rubric.length_cap={length_cap}: must be >= 1 word, or null")
        self.outcome, self.length_cap = outcome, length_cap

    def __getattr__(self, name: str):  # the env's reward's own attributes (the planner's answerer, ...) stay reachable
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def extract_answer(self, text: str) -> str | None:
        return self.base.extract_answer(text)

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        return [self._scored(e, r) for e, r in zip(episodes, self.base.score(episodes), strict=True)]

    def _scored(self, episode: EpisodeRecord, result: RewardResult) -> RewardResult:
        answer = result.answer if result.answer is not None else episode.answer
        scored = Scored(episode, result, answer, self.length_cap)
        values = {name: self._criterion(name, scored) for name in self.criteria}
        total = sum(self.criteria[name] * value for name, value in values.items())
        outcome = total if self.outcome == "total" else values[self.outcome]
        components = {**result.components, **values, self.name: total}
        return RewardResult(outcome, total - outcome, list(result.step_rewards), components, result.answer)

    def _criterion(self, name: str, scored: Scored) -> float:
        if name in CRITERIA:
            return float(CRITERIA[name](scored))
        if name not in scored.result.components:
            raise ValueError(
                f"env.reward.rubric.criteria.{name}: no such criterion ({sorted(CRITERIA)}, judge) and the env's "
                f"reward gives no component of that name (it gives {sorted(scored.result.components)})"
            )
        return float(scored.result.components[name])


def _checked_criteria(criteria: Mapping[str, float], base: Reward) -> dict[str, float]:
    if not criteria:
        raise ValueError("env.reward.rubric.criteria is empty: name at least one criterion and its weight")
    checked = {}
    for name, weight in dict(criteria).items():
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"env.reward.rubric.criteria.{name}={weight!r}: a weight must be a number")
        layer = NEEDS_LAYER.get(name)
        if layer is not None and not _has_layer(base, layer):
            raise ValueError(
                f"env.reward.rubric.criteria.{name} weighs the verdict of env.reward.{layer}, which this run does not "
                f"select: use env/reward=[{layer},rubric], or drop the criterion"
            )
        checked[str(name)] = float(weight)
    return checked


def _has_layer(reward: Reward, name: str) -> bool:
    """Whether `name` (e.g. the judge) is among the reward layers below this one."""
    while reward is not None:
        if getattr(reward, "name", None) == name:
            return True
        reward = reward.__dict__.get("base") if hasattr(reward, "__dict__") else None
    return False
