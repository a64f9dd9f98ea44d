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
from dspo.agent.trajectory import EpisodeCounts, EpisodeEnd, EpisodeTokens, build_trajectory
from dspo.env.rewards import RewardResult
from dspo.types import Trajectory


def episode_trajectory(ep: Episode, result: RewardResult, policy_version: int, tokenizer: Any) -> Trajectory:
    counts = EpisodeCounts(len(ep.calls), ep.tool_calls, ep.invalid)
    reason = ep.end_reason()
    if ep.error is not None:
        prompt = ep.calls[0].prompt_ids if ep.calls else _question_ids(ep, tokenizer)
        stub = EpisodeTokens(list(prompt) or [tokenizer.eos_token_id])
        end = EpisodeEnd(reason, truncated=True)
        return build_trajectory(ep.item, stub, None, counts, end, policy_version, tokenizer, per_turn=False)
    samples, ep.prefix_breaks = build_samples(ep.calls)
    if not samples:  # the agent answered without calling the policy: nothing to train, only a score
        tokens = EpisodeTokens(_question_ids(ep, tokenizer) or [tokenizer.eos_token_id])
    else:
        main = samples[0]
        segments = [sample.segment() for sample in samples[1:]]
        tokens = EpisodeTokens(main.prompt_ids, main.response_ids, main.mask, main.logprobs, list(main.spans), segments)
    end = EpisodeEnd(reason, ep.truncated, ep.answer)
    return build_trajectory(ep.item, tokens, result, counts, end, policy_version, tokenizer, per_turn=False)


def _question_ids(ep: Episode, tokenizer: Any) -> list[int]:
    return tokenizer.encode(ep.item.question, add_special_tokens=False)
