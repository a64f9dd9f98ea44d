"""Partial rollouts (issue 43 point 3, `dspo.agent.partial`): a resumable call of the tool-calling agent stops after
the turn `stop` asks for, carries the unfinished groups, and finishes them on newer weights with each token's version
and engine logprob kept; RoundSampler's carrying, age bound and statistics, by hand."""

from __future__ import annotations

import json
import logging

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


def model_tokens(group) -> list[int]:
    """A carried group's model tokens so far, per episode."""
    return [sum(ep.mask) for ep in group.episodes]


def spy_on(agent) -> tuple[list[float], list[RolloutGroup]]:
    """From now on, per resumable call: the tokens the engine generated (the agent's count), the groups that
    finished (kept or not)."""
    by_engine: list[float] = []
    finished: list[RolloutGroup] = []
    call = agent.rollout_partial

    def counting(*args, **kwargs):
        result = call(*args, **kwargs)
        by_engine.append(result.stats["generated_tokens"])
        finished.extend(result.groups)
        return result

    agent.rollout_partial = counting
    return by_engine, finished


def test_each_generated_token_counts_in_the_round_that_generated_it(qwen_tokenizer, retriever) -> None:
    """Issue 52 (6): rollout/generated_tokens (and tokens_per_s) credit a carried group's tokens to the rounds that
    generated them, not to the round it finishes in; over the rounds every token counts once, as the engine made it."""
    agent, rounds, sampler, kept, first = first_round(qwen_tokenizer, retriever)
    carried_then = sum(sum(model_tokens(group)) for group in rounds.carried)
    assert carried_then > 0  # their first turn was generated in round 1
    finished = sum(t.num_generated_tokens for g in kept for t in g.trajectories)
    assert first["rollout/generated_tokens"] == finished + carried_then
    assert first["rollout/tokens_per_s"] == pytest.approx(first["rollout/generated_tokens"] / first["rollout/time_s"])
    by_engine, finished_in_calls = spy_on(agent)
    agent.engine.version = 2
    rounds.keep_rate_estimate = 1.0
    _, second = rounds.sample_round(sampler, policy_version=2, seed=1, round_index=2)
    assert second["rollout/generated_tokens"] == sum(by_engine)  # no turn was cut: what the engine generated
    now = sum(t.num_generated_tokens for g in finished_in_calls for t in g.trajectories)
    now += sum(sum(model_tokens(group)) for group in rounds.carried)
    assert second["rollout/generated_tokens"] == now - carried_then  # round 1's turns are not counted again
    rate = second["rollout/generated_tokens"] / second["rollout/time_s"]
    assert second["rollout/tokens_per_s"] == pytest.approx(rate)


def test_dropped_groups_are_logged_with_their_length_against_the_kept_ones(qwen_tokenizer, retriever) -> None:
    """Issue 52 (6): the age bound drops the groups that are still running, the long ones: rollout/dropped_len_mean
    against rollout/kept_len_mean (model tokens per episode); their tokens were counted in the round that made them."""
    agent, rounds, sampler, kept, first = first_round(qwen_tokenizer, retriever)
    assert "rollout/dropped_len_mean" not in first  # nothing dropped: no mean over no episode
    assert first["rollout/kept_len_mean"] == sum(t.num_generated_tokens for t in kept[0].trajectories) / 2
    lengths = [n for group in rounds.carried for n in model_tokens(group)]
    by_engine, finished = spy_on(agent)
    agent.engine.version = 5
    kept, stats = rounds.sample_round(sampler, policy_version=5, seed=2, round_index=5)
    assert stats["rollout/carried_dropped"] == 3.0
    assert stats["rollout/dropped_len_mean"] == sum(lengths) / 6
    trajectories = [t for g in kept for t in g.trajectories]
    assert stats["rollout/kept_len_mean"] == sum(t.num_generated_tokens for t in trajectories) / len(trajectories)
    assert stats["rollout/generated_tokens"] == sum(by_engine)  # the dropped groups' round-1 tokens are not in it
    resolved = sum(lengths) + sum(t.num_generated_tokens for g in finished for t in g.trajectories)
    waste = 1 - sum(t.num_generated_tokens for t in trajectories) / resolved
    assert stats["rollout/wasted_token_share"] == pytest.approx(waste)  # of the groups resolved in this round


def test_the_groups_still_carried_at_the_end_are_counted(qwen_tokenizer, retriever, caplog) -> None:
    """Issue 52 (6): the engine process closes its sampler when it stops: the carried groups, never trained, are
    logged with their tokens."""
    _, rounds, _, _, _ = first_round(qwen_tokenizer, retriever)
    tokens = sum(sum(model_tokens(group)) for group in rounds.carried)
    with caplog.at_level(logging.WARNING, logger="dspo.rollout.sampler"):
        assert rounds.close() == (3, tokens)
    assert f"3 groups ({tokens} generated tokens) were still carried when the run ended" in caplog.text
    assert rounds.carried == [] and rounds.close() == (0, 0)


def test_partial_rollouts_need_an_agent_that_can_carry() -> None:
    class Whole:
        def rollout(self, items, group_size, policy_version, greedy=False, seed=None): ...

    spec = AlgorithmConfig(group_size=2, batch_groups=1, micro_batch_size=2)
    with pytest.raises(ValueError, match="rollout.partial_rollouts=false"):
        RoundSampler(Whole(), spec, max_token_age=2)
