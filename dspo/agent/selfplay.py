"""Search self-play's solver items: the proposer's questions that pass a retrieval-augmented check (SSP, Lu et al.
2025).

`VerifiedProposals` is a `Role.derive` (`dspo.agent.roles`): after the proposer played, it reads each proposer
episode's final turn (`dspo.env.proposals.parse_proposal`) and keeps the proposal only when the policy itself, greedy
and without searching, answers the question correctly from the documents the proposer retrieved (its answer states
the proposer's as whole words, `check_agrees`). The kept ones become the solver's items (question and answer, each
naming the episode it came from); the others are counted by reason and earn 0 (`FailureRateReward` pays an episode no
item was built from nothing).

The check's prompt is the solver's first prompt for the proposed question followed by the proposer's episode up to its
final turn, token for token (its searches, the results as its context held them, the wrappers between them), so the
checker reads the evidence in the format the policy searches in, as the planner's answerer reads the planner's
transcript (`dspo.env.answerer`). SSP's own check puts the documents in a RAG prompt; a prompt the policy was never
trained on would make a tiny model's check fail for the format, not the question. An episode compacted mid-way
(`rollout.agent.compaction`) is read from its last context only. A proposer that never searched has no evidence: its
proposal is refused (`no_search`) rather than checked against the policy's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dspo.agent.roles import RolePart, derived_item
from dspo.agent.stats import Kind
from dspo.engines.base import SamplingConfig
from dspo.env.answerer import ANSWER_STOPS
from dspo.env.prompting import build_messages, render_prompt
from dspo.env.proposals import parse_proposal
from dspo.env.rewards import extract_answer
from dspo.metrics import phrase_in

REASONS = (
    "no_question",
    "no_answer",
    "answer_in_question",
    "malformed_question",
    "off_topic",
    "no_search",
    "check_failed",
)


class VerifiedProposals:
    """Role.derive: the solver's items from the proposer's checked proposals. Config keys
    `rollout.agent.roles.<i>.derive.<key>`:
    proposer: the proposer role's name.
    tag_format, instruction: the solver's first prompt (its `rollout.agent.tag_format` and `env.instruction`; None:
        dspo's default for the tag format).
    check: run the retrieval-augmented check (False: every well-formed, searched proposal is kept; an ablation).
    on_topic: refuse a question that holds markup (`<`, `>`: `malformed_question`) or does not name its topic (the
        proposer's prompt, as whole words of the question: `off_topic`). Why: the check reads the proposer's
        evidence, so it answers right whatever the question says; without this rule the toy's proposer learned,
        within 40 steps, to write broken questions ("Where </ququestion>? </") about other pages, which the check
        passed and the searching solver could not answer, a high "difficulty" for nothing (measured, docs).
    max_new_tokens: of the checker's answer turn.
    benchmark: the solver items' benchmark name (their statistics are the solver role's).

    Statistics of the last call (`last_stats`, merged into the round's): `<proposer>/invalid/<reason>`, the share of
    proposer episodes refused for each reason of `REASONS`, and `<proposer>/checked`, the share that reached the check.
    """

    def __init__(
        self,
        proposer: str = "proposer",
        tag_format: str = "searchr1",
        instruction: str | None = None,
        check: bool = True,
        max_new_tokens: int = 96,
        benchmark: str = "selfplay",
        on_topic: bool = True,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"rollout.agent.roles.derive.max_new_tokens={max_new_tokens}: must be >= 1")
        build_messages("trial", tag_format, None, instruction)  # a bad tag format or instruction fails now
        self.proposer, self.tag_format, self.instruction = proposer, tag_format, instruction
        self.check, self.max_new_tokens, self.benchmark = check, max_new_tokens, benchmark
        self.on_topic = on_topic
        self.engine: Any = None
        self.tokenizer: Any = None
        self.last_stats: dict[str, float] = {}
        self.stat_kinds = {f"{proposer}/invalid/{reason}": Kind.MEAN for reason in REASONS}
        self.stat_kinds[f"{proposer}/checked"] = Kind.MEAN

    def bind(self, engine: Any, tokenizer: Any) -> None:
        """The policy's engine and tokenizer (`RoleAgent` calls this when it is built)."""
        self.engine, self.tokenizer = engine, tokenizer

    def __call__(self, parts: Sequence[RolePart]) -> list:
        by_role = {part.role: part for part in parts}
        if self.proposer not in by_role:
            raise ValueError(
                f"rollout.agent.roles.derive.proposer={self.proposer!r}: no such role (played: {list(by_role)})"
            )
        part = by_role[self.proposer]
        refused = dict.fromkeys(REASONS, 0)
        candidates = []  # (group, episode, proposal, trajectory)
        for g, group in enumerate(part.groups):
            for e, trajectory in enumerate(group.trajectories):
                proposal, reason = parse_proposal(self._final_turn(trajectory))
                if proposal is not None and self.on_topic:
                    reason = off_topic(proposal.question, group.item.question)
                    proposal = None if reason else proposal
                if proposal is not None and trajectory.num_tool_calls == 0:
                    proposal, reason = None, "no_search"
                if proposal is None:
                    refused[reason] += 1
                else:
                    candidates.append((g, e, proposal, trajectory))
        passed = self._checked(candidates) if self.check else [True] * len(candidates)
        refused["check_failed"] = passed.count(False)
        episodes = max(part.trajectories, 1)
        self.last_stats = {f"{self.proposer}/invalid/{reason}": n / episodes for reason, n in refused.items()}
        self.last_stats[f"{self.proposer}/checked"] = len(candidates) / episodes if self.check else 0.0
        return [
            replace(
                derived_item(part, g, e, proposal.question, [proposal.answer], proposal=True), benchmark=self.benchmark
            )
            for (g, e, proposal, _), ok in zip(candidates, passed, strict=True)
            if ok
        ]

    def _final_turn(self, trajectory: Any) -> str:
        if not trajectory.turn_spans:
            return ""
        start, end = trajectory.turn_spans[-1]
        return self._tokenizer().decode(trajectory.response_ids[start:end], skip_special_tokens=True)

    def _checked(self, candidates: list) -> list[bool]:
        """The retrieval-augmented check of each candidate (the module), one greedy engine call for all."""
        if not candidates:
            return []
        prompts = [self.check_prompt_ids(proposal.question, trajectory) for _, _, proposal, trajectory in candidates]
        sampling = SamplingConfig(0.0, 1.0, self.max_new_tokens, list(ANSWER_STOPS), None)
        generations = self.engine.generate(prompts, sampling)
        if len(generations) != len(prompts):
            raise RuntimeError(
                f"self-play check: the engine returned {len(generations)} generations for {len(prompts)}"
            )
        return [
            check_agrees(extract_answer(generation.text), proposal.answer)
            for generation, (_, _, proposal, _) in zip(generations, candidates, strict=True)
        ]

    def check_prompt_ids(self, question: str, trajectory: Any) -> list[int]:
        """The solver's first prompt for `question`, then the proposer's episode up to its final turn."""
        tokenizer = self._tokenizer()
        messages = build_messages(question, self.tag_format, None, self.instruction)
        prompt = tokenizer.encode(render_prompt(tokenizer, messages, self.tag_format), add_special_tokens=False)
        final_start = trajectory.turn_spans[-1][0] if trajectory.turn_spans else 0
        return prompt + list(trajectory.response_ids[:final_start])

    def _tokenizer(self) -> Any:
        if self.tokenizer is None or (self.check and self.engine is None):
            raise RuntimeError(
                "VerifiedProposals has no engine: it is a Role.derive of dspo.agent.roles.RoleAgent, which binds the "
                "policy's engine when it is built; build it through RoleAgent"
            )
        return self.tokenizer


def off_topic(question: str, topic: str) -> str:
    """Why a question is not about `topic`: `malformed_question` (it holds markup), `off_topic` (it does not name the
    topic), or "" (it is about it)."""
    if "<" in question or ">" in question:
        return "malformed_question"
    return "" if phrase_in(topic, question) else "off_topic"


def check_agrees(checked: str | None, proposed: str) -> bool:
    """The check's answer states the proposer's answer as whole words (`dspo.metrics.phrase_in`): a substring would
    pass the proposal "1" on a check that answered "1991"."""
    return checked is not None and phrase_in(proposed, checked)
