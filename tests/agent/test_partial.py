"""Partial rollouts (issue 43 point 3, `dspo.agent.partial`): a resumable call of the tool-calling agent stops after
the turn `stop` asks for, carries the unfinished groups, and finishes them on newer weights with each token's version
and engine logprob kept; RoundSampler's carrying, age bound and statistics, by hand."""

from __future__ import annotations

import json

import pytest

from dspo.agent import AgentConfig
from dspo.agent.partial import token_staleness
from dspo.agent.tool_calling import ToolCallingAgent
from dspo.algorithms.config import AlgorithmConfig
from dspo.data.rounds import PromptSampler
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment
from dspo.rollout.sampler import RoundSampler
from dspo.types import QAItem, RolloutGroup, Trajectory


def item(searches: int, answer: str = "Paris") -> QAItem:
    """A question whose scripted episodes search `searches` times, then answer (odd episodes answer wrong)."""
    return QAItem(id=f"q{searches}", question=f"Capital of France? ({searches} searches)", golden_answers=[answer])


def script(prompt_text: str, turn: int, index: int) -> str:
    wanted = int(prompt_text.split("? (")[1].split(" searches")[0])
    if prompt_text.count("<tool_response>") < wanted:
        body = json.dumps({"name": "search", "arguments": {"query_list": [f"France {turn}"]}})
        return f"<think>Search.</think>\n<tool_call>\n{body}\n</tool_call>"
    guess = "Paris" if index % 2 == 0 else "Lyon"  # the engine's trajectory index: every group of two is mixed
    return f"<think>Done.</think>\n<answer> {guess} </answer>"


class VersionedEngine(ScriptedEngine):
    """Scripted turns whose logprobs say which weights generated them: -(version + 1) / 100 per token."""

    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        for gen in out:
            gen.logprobs = [-(self.version + 1) / 100] * len(gen.token_ids)
        return out


def agent_on(tokenizer, retriever, **limits) -> ToolCallingAgent:
    config = AgentConfig(**{"max_turns": 5, "max_new_tokens_per_turn": 48, **limits})
    return ToolCallingAgent(VersionedEngine(tokenizer, script), tokenizer, Environment.search(retriever), config)


def test_a_call_stops_where_asked_and_the_carried_groups_finish_on_newer_weights(qwen_tokenizer, retriever) -> None:
    agent = agent_on(qwen_tokenizer, retriever)
    asked: list[list[int]] = []

    def stop_at_first(done: list[RolloutGroup]) -> bool:
        asked.append([g.prompt_index for g in done])
        return True

    first = agent.rollout_partial([], [(10, item(0)), (11, item(2))], 2, 0, seed=1, stop=stop_at_first)
    assert asked == [[10]]  # the 0-search group ended in turn 0; stop said enough
    assert [g.prompt_index for g in first.groups] == [10]
    assert [g.prompt_index for g in first.carried] == [11] and first.carried[0].started == 0
    assert all(ep.turn == 1 and not ep.done for ep in first.carried[0].episodes)
    assert first.groups[0].trajectories[0].token_versions == []  # one version: nothing to record

    agent.engine.version = 3  # newer weights arrived between the calls
    second = agent.rollout_partial(first.carried, [], 2, 3, seed=2, stop=lambda done: False)
    assert second.carried == [] and [g.prompt_index for g in second.groups] == [11]
    traj = second.groups[0].trajectories[0]
    assert traj.policy_version == 0 and traj.num_tool_calls == 2 and traj.reward == 1.0
    assert len(traj.token_versions) == len(traj.response_ids)
    first_turn_end = traj.turn_spans[0][1]
    for position, (version, trained, logprob) in enumerate(
        zip(traj.token_versions, traj.response_mask, traj.engine_logprobs)
    ):
        if trained:  # each model token keeps its weights' version and the engine logprob they gave it
            expected = 0 if position < first_turn_end else 3
            assert version == expected and logprob == pytest.approx(-(expected + 1) / 100)
    assert set(traj.trained_token_versions()) == {0, 3}
    assert sorted(set(token_staleness(second.groups, 4))) == [1, 4]


def test_a_call_that_never_stops_gives_what_rollout_gives(qwen_tokenizer, retriever) -> None:
    items = [item(1), item(0), item(2)]
    whole = agent_on(qwen_tokenizer, retriever).rollout(items, 2, 5, seed=7)
    partial = agent_on(qwen_tokenizer, retriever).rollout_partial(
        [], list(enumerate(items)), 2, 5, seed=7, stop=lambda done: False
    )
    assert [g.prompt_index for g in partial.groups] == [1, 0, 2]  # in the order they finished
    by_index = {g.prompt_index: g for g in partial.groups}
    for group in whole.groups:
        for a, b in zip(group.trajectories, by_index[group.prompt_index].trajectories):
            assert (a.response_ids, a.response_mask, a.engine_logprobs) == (
                b.response_ids,
                b.response_mask,
                b.engine_logprobs,
            )
            assert (a.reward, a.policy_version, a.token_versions) == (b.reward, 5, [])
    assert partial.stats["turns_mean"] == whole.stats["turns_mean"]


def traj(versions: list[int], mask: list[int], version: int) -> Trajectory:
    n = len(mask)
    return Trajectory([1], [5] * n, mask, [0.0] * n, policy_version=version, token_versions=versions)


def test_token_staleness_counts_trained_tokens_by_hand() -> None:
    mixed = traj([2, 2, 2, 4, 4], [1, 1, 0, 1, 0], 2)  # trained: v2, v2, v4
    plain = traj([], [1, 0, 1], 4)  # trained: v4, v4
    group = RolloutGroup(item(0), [mixed, plain])
    assert mixed.trained_token_versions() == [2, 2, 4] and plain.trained_token_versions() == [4, 4]
    assert sorted(token_staleness([group], 5)) == [1, 1, 1, 3, 3]
    with pytest.raises(ValueError, match="token_versions"):
        traj([1, 2], [1, 1, 1], 1)


# ------------------------------------------------------------------------------------------ RoundSampler
def first_round(tokenizer, retriever):
    """Round 1 at weights 0 of four prompts in flight (one answers at once, three search three times); B = 1."""
    agent = agent_on(tokenizer, retriever)
    spec = AlgorithmConfig(group_size=2, batch_groups=1, micro_batch_size=2, max_prompts_per_call=4)
    rounds = RoundSampler(agent, spec, max_token_age=2)
    rounds.keep_rate_estimate = 0.25  # four prompts in flight
    sampler = PromptSampler([item(0), item(3), item(3), item(3)], seed=0)
    kept, stats = rounds.sample_round(sampler, policy_version=0, seed=0, round_index=1)
    return agent, rounds, sampler, kept, stats


def test_round_sampler_stops_on_enough_kept_groups_and_carries_the_rest(qwen_tokenizer, retriever) -> None:
    agent, rounds, sampler, kept, stats = first_round(qwen_tokenizer, retriever)
    assert [g.prompt_index for g in kept] == [0]  # the 0-search group was enough: the call stopped after turn 0
    assert len(rounds.carried) == 3 and stats["rollout/carried_groups"] == 3.0
    assert stats["rollout/partial_share"] == 0.0 and stats["rollout/token_staleness/1"] == 1.0
    assert stats["rollout/engine_calls"] == 1.0 and stats["rollout/carried_dropped"] == 0.0

    agent.engine.version = 2
    rounds.keep_rate_estimate = 1.0  # one prompt asked for: the three carried ones are already in flight
    kept, stats = rounds.sample_round(sampler, policy_version=2, seed=1, round_index=2)
    assert [g.prompt_index for g in kept] in ([1], [2], [3]) and rounds.carried == []
    assert stats["rollout/partial_share"] == 1.0  # finished on newer weights
    assert kept[0].trajectories[0].policy_version == 0
    shares = [stats[f"rollout/token_staleness/{age}"] for age in range(3)]
    assert stats["rollout/token_staleness_max"] == 2.0 and shares[0] > 0 and shares[2] > 0 and shares[1] == 0
    assert sum(shares) == pytest.approx(1.0)


def test_round_sampler_drops_carried_groups_older_than_the_bound(qwen_tokenizer, retriever) -> None:
    agent, rounds, sampler, _, _ = first_round(qwen_tokenizer, retriever)
    agent.engine.version = 5
    kept, stats = rounds.sample_round(sampler, policy_version=5, seed=2, round_index=5)
    assert stats["rollout/carried_dropped"] == 3.0  # their oldest tokens: 5 rounds behind > max_token_age 2
    assert kept and all(t.policy_version == 5 and not t.token_versions for g in kept for t in g.trajectories)
    assert stats["rollout/wasted_token_share"] > 0  # the dropped groups' tokens are counted as sampled


def test_partial_rollouts_need_an_agent_that_can_carry() -> None:
    class Whole:
        def rollout(self, items, group_size, policy_version, greedy=False, seed=None): ...

    spec = AlgorithmConfig(group_size=2, batch_groups=1, micro_batch_size=2)
    with pytest.raises(ValueError, match="rollout.partial_rollouts=false"):
        RoundSampler(Whole(), spec, max_token_age=2)
