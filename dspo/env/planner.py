"""A search planner over a frozen answerer (`env=planner`; AI-SearchPlanner, Mei et al. 2025, "Modular Agentic
Search via Pareto-Optimal Multi-Objective Reinforcement Learning").

The policy is the *planner*: it searches, and it may ask the answerer (`<ask> question </ask>`, the `ask` tool) what it
makes of the results so far. When the episode ends (the planner's own `<answer>`, or a budget), the *answerer*, a
frozen second model (`dspo.env.answerer`: never trained, its weights never pushed), answers the question from what
the planner found: that answer is the system's, scored and reported in the planner's place (the planner's own answer
is only logged, as `reward/planner_subem`). The planner's reward (`PlannerReward`):

    total = answerer subEM + plan_weight x plan quality
            - cost.search x searches - cost.answerer x answerer calls - cost.unfinished x [ended by the budget]

- the outcome is the answerer's subEM, so the dynamic filter keeps groups in which the answerer's success differs;
- plan quality is checkable wherever an item names its gold pages (`gold_key`: the toy's `chain`, HotpotQA's
  `supporting_titles`): `gold_pages` = the share of them the planner's searches retrieved; or `answer_found` = 1 when
  a retrieved passage states a gold answer (any QA data). AI-SearchPlanner's process reward is an LLM's judgement of
  the plan's rationality; here it is exact, which is what the miniature can check;
- a search is one query sent to the search engine (a call with three queries is three); the answerer calls are the
  planner's asks plus the final hand-off (one per episode, always made);
- an episode the budget ended (out of turns or tokens: `EpisodeRecord.truncated`) is an unfinished plan: the answerer
  answers it all the same, so this cost is what tells the planner to end its plan rather than write a call it has no
  turn left to run (a departure from the paper, whose planner ends by format; seen without it: that last-turn call
  spread under RL, nothing paying against it);
- plan quality and costs are trajectory-level shaping (`RewardResult.shaping`): they are known when the episode ends.

Each term is logged as `reward/<name>`: `answerer_subem`, `planner_subem`, `plan_quality` (and `gold_pages` where
the item names gold pages, `answer_found`), `searches`, `answerer_calls`, `unfinished`, `cost` (the subtracted
term).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from dspo.env.answerer import Answerer, AnswerRequest, evidence
from dspo.env.rewards import EpisodeRecord, RewardResult, SubEMReward, gold_titles, subem_reward
from dspo.env.tools import BAD_ARGUMENTS, CallContext, InvalidCall, Tool, ToolResult
from dspo.metrics import normalize_answer, sub_exact_match

PLAN_QUALITIES = ("gold_pages", "answer_found")

SEARCHR1_INSTRUCTION = (
    "Answer the given question. Reason inside <think> and </think> first every time you get new information. If you "
    "lack some knowledge, search by writing <search> query </search>; the top results come back between "
    "<information> and </information>. You may ask the answerer what it makes of the results so far by writing "
    "<ask> question </ask>. Every search and every question has a cost. When you have found enough, give your answer "
    "inside <answer> and </answer>; the answerer then answers from what you found. Question: {question}\n"
)


@dataclass(frozen=True)
class Costs:
    """What the planner pays (`env.reward.cost.<key>`): per query sent to the search engine, per answerer call, and
    per episode it did not end itself (out of turns or tokens: its last turn a call the loop could not run). The
    answerer answers such an episode all the same, so without `unfinished` nothing in the reward tells the planner to
    end its plan, and its last turn drifts (measured: under cost.search=0.1 a call on the last turn grew to 0.43 of the
    episodes in 50 steps and the guard stopped 2 runs of 3 for length)."""

    search: float = 0.05
    answerer: float = 0.05
    unfinished: float = 0.1

    @classmethod
    def of(cls, value: Costs | Mapping[str, float] | None) -> Costs:
        if value is None or isinstance(value, Costs):
            return value or cls()
        known = [f.name for f in fields(cls)]
        unknown = [key for key in value if key not in known]
        if unknown:
            raise ValueError(f"env.reward.cost.{unknown[0]}: not a cost; the costs are {known}")
        costs = cls(**{key: float(value[key]) for key in value})
        for key in known:
            if getattr(costs, key) < 0:
                raise ValueError(f"env.reward.cost.{key}={getattr(costs, key)}: a cost must be >= 0")
        return costs


# ------------------------------------------------------------------------------------------ the tool
class AskAnswererTool(Tool):
    """`ask`: the frozen answerer answers the planner's question from what the episode found so far (the passages of
    its earlier calls, `CallContext.history`). Args (config keys `env.tools.ask.<key>`):
    answerer: an `EngineAnswerer` (the reward's: `${env.reward.answerer}`, one model per process) or any `Answerer`.
    max_question_chars: longer questions are the model's mistake (`rollout/invalid/ask/bad_arguments`).
    """

    name = "ask"
    description = "Ask the answerer a question; it answers from what your searches found so far."
    parameters = {
        "type": "object",
        "properties": {"question": {"type": "string", "description": "The question for the answerer."}},
        "required": ["question"],
    }
    tag_argument = "question"  # Search-R1 format: <ask> question </ask>

    def __init__(self, answerer: Answerer, max_question_chars: int = 512, name: str = "ask") -> None:
        if not callable(getattr(answerer, "answer", None)):
            raise TypeError(f"env.tools.{name}.answerer: {type(answerer).__name__} has no answer(requests) method")
        self.answerer, self.max_question_chars, self.name = answerer, max_question_chars, name

    def prepare(self, arguments: Any) -> dict:
        call = super().prepare(arguments)
        question = call["question"].strip()
        if not question or len(question) > self.max_question_chars:
            raise InvalidCall(
                BAD_ARGUMENTS,
                f"Error: ask the answerer one question of 1 to {self.max_question_chars} characters: "
                f"{self.tag_hint('<ask>', '</ask>')}",
            )
        return {"question": question}

    def run(self, calls: list[dict], contexts: list[CallContext]) -> list[ToolResult]:
        requests = [
            AnswerRequest(call["question"], list(context.history), _golds(context.item), _key(context))
            for call, context in zip(calls, contexts)
        ]
        answers = self.answerer.answer(requests)
        if len(answers) != len(calls):
            raise RuntimeError(f"answerer returned {len(answers)} answers for {len(calls)} questions")
        return [
            ToolResult(
                f"The answerer says: {answer}" if answer else "The answerer cannot answer from what you found.",
                metrics={"answered": float(bool(answer))},
            )
            for answer in answers
        ]


def _golds(item: Any) -> list[str]:
    return list(getattr(item, "golden_answers", []))


def _key(context: CallContext) -> str:
    return f"{getattr(context.item, 'id', '')}/{context.episode_index}/{context.turn}"


# ------------------------------------------------------------------------------------------ the reward
class PlannerReward(SubEMReward):
    """The planner's reward (the module). Args (config keys `env.reward.<key>`):
    answerer: the frozen answerer (`dspo.env.answerer.EngineAnswerer`, or `ScriptedAnswerer` in tests).
    plan_weight: the weight of plan quality (0: logged, not paid).
    cost: {search, answerer, unfinished}: per query sent to the search engine, per answerer call, per episode ended
        by the budget instead of the planner (`Costs`).
    plan_quality: `gold_pages` (share of the item's gold pages retrieved) or `answer_found` (a retrieved passage
        states a gold answer).
    gold_key: the item metadata naming the gold pages (the toy: `chain`; HotpotQA: `supporting_titles`).
    search_tools, ask_tool: the tool names counted as searches and as answerer calls.
    max_answer_words: as `SubEMReward`, applied to the answerer's answer. credit: trajectory only (the terms are
        known when the episode ends; per-turn credit is refused, naming both keys, dspo.training.combinations).
    """

    name = "answerer_subem"

    def __init__(
        self,
        answerer: Answerer,
        plan_weight: float = 0.1,
        cost: Costs | Mapping[str, float] | None = None,
        plan_quality: str = "gold_pages",
        gold_key: str = "chain",
        search_tools: Sequence[str] = ("search",),
        ask_tool: str = "ask",
        max_answer_words: int | None = None,
        credit: str = "trajectory",
    ) -> None:
        super().__init__(max_answer_words, credit)
        if credit != "trajectory":
            raise ValueError(
                f"env.reward.credit={credit}: the planner's reward (env.reward._target_="
                "dspo.env.planner.PlannerReward) is known when the episode ends; use env.reward.credit=trajectory"
            )
        if not callable(getattr(answerer, "answer", None)):
            raise TypeError(f"env.reward.answerer: {type(answerer).__name__} has no answer(requests) method")
        if plan_weight < 0:
            raise ValueError(f"env.reward.plan_weight={plan_weight}: must be >= 0")
        if plan_quality not in PLAN_QUALITIES:
            raise ValueError(f"env.reward.plan_quality={plan_quality!r}: choose one of {list(PLAN_QUALITIES)}")
        self.answerer, self.plan_weight, self.cost = answerer, float(plan_weight), Costs.of(cost)
        self.plan_quality, self.gold_key = plan_quality, gold_key
        self.search_tools, self.ask_tool = frozenset(search_tools), ask_tool

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        requests = [
            AnswerRequest(e.item.question, list(e.turns), _golds(e.item), f"{e.item.id}/{i}/final")
            for i, e in enumerate(episodes)
        ]
        answers = self.answerer.answer(requests) if requests else []  # the hand-off: one batch for every episode
        if len(answers) != len(episodes):
            raise RuntimeError(f"answerer returned {len(answers)} answers for {len(episodes)} episodes")
        return [self._score(episode, answer) for episode, answer in zip(episodes, answers)]

    def _score(self, episode: EpisodeRecord, answer: str | None) -> RewardResult:
        golds = episode.item.golden_answers
        outcome = subem_reward(answer, golds, self.max_answer_words)
        searches = sum(_queries(t) for t in episode.turns if t.call is not None and t.call[0] in self.search_tools)
        calls = 1 + sum(t.call is not None and t.call[0] == self.ask_tool for t in episode.turns)  # asks + hand-off
        passages = [p for t in evidence(episode.turns) if t.call[0] in self.search_tools for p in t.result.passages]
        components = {
            "answerer_subem": outcome,
            "planner_subem": subem_reward(episode.answer, golds, self.max_answer_words),
            "answer_found": float(any(sub_exact_match(f"{p.title} {p.text}", golds) for p in passages)),
            "searches": float(searches),
            "answerer_calls": float(calls),
            "unfinished": float(episode.truncated),
        }
        gold = gold_titles(episode.item, self.gold_key)
        if gold:  # logged only where the item names its pages (a mean over those that do)
            found = {normalize_answer(p.title) for p in passages} & gold
            components["gold_pages"] = len(found) / len(gold)
        plan = components.get(self.plan_quality, 0.0)
        cost = self.cost.search * searches + self.cost.answerer * calls + self.cost.unfinished * episode.truncated
        components.update(plan_quality=plan, cost=cost)
        shaping = self.plan_weight * plan - cost
        return RewardResult(outcome, shaping=shaping, components=components, answer=answer or "")


def _queries(turn: Any) -> int:
    """Queries of a search call (the search tool's prepared `query_list`; another search tool's call counts one)."""
    queries = turn.call[1].get("query_list") if isinstance(turn.call[1], dict) else None
    return len(queries) if isinstance(queries, list) and queries else 1
