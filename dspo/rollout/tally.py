"""A round's statistics, counted call by call (`dspo.rollout.sampler.RoundSampler.sample_round`).

A round is a series of engine calls. Each call hands the tally what it generated (`EngineCall`: its finished groups,
the agent's statistics, the model tokens, the prompts drawn, the carried groups dropped by age before it) and, when it
finished any group, the filter's verdict on them (`Verdict`); `RoundTally.result` turns the running totals into the
round's `rollout/*` statistics. The per-tool and per-reward-component figures fold by their declared kind
(`ToolAndRewardStats`), the per-role ones by role (`dspo.rollout.roles.RoleStats`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dspo.agent.accounting import CALL_STAT_KINDS
from dspo.agent.partial import CarriedGroup
from dspo.agent.stats import Kind, kind_of
from dspo.rollout.roles import RoleStats
from dspo.search.cache import cache_counts, cache_hit_rate
from dspo.types import RolloutGroup


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


@dataclass(frozen=True)
class EngineCall:
    """One engine call of a round, full or partial (`rollout.partial_rollouts`)."""

    groups: list[RolloutGroup]  # [n] the groups it finished, interleaved by role (`dspo.rollout.roles.interleaved`)
    stats: dict[str, float]  # the agent's statistics of the call (`AgentRollout.stats`)
    tokens: int  # model tokens it generated, those of groups it leaves carried included (counted once, when generated)
    prompts: int = 0  # prompts it drew (full calls; a partial call asks for groups in flight, carried ones included)
    dropped: list[CarriedGroup] = field(default_factory=list)  # carried groups dropped by age before it (partial)
    partial: bool = False  # a resumable call: it may finish no group at all (they all stay carried)


@dataclass(frozen=True)
class Verdict:
    """The filter's verdict on one call's finished groups."""

    rewards: torch.Tensor  # [n, G] the rewards the advantages use
    kept: torch.Tensor  # [n] bool: passed the filter (Eq. 9 tests the 0/1 outcomes) and no episode of it failed
    failed: int  # groups with a failed episode (agent error, timeout): no outcome, so dropped whatever the filter says

    @property
    def pass_rate(self) -> float:
        """The share of the call's groups that passed (the keep-rate prior's observation)."""
        return float(self.kept.float().mean())


@dataclass
class RoundTally:
    """The running totals of one round's engine calls (`add` each call), and the round's statistics (`result`)."""

    target: int  # groups this rank keeps: its share of B
    group_size: int  # G trajectories per group
    details: ToolAndRewardStats
    retriever: Any = None  # the agent's retriever: its waits and cache hits during the round are logged
    kept: list[RolloutGroup] = field(default_factory=list)  # [<= target] the groups the round trains, in order taken
    dropped: list[CarriedGroup] = field(default_factory=list)  # dropped by age in this round (partial rollouts)
    calls: int = 0  # engine calls, those of a rank that is full and waits for the others included
    prompts: int = 0  # prompts drawn by full calls (with `sampled`: the groups an agent returns per prompt)
    sampled: int = 0  # groups the calls finished
    passed: int = 0  # of them, groups the filter accepted (the surplus beyond B included)
    failed: int = 0  # of them, groups with a failed episode
    trajectories: int = 0
    truncated: int = 0  # episodes that ran out of turns or tokens before an answer
    unsearched: int = 0  # episodes that answered without a tool call (the guard's no_search detector)
    tokens: int = 0  # every model token generated in this round, filtered-out groups included
    kept_tokens: int = 0
    resolved_tokens: int = 0  # of the groups that finished or were dropped in this round: what the waste is a share of
    tool_calls: float = 0.0
    invalid: float = 0.0
    reward_sum: float = 0.0
    searched_reward: float = 0.0  # reward of the episodes that made a tool call
    roles: RoleStats = field(default_factory=RoleStats)  # rollout/<role>/<stat>, when an agent played several roles
    retries_before: int = 0  # the retriever's waits before the round (RemoteRetriever's; in-process indexes have none)
    cache_before: Any = None  # its cache counts before the round
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.retries_before = getattr(self.retriever, "retries", 0)
        self.cache_before = cache_counts(self.retriever)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target

    def add(self, call: EngineCall, verdict: Verdict | None) -> None:
        """One engine call: what it generated, and the filter's verdict on the groups it finished (None: none)."""
        self.dropped += call.dropped
        self.resolved_tokens += sum(group.generated_tokens for group in call.dropped)  # wasted; counted when generated
        self.tokens += call.tokens
        self.prompts += call.prompts
        if verdict is not None:
            self._judged(call.groups, call.stats, verdict)

    def _judged(self, groups: list[RolloutGroup], stats: dict[str, float], verdict: Verdict) -> None:
        self.failed += verdict.failed
        for group, keep_it in zip(groups, verdict.kept.tolist()):
            n_tok = sum(t.num_generated_tokens for t in group.trajectories)
            self.resolved_tokens += n_tok
            taken = keep_it and len(self.kept) < self.target
            if taken:
                self.kept.append(group)
                self.kept_tokens += n_tok
            self.roles.add(group, keep_it, taken)
        trajectories = len(groups) * self.group_size
        self.tool_calls += stats.get("tool_calls_mean", 0.0) * len(groups) * self.group_size
        self.invalid += stats.get("invalid_calls", 0.0)
        self.details.add(stats, trajectories)
        self.trajectories += trajectories
        self.truncated += sum(t.truncated for group in groups for t in group.trajectories)
        self.unsearched += sum(not t.num_tool_calls for group in groups for t in group.trajectories)
        self.searched_reward += sum(t.reward for group in groups for t in group.trajectories if t.num_tool_calls)
        self.reward_sum += float(verdict.rewards.sum())
        self.sampled += len(groups)
        self.passed += int(verdict.kept.sum())

    def result(self, partial: dict[str, float]) -> dict[str, float]:
        """The round's statistics (`partial`: the partial-rollout figures, first; empty without them)."""
        elapsed = time.perf_counter() - self.started
        trajectories = max(self.trajectories, 1)
        return {
            **partial,
            "rollout/keep_rate": self.passed / max(self.sampled, 1),  # filter pass rate; surplus groups count as passed
            "rollout/groups_kept": float(len(self.kept)),
            "rollout/groups_sampled": float(self.sampled),
            "rollout/groups_failed": float(self.failed),  # dropped: an episode failed outside the policy (no outcome)
            "rollout/engine_calls": float(self.calls),
            "rollout/wasted_token_share": 1.0 - self.kept_tokens / max(self.resolved_tokens, 1),
            "rollout/tokens_per_s": self.tokens / max(elapsed, 1e-9),
            "rollout/tool_calls_mean": self.tool_calls / trajectories,
            "rollout/invalid_calls": float(self.invalid),
            "rollout/sampled_reward_mean": self.reward_sum / trajectories,
            # sampled episodes that ran out of turns or tokens before an answer (deep questions, experiment=toy_deep)
            "rollout/truncated_share": self.truncated / trajectories,
            "rollout/no_search_share": self.unsearched / trajectories,
            "rollout/searched_reward_mean": self.searched_reward / max(self.trajectories - self.unsearched, 1),
            # every token generated in this round, filtered-out groups included (with partial rollouts: the tokens of
            # carried groups count in the round that generated them, not in the one they finish or are dropped in)
            "rollout/generated_tokens": float(self.tokens),
            "rollout/time_s": elapsed,
            "rollout/retriever_retries": float(getattr(self.retriever, "retries", 0) - self.retries_before),
            **cache_hit_rate(self.cache_before, cache_counts(self.retriever)),
            **self.details.result(),
            **self.roles.result(),
        }
