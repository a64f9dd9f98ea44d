"""`RoundSampler`: one rank's round of kept groups from an agent and the group filter (Algorithm 1, step 2).

(Named `RolloutEnvironment` until issue 41: "environment" now means only `dspo.env.Environment`, the tools and reward
the agent acts in.) `RoundSampler.sample_round` draws prompts, rolls out G trajectories per prompt, keeps the groups the
filter accepts (Eq. 9 for DSPO/DAPO) and repeats until B groups are kept. It over-samples: each engine call asks for
`ceil(missing / keep_rate_estimate)` prompts (bounded), so a low keep-rate costs few extra engine calls rather than many
small ones. Groups kept beyond B are dropped (they would be off-policy next round) and counted as waste.

Multi-process: each rank fills B / world_size groups; `all_done` (an all-reduce supplied by the caller) makes every
rank keep sampling until all ranks are full, so every rank takes the same number of optimizer steps.

Partial rollouts (`max_token_age` set: `rollout.partial_rollouts`, in the engine process only): an engine call stops
after the turn in which enough of its groups finished and passed the filter; the groups still running are carried
into the next call (of this round or the next), continued on the weights the engine holds then, and dropped once
their oldest tokens are more than `max_token_age` rounds old (`dspo.agent.partial`). The in-flight groups of a call
are what the over-sampling asks for, carried ones included. The age bound selects on length (the dropped groups are the
long ones), so the round logs the dropped groups' episode length beside the kept ones'; each token counts in
`rollout/generated_tokens` of the round that generated it (`CarriedGroup.counted`); `close` logs the groups still
carried when the run ends.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping

import torch

from dspo.agent.accounting import CALL_STAT_KINDS
from dspo.agent.partial import CarriedGroup, token_staleness
from dspo.agent.stats import Kind, kind_of
from dspo.algorithms.config import AlgorithmConfig
from dspo.data.rounds import PromptSampler
from dspo.rollout.roles import RoleStats, interleaved
from dspo.search.cache import cache_counts, cache_hit_rate
from dspo.types import RolloutGroup

log = logging.getLogger(__name__)


class SamplingExhausted(RuntimeError):
    """The filter kept too few groups within `max_sampling_rounds` engine calls."""


class ToolAndRewardStats:
    """The environment's per-tool and per-reward-component statistics of a round, folded over its engine calls by
    each key's declared kind (`dspo.agent.stats`, `kinds`: the agent's `stat_kinds`): counts
    (`rollout/invalid/<tool>/<kind>`, `rollout/tool_errors/<tool>`, the endpoint's `rollout/prefix_breaks` and
    `rollout/agent_errors`, `rollout/compactions`) add up, means (`rollout/calls/<tool>`, `rollout/samples_per_episode`,
    `reward/<component>`, `rollout/tool/<tool>/<metric>`) are weighted by the trajectories of the calls that
    reported them; call-only figures are left out (the round computes its own); an undeclared key is kept as a
    mean."""

    def __init__(self, kinds: Mapping[str, Kind] = CALL_STAT_KINDS) -> None:
        self.kinds = kinds
        self.sums: dict[str, float] = {}
        self.weighted: dict[str, float] = {}
        self.weights: dict[str, int] = {}

    def add(self, stats: dict[str, float], trajectories: int) -> None:
        for key, value in stats.items():
            kind = kind_of(key, self.kinds)
            if kind is Kind.SUM:
                self.sums[key] = self.sums.get(key, 0.0) + value
            elif kind is Kind.MEAN:
                self.weighted[key] = self.weighted.get(key, 0.0) + value * trajectories
                self.weights[key] = self.weights.get(key, 0) + trajectories

    def result(self) -> dict[str, float]:
        means = {key: value / max(self.weights[key], 1) for key, value in self.weighted.items()}
        named = {**self.sums, **means}
        return {(key if key.startswith("reward/") else f"rollout/{key}"): value for key, value in named.items()}


class RoundSampler:
    """Args:
    agent: the `dspo.agent.Agent` that rolls prompts out (its `AgentRollout.stats` feed the round's statistics).
    spec: the algorithm (group size, B, filter, over-sampling bounds).
    rank, world_size: this rank's share is B / world_size groups.
    max_token_age: with partial rollouts, the most rounds a carried group's oldest tokens may be behind the round
        that trains them (None: every call runs its groups to the end).
    """

    def __init__(
        self, agent, spec: AlgorithmConfig, rank: int = 0, world_size: int = 1, max_token_age: int | None = None
    ) -> None:
        spec.check_world_size(world_size)
        if max_token_age is not None and not callable(getattr(agent, "rollout_partial", None)):
            raise ValueError(
                f"rollout.partial_rollouts=true: the agent {type(agent).__name__} cannot carry episodes between "
                "calls (it has no rollout_partial; dspo.agent.tool_calling.ToolCallingAgent has). Set "
                "rollout.partial_rollouts=false"
            )
        self.agent, self.spec, self.max_token_age = agent, spec, max_token_age
        self.carried: list[CarriedGroup] = []  # groups still running when the last call stopped
        self.local_target = spec.batch_groups // world_size
        self.keep_filter = spec.group_filter
        # a filter that never drops a group needs no over-sampling: exactly the prompts that are missing
        self.keep_rate_estimate = 1.0 if self.keep_filter.keeps_everything else spec.initial_keep_rate

    def sample_round(
        self,
        sampler: PromptSampler,
        policy_version: int,
        seed: int,
        all_done: Callable[[bool], bool] = lambda done: done,
        round_index: int | None = None,
    ) -> tuple[list[RolloutGroup], dict[str, float]]:
        """Fill this rank's share of B mixed groups of round `round_index` (default: `policy_version`, the
        synchronous round) sampled by the weights of `policy_version`. Returns the groups and rollout statistics."""
        round_index = policy_version if round_index is None else round_index
        dropped: list[CarriedGroup] = []  # dropped by age in this round (partial rollouts)
        kept: list[RolloutGroup] = []
        sampled = passed = calls = tokens = kept_tokens = tool_calls = invalid = trajectories = truncated = failed = 0
        resolved_tokens = 0  # of the groups that finished or were dropped in this round: what the waste is a share of
        reward_sum = searched_reward = 0.0
        unsearched = 0  # episodes that answered without a tool call (the guard's no_search detector)
        prompts = 0  # prompts drawn by full calls (with `sampled`: the groups an agent returns per prompt)
        details = ToolAndRewardStats(getattr(self.agent, "stat_kinds", CALL_STAT_KINDS))
        roles = RoleStats()  # rollout/<role>/<stat>, logged only when the agent played a role besides the default
        retriever = getattr(self.agent, "retriever", None)
        retries_before = getattr(retriever, "retries", 0)  # RemoteRetriever's waits; in-process indexes have none
        cache_before = cache_counts(retriever)
        start = time.perf_counter()
        while not all_done(len(kept) >= self.local_target):
            if calls >= self.spec.max_sampling_rounds:
                raise SamplingExhausted(
                    f"only {len(kept)}/{self.local_target} groups passed filter '{self.spec.filter}' after "
                    f"{calls} engine calls ({sampled} groups sampled). Raise algorithm.max_sampling_rounds, lower "
                    "algorithm.batch_groups, or use a policy whose rewards are neither all 0 nor all 1 per prompt."
                )
            calls += 1
            missing = self.local_target - len(kept)
            if missing <= 0:
                continue  # this rank is full; it keeps answering the collective until every rank is
            n_prompts = min(self.spec.max_prompts_per_call, math.ceil(missing / self.keep_rate_estimate))
            if prompts and sampled > prompts:  # an agent of several roles returns more than one group per prompt
                rate = self.keep_rate_estimate * sampled / prompts
                n_prompts = min(self.spec.max_prompts_per_call, math.ceil(missing / rate))
            if self.max_token_age is None:
                drawn = sampler.take(n_prompts)
                result = self.agent.rollout(
                    [item for _, item in drawn], self.spec.group_size, policy_version, seed=seed + calls
                )
                groups, stats = interleaved(result.groups), result.stats
                for group, (index, _) in zip(result.groups, drawn):
                    group.prompt_index = index
                for group in result.groups[len(drawn) :]:  # another role's, numbered by the item it was built from
                    if 0 <= group.prompt_index < len(drawn):
                        group.prompt_index = drawn[group.prompt_index][0]
                prompts += len(drawn)
                tokens += sum(t.num_generated_tokens for group in groups for t in group.trajectories)
            else:
                aged = self._drop_aged(round_index)
                dropped += aged
                resolved_tokens += sum(group.generated_tokens for group in aged)  # wasted; counted when generated
                groups, stats, generated = self._partial_call(sampler, n_prompts, missing, policy_version, seed + calls)
                tokens += generated
                if not groups:
                    continue
            rewards = torch.stack([g.rewards for g in groups])  # [n, G] what the advantages use
            keep = self.keep_filter(torch.stack([g.outcomes for g in groups]))  # Eq. 9 tests the 0/1 outcomes
            # a failed episode (agent error, timeout) has no outcome: its group could pass as mixed and give the
            # others advantages from a crash, so it is dropped before the filter's verdict counts
            measured = torch.tensor([not g.failed for g in groups])
            failed += int((~measured).sum())
            keep = keep & measured
            for group, keep_it in zip(groups, keep.tolist()):
                n_tok = sum(t.num_generated_tokens for t in group.trajectories)
                resolved_tokens += n_tok
                taken = keep_it and len(kept) < self.local_target
                if taken:
                    kept.append(group)
                    kept_tokens += n_tok
                roles.add(group, keep_it, taken)
            tool_calls += stats.get("tool_calls_mean", 0.0) * len(groups) * self.spec.group_size
            invalid += stats.get("invalid_calls", 0.0)
            details.add(stats, len(groups) * self.spec.group_size)
            trajectories += len(groups) * self.spec.group_size
            truncated += sum(t.truncated for group in groups for t in group.trajectories)
            unsearched += sum(not t.num_tool_calls for group in groups for t in group.trajectories)
            searched_reward += sum(t.reward for group in groups for t in group.trajectories if t.num_tool_calls)
            reward_sum += float(rewards.sum())
            sampled += len(groups)
            passed += int(keep.sum())
            observed = float(keep.float().mean())
            self.keep_rate_estimate = max(0.05, 0.5 * self.keep_rate_estimate + 0.5 * observed)
        elapsed = time.perf_counter() - start
        partial = {} if self.max_token_age is None else self._partial_stats(kept, round_index, dropped)
        return kept, {
            **partial,
            "rollout/keep_rate": passed / max(sampled, 1),  # filter pass rate; surplus groups count as passed
            "rollout/groups_kept": float(len(kept)),
            "rollout/groups_sampled": float(sampled),
            "rollout/groups_failed": float(failed),  # dropped: an episode failed outside the policy (no outcome)
            "rollout/engine_calls": float(calls),
            "rollout/wasted_token_share": 1.0 - kept_tokens / max(resolved_tokens, 1),
            "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
            "rollout/tool_calls_mean": tool_calls / max(trajectories, 1),
            "rollout/invalid_calls": float(invalid),
            "rollout/sampled_reward_mean": reward_sum / max(trajectories, 1),
            # sampled episodes that ran out of turns or tokens before an answer (deep questions, experiment=toy_deep)
            "rollout/truncated_share": truncated / max(trajectories, 1),
            "rollout/no_search_share": unsearched / max(trajectories, 1),
            "rollout/searched_reward_mean": searched_reward / max(trajectories - unsearched, 1),
            # every token generated in this round, filtered-out groups included (with partial rollouts: the tokens of
            # carried groups count in the round that generated them, not in the one they finish or are dropped in)
            "rollout/generated_tokens": float(tokens),
            "rollout/time_s": elapsed,
            "rollout/retriever_retries": float(getattr(retriever, "retries", 0) - retries_before),
            **cache_hit_rate(cache_before, cache_counts(retriever)),
            **details.result(),
            **roles.result(),
        }

    # ------------------------------------------------------------------------------------------ partial rollouts
    def _drop_aged(self, round_index: int) -> list[CarriedGroup]:
        """Drop the carried groups whose oldest tokens are more than max_token_age rounds behind `round_index`, and
        return them."""
        aged = [group for group in self.carried if group.age(round_index) > self.max_token_age]
        self.carried = [group for group in self.carried if group.age(round_index) <= self.max_token_age]
        return aged

    def _partial_call(
        self, sampler: PromptSampler, n_prompts: int, missing: int, policy_version: int, seed: int
    ) -> tuple[list[RolloutGroup], dict, int]:
        """One resumable call: the carried groups and new prompts up to `n_prompts` in flight, stopped after the turn
        in which `missing` finished groups passed the filter. Returns the finished groups, the call's statistics and
        the model tokens it generated (those of the groups still carried are marked counted)."""
        drawn = sampler.take(n_prompts - len(self.carried)) if n_prompts > len(self.carried) else []
        need = missing

        def enough(done: list[RolloutGroup]) -> bool:
            nonlocal need
            need -= int(self.keep_filter(torch.stack([g.outcomes for g in done])).sum())
            return need <= 0

        counted = sum(group.counted for group in self.carried)  # each carried group either finishes or stays carried
        result = self.agent.rollout_partial(
            self.carried, list(drawn), self.spec.group_size, policy_version, seed, enough
        )
        self.carried = list(result.carried)
        for group in self.carried:
            group.counted = group.generated_tokens
        finished = sum(t.num_generated_tokens for group in result.groups for t in group.trajectories)
        return result.groups, result.stats, finished + sum(group.counted for group in self.carried) - counted

    def _partial_stats(
        self, kept: list[RolloutGroup], round_index: int, dropped: list[CarriedGroup]
    ) -> dict[str, float]:
        """rollout/partial_share (kept trajectories generated by more than one policy version), the staleness of
        their trained tokens (mean, max, and the share at each age 0..max_token_age), carried and dropped groups, and
        the episodes' lengths (model tokens) of the kept and the dropped groups: the age bound drops the longest."""
        trajectories = [t for g in kept for t in g.trajectories]
        ages = token_staleness(kept, round_index)
        stats = {
            "rollout/partial_share": sum(bool(t.token_versions) for t in trajectories) / max(len(trajectories), 1),
            "rollout/carried_groups": float(len(self.carried)),
            "rollout/carried_dropped": float(len(dropped)),
            "rollout/token_staleness_mean": sum(ages) / max(len(ages), 1),
            "rollout/token_staleness_max": float(max(ages, default=0)),
            "rollout/kept_len_mean": sum(t.num_generated_tokens for t in trajectories) / max(len(trajectories), 1),
        }
        if dropped:  # a mean over no episode would read as length 0
            lengths = [n for group in dropped for n in group.episode_tokens()]
            stats["rollout/dropped_len_mean"] = sum(lengths) / len(lengths)
        for age in range(self.max_token_age + 1):
            stats[f"rollout/token_staleness/{age}"] = ages.count(age) / max(len(ages), 1)
        return stats

    def close(self) -> tuple[int, int]:
        """The run is over: the groups still carried are never trained. Logs how many there are and the model tokens
        they had (a warning, when there are any), and returns both."""
        groups, tokens = len(self.carried), sum(group.generated_tokens for group in self.carried)
        if groups:
            log.warning(
                "partial rollouts: %d groups (%d generated tokens) were still carried when the run ended; they are "
                "never trained (docs/training.md#partial-rollouts)",
                groups,
                tokens,
            )
        self.carried = []
        return groups, tokens
