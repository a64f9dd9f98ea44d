import logging
import math

import pytest

from dspo.agent import AgentRollout
from dspo.agent.stats import Kind
from dspo.algorithms.config import AlgorithmConfig
from dspo.data.datamodule import PromptSampler
from dspo.rollout.sampler import RoundSampler, SamplingExhausted
from dspo.types import QAItem, RolloutGroup, Trajectory

ITEMS = [QAItem(id=str(i), question=f"q{i}", golden_answers=["a"]) for i in range(50)]


class FakeAgent:
    """Rewards by prompt id: multiples of 3 -> mixed, others -> all equal (so the filter keeps one third)."""

    def __init__(self):
        self.calls, self.seeds, self.ids = [], [], []
        self.stats = {"tool_calls_mean": 1.0, "invalid_calls": 0.0}

    def rollout(self, items, group_size, policy_version, greedy=False, seed=None):
        self.calls.append(len(items))
        self.seeds.append(seed)
        self.ids.extend(int(item.id) for item in items)
        groups = []
        for item in items:
            mixed = int(item.id) % 3 == 0
            rewards = [float(j % 2) if mixed else 1.0 for j in range(group_size)]
            trajectories = [
                Trajectory([1], [2, 3], [1, 1], [0.0, 0.0], reward=r, policy_version=policy_version) for r in rewards
            ]
            groups.append(RolloutGroup(item=item, trajectories=trajectories))
        return AgentRollout(groups, dict(self.stats))


def test_fills_b_mixed_groups_with_oversampling_and_tags_version():
    agent = FakeAgent()
    env = RoundSampler(agent, AlgorithmConfig(group_size=4, batch_groups=4))
    groups, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=7, seed=0)
    assert len(groups) == 4
    assert all(0 < float(g.rewards.sum()) < 4 for g in groups)
    assert all(g.policy_version == 7 for g in groups)
    assert all(int(g.item.id) % 3 == 0 and g.prompt_index == int(g.item.id) for g in groups)
    assert agent.calls[0] == 8  # 4 missing / prior keep-rate 0.5
    assert 0 < stats["rollout/keep_rate"] <= 1 and stats["rollout/groups_sampled"] == sum(agent.calls)
    assert stats["rollout/wasted_token_share"] > 0


def test_truncated_share_counts_sampled_episodes_that_ran_out_of_turns_or_tokens():
    class CutAgent(FakeAgent):
        def rollout(self, items, group_size, policy_version, greedy=False, seed=None):
            result = super().rollout(items, group_size, policy_version, greedy, seed)
            for group in result.groups:
                group.trajectories[0].truncated = True  # one episode of each group
            return result

    env = RoundSampler(CutAgent(), AlgorithmConfig(group_size=4, batch_groups=2, filter="none"))
    _, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=0)
    assert stats["rollout/truncated_share"] == 0.25
    _, plain = RoundSampler(FakeAgent(), AlgorithmConfig(group_size=4, batch_groups=2, filter="none")).sample_round(
        PromptSampler(ITEMS, seed=0), policy_version=0, seed=0
    )
    assert plain["rollout/truncated_share"] == 0.0


def test_no_filter_keeps_first_b_groups():
    env = RoundSampler(FakeAgent(), AlgorithmConfig(group_size=2, batch_groups=3, filter="none"))
    groups, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=0)
    assert len(groups) == 3 and stats["rollout/engine_calls"] == 1


def test_gives_up_with_a_clear_error():
    items = [QAItem(id="1", question="q", golden_answers=["a"])]  # never mixed
    env = RoundSampler(FakeAgent(), AlgorithmConfig(group_size=2, batch_groups=2, max_sampling_rounds=3))
    with pytest.raises(SamplingExhausted, match="max_sampling_rounds"):
        env.sample_round(PromptSampler(items, seed=0), policy_version=0, seed=0)


def test_ranks_share_b_and_config_errors_name_keys():
    with pytest.raises(ValueError, match="batch_groups=3 must be divisible"):
        RoundSampler(FakeAgent(), AlgorithmConfig(group_size=2, batch_groups=3), rank=0, world_size=2)
    for bad, key in [
        ({"group_size": 1}, "group_size"),
        ({"num_minibatches": 3}, "num_minibatches"),
        ({"loss": "ppo"}, "loss"),
        ({"filter": "x"}, "filter"),
    ]:
        with pytest.raises(ValueError, match=f"algorithm.{key}"):
            AlgorithmConfig(**bad)


def test_keep_rate_is_the_filter_pass_rate_and_updates_the_estimate():
    """Issue 20 (7): keep_rate counts every group that passed the filter, also the surplus beyond B."""
    agent = FakeAgent()
    env = RoundSampler(agent, AlgorithmConfig(group_size=2, batch_groups=1, initial_keep_rate=0.05))
    groups, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=10)
    assert agent.calls == [20] and len(groups) == 1  # ceil(1 / 0.05) prompts in one call
    passed = sum(i % 3 == 0 for i in agent.ids)
    assert passed > 1
    assert stats["rollout/keep_rate"] == pytest.approx(passed / 20) and stats["rollout/groups_kept"] == 1.0
    assert env.keep_rate_estimate == pytest.approx(0.5 * 0.05 + 0.5 * passed / 20)
    assert agent.seeds == [11]
    estimate = env.keep_rate_estimate
    env.sample_round(PromptSampler(ITEMS, seed=1), policy_version=1, seed=10)
    assert agent.calls[1] == math.ceil(1 / estimate) < 20  # the updated estimate is used


def test_each_engine_call_gets_its_own_seed():
    agent = FakeAgent()
    env = RoundSampler(agent, AlgorithmConfig(group_size=2, batch_groups=4, max_prompts_per_call=2))
    env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=100)
    assert len(agent.seeds) >= 3 and agent.seeds == [100 + k for k in range(1, len(agent.seeds) + 1)]


def test_a_rank_fills_its_share_and_waits_for_the_others():
    """World size 2: this rank fills B/2 groups, then answers the collective without sampling until all are full."""
    agent = FakeAgent()
    env = RoundSampler(agent, AlgorithmConfig(group_size=2, batch_groups=4), rank=1, world_size=2)
    decisions = []

    def all_done(done: bool) -> bool:  # the other rank needs two more collectives after this one is full
        decisions.append(done)
        return sum(decisions) >= 3

    groups, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=0, all_done=all_done)
    assert len(groups) == 2 and decisions[-3:] == [True, True, True] and decisions.count(True) == 3
    assert stats["rollout/engine_calls"] == len(decisions) - 1 and len(agent.calls) == decisions.count(False)


def test_per_rank_split_is_validated_when_built():
    """Issue 20 (6): (B/W)·G must be divisible by M, checked before any round is sampled."""
    spec = AlgorithmConfig(group_size=3, batch_groups=4, num_minibatches=4)  # B*G = 12: fine on one process
    spec.check_world_size(1)
    with pytest.raises(ValueError, match="algorithm.num_minibatches=4.*trainer.devices.*algorithm.group_size = 6"):
        spec.check_world_size(2)
    with pytest.raises(ValueError, match="algorithm.num_minibatches"):
        RoundSampler(FakeAgent(), spec, rank=0, world_size=2)
    with pytest.raises(ValueError, match="algorithm.batch_groups=4"):
        spec.check_world_size(3)


class StatsAgent(FakeAgent):
    """Reports per-call search/invalid stats and a retriever whose retry counter moves by 3 per call."""

    def __init__(self, with_retriever: bool = True):
        super().__init__()
        if with_retriever:
            self.retriever = type("Retriever", (), {"retries": 7})()

    def rollout(self, items, group_size, policy_version, greedy=False, seed=None):
        self.stats = {"tool_calls_mean": float(len(items)), "invalid_calls": 2.0}
        if hasattr(self, "retriever"):
            self.retriever.retries += 3
        return super().rollout(items, group_size, policy_version, greedy, seed)


def test_rollout_statistics_are_exact():
    """Several engine calls (at most 3 prompts each): every logged statistic recomputed from what the agent did."""
    agent, group_size, target = StatsAgent(), 4, 3
    spec = AlgorithmConfig(group_size=group_size, batch_groups=target, max_prompts_per_call=3)
    groups, stats = RoundSampler(agent, spec).sample_round(PromptSampler(ITEMS, seed=0), 0, seed=0)
    calls, ids = agent.calls, agent.ids
    assert len(calls) >= 2 and stats["rollout/engine_calls"] == len(calls)
    passed = [i for i in ids if i % 3 == 0]
    assert [int(g.item.id) for g in groups] == passed[:target]
    sampled, trajectories = len(ids), len(ids) * group_size
    assert stats["rollout/groups_sampled"] == sampled and stats["rollout/groups_kept"] == target
    assert stats["rollout/keep_rate"] == pytest.approx(len(passed) / sampled)
    assert stats["rollout/wasted_token_share"] == pytest.approx(1 - target / sampled)  # 2 tokens per trajectory
    assert stats["rollout/generated_tokens"] == 2 * trajectories  # filtered-out groups count: they cost compute
    assert stats["rollout/tool_calls_mean"] == pytest.approx(sum(n * n for n in calls) / sum(calls))
    assert stats["rollout/invalid_calls"] == 2.0 * len(calls)
    rewards = sum(group_size / 2 if i % 3 == 0 else group_size for i in ids)
    assert stats["rollout/sampled_reward_mean"] == pytest.approx(rewards / trajectories)
    assert 0 < stats["rollout/time_s"] < 60
    assert stats["rollout/tokens_per_s"] == pytest.approx(2 * trajectories / stats["rollout/time_s"])
    assert stats["rollout/retriever_retries"] == 3 * len(calls)
    _, plain = RoundSampler(StatsAgent(with_retriever=False), spec).sample_round(PromptSampler(ITEMS), 0, 0)
    assert plain["rollout/retriever_retries"] == 0.0


def test_a_filter_that_keeps_everything_needs_no_over_sampling():
    agent = FakeAgent()
    env = RoundSampler(agent, AlgorithmConfig(group_size=2, batch_groups=1, filter="none"))
    _, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=0)
    assert agent.calls == [1] and stats["rollout/keep_rate"] == 1.0


def test_sampling_gives_up_after_exactly_max_sampling_rounds_calls():
    agent, items = FakeAgent(), [QAItem(id="1", question="q", golden_answers=["a"])]  # never mixed
    env = RoundSampler(agent, AlgorithmConfig(group_size=2, batch_groups=2, max_sampling_rounds=3))
    with pytest.raises(SamplingExhausted) as err:
        env.sample_round(PromptSampler(items, seed=0), policy_version=0, seed=0)
    assert len(agent.calls) == 3
    assert str(err.value).endswith(
        "Raise algorithm.max_sampling_rounds, lower algorithm.batch_groups, or use a policy whose rewards are neither "
        "all 0 nor all 1 per prompt."
    )


def test_an_agent_without_search_stats_counts_zero():
    agent = FakeAgent()
    agent.stats = {}
    env = RoundSampler(agent, AlgorithmConfig(group_size=2, batch_groups=1, filter="none"))
    _, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=0)
    assert stats["rollout/tool_calls_mean"] == 0.0 and stats["rollout/invalid_calls"] == 0.0


def test_logs_the_retriever_waits_of_each_round():
    class WaitingRetriever:  # RemoteRetriever's counter: waits so far, over the retriever's life
        retries = 5

    class Agent(FakeAgent):
        retriever = WaitingRetriever()

        def rollout(self, *args, **kwargs):
            self.retriever.retries += 2
            return super().rollout(*args, **kwargs)

    env = RoundSampler(Agent(), AlgorithmConfig(group_size=2, batch_groups=3, filter="none"))
    _, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=0)
    assert stats["rollout/retriever_retries"] == 2.0  # this round's, not the 7 since the start
    _, in_process = RoundSampler(FakeAgent(), env.spec).sample_round(PromptSampler(ITEMS, seed=0), 0, 0)
    assert in_process["rollout/retriever_retries"] == 0.0  # an in-process index has no retriever.retries


class ShapedAgent(FakeAgent):
    """Every trajectory gets a continuous shaping term (e.g. a retrieval cost), so every group's totals differ; only
    prompts whose id is a multiple of 3 have mixed 0/1 outcomes."""

    def rollout(self, items, group_size, policy_version, greedy=False, seed=None):
        result = super().rollout(items, group_size, policy_version, greedy, seed)
        for group in result.groups:
            for j, t in enumerate(group.trajectories):
                t.outcome, t.reward = t.reward, t.reward + 0.01 * (j + 1)  # outcome + shaping
        return result


def test_the_filter_tests_the_outcome_not_the_shaped_total():
    """Issue 27: a continuous shaping term would make every group look mixed and switch the dynamic filter off
    without a word; the filter reads the 0/1 outcomes, the advantages the totals."""
    agent = ShapedAgent()
    env = RoundSampler(agent, AlgorithmConfig(group_size=4, batch_groups=4))
    groups, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=0)
    assert all(int(g.item.id) % 3 == 0 for g in groups)  # only the groups with mixed outcomes were kept
    assert stats["rollout/keep_rate"] < 0.5  # a filter on the totals would have passed every group (keep-rate 1)
    assert all(len(set(g.rewards.tolist())) == 4 for g in groups) and all(
        set(g.outcomes.tolist()) == {0.0, 1.0} for g in groups
    )


def test_tool_and_reward_statistics_add_up_over_engine_calls():
    from dspo.rollout.tally import ToolAndRewardStats

    stats = ToolAndRewardStats()
    stats.add(
        {"invalid/search/empty_query": 2.0, "calls/search": 1.0, "reward/subem": 0.5, "tool/search/noise": 0.2}, 10
    )
    stats.add(
        {"invalid/search/empty_query": 1.0, "tool_errors/search": 1.0, "calls/search": 2.0, "reward/subem": 1.0}, 30
    )
    assert stats.result() == pytest.approx(
        {
            "rollout/invalid/search/empty_query": 3.0,  # counts add up
            "rollout/tool_errors/search": 1.0,
            "rollout/calls/search": (10 * 1.0 + 30 * 2.0) / 40,  # per-trajectory means, weighted by trajectories
            "reward/subem": (10 * 0.5 + 30 * 1.0) / 40,
            "rollout/tool/search/noise": 0.2,  # reported by the first call only: its mean, not diluted
        }
    )


@pytest.mark.parametrize("reason", ["agent_error", "agent_timeout"])
def test_a_group_with_a_failed_episode_is_dropped_before_the_filter(reason):
    """Issue 52 (5): an all-correct group of 5 whose fifth episode crashed (a masked stub, outcome 0) looked mixed, and
    its 4 successes got +0.447 each from the crash. A failed episode has no outcome: its group is dropped (counted),
    the round is filled with groups whose outcomes were all measured."""

    class CrashingAgent(FakeAgent):
        def rollout(self, items, group_size, policy_version, greedy=False, seed=None):
            result = super().rollout(items, group_size, policy_version, greedy, seed)
            for group in result.groups:
                if int(group.item.id) % 2 == 0:  # all-correct groups (not multiples of 3) turn "mixed" by a crash
                    stub = Trajectory([1], [], [], [], reward=0.0, outcome=0.0, truncated=True, stop_reason=reason)
                    group.trajectories[-1] = stub
            return result

    agent = CrashingAgent()
    env = RoundSampler(agent, AlgorithmConfig(group_size=5, batch_groups=4))
    groups, stats = env.sample_round(PromptSampler(ITEMS, seed=0), policy_version=0, seed=0)
    assert len(groups) == 4 and not any(g.failed for g in groups)
    assert all(int(g.item.id) % 3 == 0 and int(g.item.id) % 2 == 1 for g in groups)  # mixed by their outcomes alone
    assert stats["rollout/groups_failed"] == sum(int(i) % 2 == 0 for i in map(str, agent.ids))
    assert stats["rollout/groups_failed"] > 0


def test_stop_reasons_are_named_and_only_failures_count_as_failed():
    from dspo.types import FAILED_STOP_REASONS, STOP_REASONS

    assert set(STOP_REASONS) > FAILED_STOP_REASONS
    for reason in STOP_REASONS:
        assert Trajectory([1], [2], [1], [0.0], stop_reason=reason).failed == (reason in FAILED_STOP_REASONS)


def test_a_statistic_of_no_declared_kind_is_kept_as_a_mean_and_warned_about(caplog):
    """Issue 52 (8): kinds are declared by the code that produces the statistic; a key no table declares is logged
    (as a per-trajectory mean) with a warning naming it, never dropped."""
    from dspo.rollout.tally import ToolAndRewardStats

    stats = ToolAndRewardStats()
    with caplog.at_level(logging.WARNING, logger="dspo.agent.stats"):
        stats.add({"undeclared_metric": 1.0, "generation_s": 9.0, "calls/search": 1.0}, 10)
        stats.add({"undeclared_metric": 4.0}, 30)
    assert stats.result() == pytest.approx(
        {"rollout/undeclared_metric": (10 * 1.0 + 30 * 4.0) / 40, "rollout/calls/search": 1.0}
    )  # generation_s is a call-only figure: the round has its own rollout/time_s
    assert "'undeclared_metric' has no declared kind" in caplog.text and "stat_kinds" in caplog.text
    assert "generation_s" not in caplog.text


def test_an_agent_declares_the_kinds_of_its_own_statistics():
    class CountingAgent(FakeAgent):
        stat_kinds = {"searches_refused": Kind.SUM, "depth/": Kind.MEAN}

        def rollout(self, items, group_size, policy_version, greedy=False, seed=None):
            self.stats = {"searches_refused": 2.0, "depth/max": float(len(self.calls))}
            return super().rollout(items, group_size, policy_version, greedy, seed)

    agent = CountingAgent()
    spec = AlgorithmConfig(group_size=2, batch_groups=2, filter="none", max_prompts_per_call=1)
    _, stats = RoundSampler(agent, spec).sample_round(PromptSampler(ITEMS, seed=0), 0, seed=0)
    assert agent.calls == [1, 1]
    assert stats["rollout/searches_refused"] == 4.0 and stats["rollout/depth/max"] == 0.5  # calls 0 and 1, equal weight
