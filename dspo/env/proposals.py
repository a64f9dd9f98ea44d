"""Proposals of a question with its answer: the proposer's side of search self-play (SSP, `experiment=toy_selfplay`).

A proposer episode searches a topic and ends with one turn that writes a question and the answer it found:
`<question> In which city was Kel Dran born? </question> <answer> Mardale </answer>` (the same text tags in both tag
formats). `parse_proposal` reads that turn; `ProposalReward` is the proposer's environment reward, a placeholder that
`dspo.agent.roles.FailureRateReward` overwrites once the solver has tried the question (it logs whether a question and
an answer were written at all). Checking a proposal (does a retrieval-augmented answer agree?) needs the policy and
lives in the agent layer (`dspo.agent.selfplay`).

Why the topic is a page of the corpus and not an answer (SSP gives its proposer a ground-truth answer to build a
question around): in the toy world a page states facts *about* its entity, so a question grounded in what the proposer
read is a question about the page's entity; what the answer is, the proposer finds by searching.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dspo.env.environment import Environment
from dspo.env.rewards import EpisodeRecord, RewardResult, check_credit, extract_answer
from dspo.metrics import normalize_answer, phrase_in

_QUESTION = re.compile(r"<question>(.*?)</question>", re.DOTALL)
MAX_QUESTION_CHARS = 512

SEARCHR1_PROPOSER_INSTRUCTION = (
    "Write a question about the topic below that can only be answered by searching, and its answer. Reason inside "
    "<think> and </think> first every time you get new information. Search by writing <search> query </search>; the "
    "top results come back between <information> and </information>. Search for the topic and, for a harder "
    "question, for what its page names. Then write the question inside <question> and </question> and its answer "
    "inside <answer> and </answer>, without explanation, for example <question> Where was Ana Lopez born? "
    "</question> <answer> Lima </answer>. Topic: {question}\n"
)
QWEN_PROPOSER_INSTRUCTION = (
    "Write a question about the topic below that can only be answered by searching, and its answer. Think step by "
    "step inside <think> </think>. Call the search tool to read about the topic and, for a harder question, about "
    "what its page names. Then write the question inside <question> </question> and its answer, as a short phrase, "
    "inside <answer> </answer>, for example <question> Where was Ana Lopez born? </question> <answer> Lima "
    "</answer>.\n\nTopic: {question}"
)


@dataclass(frozen=True)
class Proposal:
    question: str
    answer: str


def parse_proposal(text: str) -> tuple[Proposal | None, str]:
    """(the proposal of a final turn, "") or (None, why not): `no_question` (no complete `<question>` block, or an
    empty or over-long one), `no_answer` (no non-empty `<answer>`), `answer_in_question` (the question states the
    answer, as whole words: it gives itself away; `dspo.metrics.phrase_in`, so the answer "1" is not refused in a
    question about 1991)."""
    found = _QUESTION.findall(text)
    question = found[-1].strip() if found else ""
    if not question or len(question) > MAX_QUESTION_CHARS:
        return None, "no_question"
    answer = (extract_answer(text) or "").strip()
    if not normalize_answer(answer):
        return None, "no_answer"
    if phrase_in(answer, question):
        return None, "answer_in_question"
    return Proposal(question, answer), ""


class ProposalReward:
    """The proposer's environment reward: outcome 0 for every episode, rewritten by the round's settle
    (`FailureRateReward`) from how the solver did; `reward/proposal_formed` logs the episodes whose final turn wrote
    a question and an answer (`parse_proposal`)."""

    name = "proposal_formed"

    def __init__(self, credit: str = "trajectory") -> None:
        self.credit = check_credit(credit)

    def extract_answer(self, text: str) -> str | None:
        return extract_answer(text)

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        results = []
        for episode in episodes:
            final = episode.turns[-1].text if episode.turns else ""
            formed = float(parse_proposal(final)[0] is not None)
            results.append(RewardResult(0.0, components={self.name: formed}))
        return results


def proposer_environment(
    tools: Mapping[str, Any],
    tag_format: str = "searchr1",
    instruction: str | None = None,
    max_tool_error_share: float = 0.05,
) -> Environment:
    """The proposer's environment (`rollout.agent.roles.0.env`): the run's search tools, `ProposalReward`, and the
    proposer's instruction for `tag_format` (`instruction` replaces it; its `{question}` is the topic)."""
    if tag_format not in ("qwen", "searchr1"):
        raise ValueError(f"rollout.agent.roles.0.env.tag_format={tag_format!r}: expected 'qwen' or 'searchr1'")
    default = SEARCHR1_PROPOSER_INSTRUCTION if tag_format == "searchr1" else QWEN_PROPOSER_INSTRUCTION
    return Environment(tools, ProposalReward(), max_tool_error_share, instruction or default)
