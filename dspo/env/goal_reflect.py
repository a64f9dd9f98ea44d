"""Goal and reflection (`env=goal_reflect`; RE-Searcher, 2025): before each search the agent states what it is looking
for, `<goal> ... </goal>`, and after the results it says whether they held it, `<reflect> yes|no ... </reflect>`; the
reflection is paid when it is right.

Both are parts of a model turn's text, in either tag format (`searchr1`: `<goal> g </goal> <search> q </search>`;
`qwen`: `<goal> g </goal> <tool_call>{...}</tool_call>`): the turn that calls the search tool holds the goal, the next
model turn (after the results) the reflection, before its own goal and call or its answer. The last of each tag in a
turn counts.

The reward rule (`GoalReflectReward`), checkable exactly wherever the item names its gold pages (`metadata[gold_key]`:
the toy world's `chain`, the entity whose page each hop needs; HotpotQA's `supporting_titles`):
- a search's *target* is the gold page its goal names (the last gold title the goal contains as whole words,
  `dspo.metrics.phrase_in`: a goal naming "Kel Dranson" does not name "Kel Dran"); a goal that names none, or no
  goal, targets the gold page of the search's position (the k-th search, the k-th page; the last beyond the chain),
  as `reward/right_tool` of env=two_sources does;
- the results *hold the target* when a retrieved passage is titled with it;
- the *verdict* is the reflection's first word: `yes` or `no` (case and punctuation aside); any other first word is no
  verdict, which is never right;
- the reflection on a search is right when its verdict says whether the results hold the target. The reflecting turn
  gets a step reward `reflection_weight / searches` when right (0 when wrong, None on other turns), so with
  `credit: trajectory` the total is outcome + `reflection_weight` x the share of searches reflected on rightly, and
  with `credit: turn` (token-level objectives) the reflecting turn's tokens carry it. The outcome stays subEM, so the
  dynamic filter keeps its meaning.

Logged: `reward/goal_share` (searches preceded by a goal in their turn), `reward/reflect_share` (searches followed by
a reflection with a verdict), `reward/reflect_right` (searches reflected on rightly), `reward/held_share` (searches
whose results held their target: what noise takes away).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from dspo.env.rewards import EpisodeRecord, RewardResult, SubEMReward
from dspo.metrics import normalize_answer, phrase_in

VERDICTS = {"yes": True, "no": False}
_GOAL = re.compile(r"<goal>((?:(?!<goal>).)*?)</goal>", re.DOTALL)
_REFLECT = re.compile(r"<reflect>((?:(?!<reflect>).)*?)</reflect>", re.DOTALL)

SEARCHR1_INSTRUCTION = (
    "Answer the given question. Reason inside <think> and </think> first every time you get new information. If you "
    "lack some knowledge, first state what you are looking for inside <goal> and </goal>, then search by writing "
    "<search> query </search>; the top results come back between <information> and </information>. After the "
    "results, say inside <reflect> and </reflect> whether they contain what your goal asked, starting with yes or no. "
    "You may search as many times as you want. When you need no further knowledge, give the answer inside <answer> "
    "and </answer>, without explanation, for example <answer> Beijing </answer>. Question: {question}\n"
)
QWEN_INSTRUCTION = (
    "Answer the question below. Think step by step inside <think> </think>. Whenever you are missing a fact, first "
    "state what you are looking for inside <goal> </goal>, then call the search tool; you may search several times. "
    "After each result, say inside <reflect> </reflect> whether it contains what your goal asked, starting with yes "
    "or no. When you know the answer, give only the answer, as a short phrase, inside <answer> </answer>, for example "
    "<answer> Paris </answer>.\n\nQuestion: {question}"
)


def last_tag(pattern: re.Pattern, text: str) -> str | None:
    """The stripped content of the last complete tag of `pattern` in `text`, None without one."""
    found = pattern.findall(text)
    return found[-1].strip() if found else None


def goal_of(text: str) -> str | None:
    """The goal a model turn states (`<goal> ... </goal>`), None without one."""
    return last_tag(_GOAL, text)


def verdict_of(text: str) -> bool | None:
    """The verdict of a model turn's reflection: True for `<reflect> yes ...`, False for `<reflect> no ...`, None
    without a reflection or when its first word is neither."""
    reflection = last_tag(_REFLECT, text)
    if reflection is None:
        return None
    words = normalize_answer(reflection).split()
    return VERDICTS.get(words[0]) if words else None


@dataclass
class SearchCheck:
    """One search of an episode, as the reward judges it."""

    turn: int  # the model turn that called the tool
    goal: str | None
    target: str  # normalized gold title it looks for ("" when the item names no gold pages)
    held: bool  # a retrieved passage is titled with the target
    verdict: bool | None  # the next model turn's reflection (None: none, or no yes/no)

    @property
    def right(self) -> bool:
        return self.verdict is not None and bool(self.target) and self.verdict == self.held


def ordered_gold(episode: EpisodeRecord, key: str) -> list[str]:
    """The item's gold titles, normalized, in the item's order (the toy chain's hop order)."""
    value = episode.item.metadata.get(key, [])
    values = [value] if isinstance(value, str) else list(value)
    return [normalize_answer(str(v)) for v in values if str(v).strip()]


def check_searches(episode: EpisodeRecord, gold_key: str) -> list[SearchCheck]:
    """Every valid search of `episode` with its goal, target, whether its results held it and the reflection on it."""
    gold = ordered_gold(episode, gold_key)
    checks, position = [], 0
    for index, turn in enumerate(episode.turns):
        if turn.call is None or turn.result is None or turn.result.error is not None:
            continue
        goal = goal_of(turn.text)
        target = _target(goal, gold, position)
        titles = {normalize_answer(p.title) for p in turn.result.passages}
        following = episode.turns[index + 1] if index + 1 < len(episode.turns) else None
        verdict = verdict_of(following.text) if following is not None else None
        checks.append(SearchCheck(index, goal, target, bool(target) and target in titles, verdict))
        position += 1
    return checks


def _target(goal: str | None, gold: list[str], position: int) -> str:
    if not gold:
        return ""
    named = [title for title in gold if goal and phrase_in(title, goal)]
    return named[-1] if named else gold[min(position, len(gold) - 1)]


class GoalReflectReward(SubEMReward):
    """subEM + a step reward for each reflection that says rightly whether its search's results held the goal's
    target (the module's rule). Args:
    reflection_weight: the most the reflections add to a trajectory (all searches reflected on rightly); 0 logs the
        figures and pays nothing (the study's arm without the term).
    gold_key: the item metadata key holding the gold page titles (the toy's `chain`; HotpotQA: supporting_titles).
    max_answer_words, credit: as `SubEMReward`.
    """

    def __init__(
        self,
        reflection_weight: float = 0.2,
        gold_key: str = "chain",
        max_answer_words: int | None = None,
        credit: str = "trajectory",
    ) -> None:
        super().__init__(max_answer_words, credit)
        if reflection_weight < 0:
            raise ValueError(f"env.reward.reflection_weight={reflection_weight}: must be >= 0")
        self.reflection_weight, self.gold_key = reflection_weight, gold_key

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        return [self._score(episode) for episode in episodes]

    def _score(self, episode: EpisodeRecord) -> RewardResult:
        outcome = self.outcome(episode)
        checks = check_searches(episode, self.gold_key)
        steps: list[float | None] = [None] * len(episode.turns)
        for check in checks:
            reflecting = check.turn + 1
            if reflecting < len(steps) and check.verdict is not None:
                steps[reflecting] = self.reflection_weight / len(checks) if check.right else 0.0
        components = {"subem": outcome}
        if checks:  # means over the episodes that searched
            n = len(checks)
            components["goal_share"] = sum(c.goal is not None for c in checks) / n
            components["reflect_share"] = sum(c.verdict is not None for c in checks) / n
            components["reflect_right"] = sum(c.right for c in checks) / n
            components["held_share"] = sum(c.held for c in checks) / n
        return RewardResult(outcome, step_rewards=steps if self.reflection_weight else [], components=components)
