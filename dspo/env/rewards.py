"""Rewards: what the agent is paid for, computed from the whole finished episode.

A reward scores a batch of `EpisodeRecord`s (question, gold answers, item metadata such as HotpotQA's
`supporting_titles`, each model turn's call, the tool's result with the passages it retrieved, and the answer taken
from the model's own text) and returns, per episode, a `RewardResult`:

- `outcome`: the 0/1 correctness. The dynamic filter (Eq. 9) tests it, never the total: a continuous shaping term
  would make every group look "mixed" and switch the filter off without a word.
- `shaping`: a trajectory-level term added to the total (IKEA's knowledge-boundary term).
- `step_rewards`: one value per model turn (StepSearch's information gain minus redundancy), or empty.
- `components`: every named part, logged as `reward/<name>` (means over the round's sampled trajectories).

The scalar the group advantage uses is `total = outcome + shaping + Σ step_rewards`. With `credit: turn`, a
token-level objective credits each turn's tokens with the trajectory-level advantage (the estimator on outcome +
shaping) plus the same estimator's advantage of that turn's step reward among the group's step rewards instead
(StepSearch's token-level process supervision; `dspo.data.buffer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dspo.env.tools import ToolResult
from dspo.metrics import normalize_answer
from dspo.rewards import extract_answer, subem_reward
from dspo.types import QAItem

CREDITS = ("trajectory", "turn")


@dataclass
class TurnRecord:
    """One model turn of a finished episode. `call` is the tool and arguments of a valid call (None otherwise),
    `invalid` the error kind of a call the model got wrong, `result` what the tool returned."""

    text: str
    call: tuple[str, dict] | None = None
    invalid: str | None = None
    result: ToolResult | None = None


@dataclass
class EpisodeRecord:
    item: QAItem
    turns: list[TurnRecord]
    answer: str | None  # the reward's `extract_answer` on the model's own text (never a tool's)
    truncated: bool = False

    @property
    def searches(self) -> list[TurnRecord]:
        """The turns whose call ran (valid calls)."""
        return [turn for turn in self.turns if turn.call is not None]


@dataclass
class RewardResult:
    outcome: float
    shaping: float = 0.0
    step_rewards: list[float | None] = field(default_factory=list)  # one per turn; None: the turn has none
    components: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.outcome + self.shaping + sum(r for r in self.step_rewards if r is not None)


class Reward(Protocol):
    name: str
    credit: str  # "trajectory" | "turn"

    def extract_answer(self, text: str) -> str | None: ...

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]: ...


class SubEMReward:
    """DSPO's reward (Eq. 4): 1 if a normalized gold answer is a substring of the normalized last `<answer>`, else 0.

    Args:
        max_answer_words: optional guard: longer answers score 0 (off by default = paper-faithful).
        credit: "trajectory" (the only meaningful one: there are no step rewards).
    """

    name = "subem"

    def __init__(self, max_answer_words: int | None = None, credit: str = "trajectory") -> None:
        self.max_answer_words = max_answer_words
        self.credit = check_credit(credit)

    def extract_answer(self, text: str) -> str | None:
        return extract_answer(text)

    def outcome(self, episode: EpisodeRecord) -> float:
        return subem_reward(episode.answer, episode.item.golden_answers, self.max_answer_words)

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        results = []
        for episode in episodes:
            outcome = self.outcome(episode)
            results.append(RewardResult(outcome, components={self.name: outcome}))
        return results


def check_credit(credit: str) -> str:
    if credit not in CREDITS:
        raise ValueError(f"env.reward.credit={credit!r}: choose one of {CREDITS}")
    return credit


def gold_titles(item: QAItem, key: str) -> set[str]:
    """Normalized titles of an item's gold documents from `item.metadata[key]` (HotpotQA: `supporting_titles`; the
    toy world: `chain`, the entities whose pages a multi-hop question needs)."""
    value: Any = item.metadata.get(key, [])
    values = [value] if isinstance(value, str) else list(value)
    return {normalize_answer(str(v)) for v in values if str(v).strip()}
