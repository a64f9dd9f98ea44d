"""A finished episode + its reward -> the `Trajectory` the trainer sees: its first sample as the trajectory's tokens,
every other sample (a break or a branch, `dspo.agent.endpoint.episodes`) as a `Segment` trained with its advantage.

An episode whose agent failed is a masked stub: its first prompt (or the question's tokens when it made no call)
with no response, reward 0, outcome 0 and a failed `stop_reason` ("agent_error" / "agent_timeout"): nothing of it is
trained, and `RoundSampler` drops its group before the filter (a crash is no outcome; the group could otherwise pass
as mixed and give the others advantages from it).
"""

from __future__ import annotations

from typing import Any

from dspo.agent.endpoint.episodes import Episode, build_samples
from dspo.env.rewards import RewardResult
from dspo.types import Trajectory


def episode_trajectory(ep: Episode, result: RewardResult, policy_version: int, tokenizer: Any) -> Trajectory:
    common = {
        "question": ep.item.question,
        "golden_answers": list(ep.item.golden_answers),
        "num_turns": len(ep.calls),
        "num_tool_calls": sum(ep.tool_calls.values()),
        "num_invalid_calls": sum(ep.invalid.values()),
        "tool_calls": dict(ep.tool_calls),
        "policy_version": policy_version,
        "stop_reason": ep.end_reason(),
    }
    if ep.error is not None:
        prompt = ep.calls[0].prompt_ids if ep.calls else tokenizer.encode(ep.item.question, add_special_tokens=False)
        return Trajectory(
            prompt_ids=list(prompt) or [tokenizer.eos_token_id],
            response_ids=[],
            response_mask=[],
            engine_logprobs=[],
            reward=0.0,
            outcome=0.0,
            answer=None,
            truncated=True,
            **common,
        )
    samples, ep.prefix_breaks = build_samples(ep.calls)
    if not samples:  # the agent answered without calling the policy: nothing to train, only a score
        prompt = tokenizer.encode(ep.item.question, add_special_tokens=False) or [tokenizer.eos_token_id]
        return Trajectory(
            list(prompt), [], [], [], reward=result.total, outcome=result.outcome, answer=ep.answer, **common
        )
    main = samples[0]
    return Trajectory(
        prompt_ids=main.prompt_ids,
        response_ids=main.response_ids,
        response_mask=main.mask,
        engine_logprobs=main.logprobs,
        reward=result.total,
        outcome=result.outcome,
        turn_spans=list(main.spans),
        reward_components=dict(result.components),
        answer=ep.answer,
        response_text=tokenizer.decode(main.response_ids, skip_special_tokens=False),
        truncated=ep.truncated,
        segments=[sample.segment() for sample in samples[1:]],
        **common,
    )
