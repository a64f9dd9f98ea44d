"""One finished episode -> the `Trajectory` the trainer sees, for every agent (the tool-calling loop and the endpoint).

Both agents end an episode with the same facts: the question, the tokens of its main sample (and earlier samples as
`Segment`s), the environment's `RewardResult`, its tool-call counters and why it ended (`dspo.types.STOP_REASONS`).
`EpisodeTokens`, `EpisodeCounts` and `EpisodeEnd` carry them; `build_trajectory` is the one place that turns them into a
`Trajectory`, so a field added for the trainer (a stop reason, a version per token) reaches both agents at once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dspo.env.rewards import RewardResult
from dspo.types import QAItem, Segment, Trajectory


@dataclass
class EpisodeTokens:
    """The main sample's tokens (same conventions as `Trajectory`) and the earlier samples."""

    prompt_ids: list[int]  # [P]
    response_ids: list[int] = field(default_factory=list)  # [R]
    mask: list[int] = field(default_factory=list)  # [R] 1 = model-generated
    logprobs: list[float] = field(default_factory=list)  # [R] engine logprobs on mask-1 tokens
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [turns] response positions of each model turn
    segments: list[Segment] = field(default_factory=list)  # earlier samples, trained with the episode's advantage
    token_versions: list[int] = field(default_factory=list)  # [R] when more than one policy version generated them


@dataclass
class EpisodeCounts:
    """What the episode did: model turns (or calls), valid calls per tool, invalid calls per (tool, kind)."""

    turns: int
    tool_calls: Counter
    invalid: Counter


@dataclass
class EpisodeEnd:
    """How it ended: the reason (`dspo.types.STOP_REASONS`; "" when an agent does not say), whether without its answer
    (a budget ran out or it failed), and the answer the reward extracted."""

    reason: str
    truncated: bool
    answer: str | None = None


def build_trajectory(
    item: QAItem,
    tokens: EpisodeTokens,
    result: RewardResult | None,
    counts: EpisodeCounts,
    end: EpisodeEnd,
    policy_version: int,
    tokenizer: Any,
    per_turn: bool = True,
) -> Trajectory:
    """The episode's `Trajectory`. `result` None: the episode has no score (it failed outside the policy): reward and
    outcome 0, which the round never uses (`RolloutGroup.failed` drops its group). `per_turn`: keep the result's step
    rewards for per-turn credit (one per model turn of `tokens.turn_spans`); an agent whose turns the trainer cannot
    align with its samples (the endpoint) passes False, and its step rewards count in the total only."""
    steps = list(result.step_rewards) if result is not None and per_turn else []
    answer = end.answer
    if result is not None and result.answer is not None:  # the reward's answerer answered for the policy (env=planner)
        answer = result.answer or None
    return Trajectory(
        prompt_ids=tokens.prompt_ids,
        response_ids=tokens.response_ids,
        response_mask=tokens.mask,
        engine_logprobs=tokens.logprobs,
        reward=result.total if result is not None else 0.0,
        outcome=result.outcome if result is not None else 0.0,
        step_rewards=steps,
        turn_spans=list(tokens.turn_spans),
        reward_components=dict(result.components) if result is not None else {},
        answer=answer,
        question=item.question,
        golden_answers=list(item.golden_answers),
        response_text=tokenizer.decode(tokens.response_ids, skip_special_tokens=False) if tokens.response_ids else "",
        num_turns=counts.turns,
        num_tool_calls=sum(counts.tool_calls.values()),
        num_invalid_calls=sum(counts.invalid.values()),
        tool_calls=dict(counts.tool_calls),
        truncated=end.truncated,
        stop_reason=end.reason,
        policy_version=policy_version,
        segments=list(tokens.segments),
        token_versions=list(tokens.token_versions),
    )
