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
(StepSearch's token-level process supervision; `dspo.data.round_builder`).

The answer and its subEM (`extract_answer`, `subem_reward`), which every shipped reward starts from:

`R = 1` if some gold answer, normalized (FlashRAG / Search-R1 `normalize_answer`), is a substring of the normalized
content of the LAST `<answer>…</answer>` in the model's own text; no answer → 0. Extraction must run on model-generated
text only (the agent does this), so that a retrieved document containing `<answer>` can never score.

`extract_answer` is the only answer extractor: the agent calls it once and stores `Trajectory.answer`, which both the
training reward (`subem_reward`) and evaluation (`dspo.eval.pipeline`) score as is, so the two can never disagree.

Departure from Search-R1's extraction (the last non-greedy `<answer>(.*?)</answer>` span): the answer is the content
after the LAST `<answer>` opening tag before the last `</answer>`. The agent extracts from the model's turns joined
without the observations, so with Search-R1's regex an `<answer>` left unclosed in an early turn ("<answer>Lipinton.
</think> <search> Lipinton </search>") opened a span that ran through every later turn to the final `</answer>`: the
answer scored was the union of the intermediate and the final names. RL on the toy default learned exactly that
(measured: after 100 steps, 1-hop "Who founded X?" rollouts that answered the founder, searched on, and answered the
founder's birthplace were rewarded, and test EM was 0.23 for a subEM of 0.94 on 2-hop questions).

`max_answer_words` is an optional guard (off by default = paper-faithful): subEM rewards an answer that lists many
candidates, which RL can learn to exploit; with the guard, answers longer than that many words score 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dspo.env.tools import ToolResult, carried
from dspo.metrics import normalize_answer, sub_exact_match
from dspo.types import QAItem

CREDITS = ("trajectory", "turn")

_ANSWER = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)  # a span holds no inner opening tag


def extract_answer(text: str) -> str | None:
    """Stripped content of the last complete `<answer>…</answer>` in `text` (the text after the last `<answer>` that
    is closed), or None if there is none."""
    matches = _ANSWER.findall(text)
    if not matches:
        return None
    return matches[-1].strip()


def subem_reward(answer: str | None, golden_answers: str | Sequence[str], max_answer_words: int | None = None) -> float:
    """subEM reward (Eq. 4) in {0.0, 1.0} of an answer already extracted by `extract_answer` (None → 0.0).

    The answer is scored as is, never extracted a second time, so reward and evaluation agree: the extraction of
    `<answer>Lyon <answer>Paris</answer>` is `Paris` (Search-R1's would be `Lyon <answer>Paris`, see the module).
    """
    if answer is None:
        return 0.0
    if max_answer_words is not None and len(normalize_answer(answer).split()) > max_answer_words:
        return 0.0
    return sub_exact_match(answer, golden_answers)


@dataclass
class TurnRecord:
    """One model turn of a finished episode. `call` is the tool and arguments of a valid call (None otherwise),
    `invalid` the error kind of a call the model got wrong, `result` what the tool returned."""

    text: str
    call: tuple[str, dict] | None = None
    invalid: str | None = None
    result: ToolResult | None = None


def observation_ids(tokenizer: Any, text: str, max_obs_tokens: int | None) -> list[int]:
    """A tool message's tokens as the agent loop splices them into the context (`ToolCallingAgent._append_observation`):
    the text made encodable, tokenized alone, cut to `max_obs_tokens` (None: not cut). A reader of the episode
    (env=planner's answerer) calls it to see each result exactly as the policy saw it."""
    ids = tokenizer.encode(carried(text), add_special_tokens=False)
    return ids if max_obs_tokens is None else ids[:max_obs_tokens]


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
    # the answer the system gave when it is not the policy's own (env=planner: the frozen answerer's), scored and
    # reported in its place (validation, test, dspo-eval); "" = none given. None: the policy's extracted answer stands
    answer: str | None = None

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
