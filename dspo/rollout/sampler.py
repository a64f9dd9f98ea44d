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

`sample_round` reads as its steps: `_prompts_to_ask` (over-sampling), `_call` (one engine call, full or partial),
`_judge` (the filter's verdict on the call's groups), `RoundTally.add` (the running totals, `dspo.rollout.tally`) and
the keep-rate prior's update; `RoundTally.result` gives the round's statistics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from dspo.agent.accounting import CALL_STAT_KINDS
from dspo.agent.partial import CarriedGroup, token_staleness
from dspo.algorithms.config import AlgorithmConfig
from dspo.data.rounds import PromptSampler
from dspo.rollout.roles import interleaved
from dspo.rollout.tally import EngineCall, RoundTally, ToolAndRewardStats, Verdict
from dspo.types import RolloutGroup

log = logging.getLogger(__name__)


class SamplingExhausted(RuntimeError):
    """The filter kept too few groups within `max_sampling_rounds` engine calls."""


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
        kinds = getattr(self.agent, "stat_kinds", CALL_STAT_KINDS)
        retriever = getattr(self.agent, "retriever", None)  # its waits and cache hits in this round are logged
        tally = RoundTally(self.local_target, self.spec.group_size, ToolAndRewardStats(kinds), retriever)
        while not all_done(tally.full):
            self._check_not_exhausted(tally)
            tally.calls += 1
            missing = self.local_target - len(tally.kept)
            if missing <= 0:
                continue  # this rank is full; it keeps answering the collective until every rank is
            n_prompts = self._prompts_to_ask(missing, tally)
            call = self._call(sampler, n_prompts, missing, policy_version, seed + tally.calls, round_index)
            if call.partial and not call.groups:  # every group of the call is still running: carried
                tally.add(call, None)
                continue
            verdict = self._judge(call.groups)
            tally.add(call, verdict)
            self.keep_rate_estimate = max(0.05, 0.5 * self.keep_rate_estimate + 0.5 * verdict.pass_rate)
        partial = {} if self.max_token_age is None else self._partial_stats(tally.kept, round_index, tally.dropped)
        return tally.kept, tally.result(partial)

    def _check_not_exhausted(self, tally: RoundTally) -> None:
        if tally.calls >= self.spec.max_sampling_rounds:
            raise SamplingExhausted(
                f"only {len(tally.kept)}/{self.local_target} groups passed filter '{self.spec.filter}' after "
                f"{tally.calls} engine calls ({tally.sampled} groups sampled). Raise algorithm.max_sampling_rounds, "
                "lower algorithm.batch_groups, or use a policy whose rewards are neither all 0 nor all 1 per prompt."
            )

    def _prompts_to_ask(self, missing: int, tally: RoundTally) -> int:
        """Over-sampling: the prompts the next call asks for to keep `missing` more groups at the keep-rate prior
        (bounded by algorithm.max_prompts_per_call)."""
        n_prompts = min(self.spec.max_prompts_per_call, math.ceil(missing / self.keep_rate_estimate))
        if tally.prompts and tally.sampled > tally.prompts:  # an agent of several roles returns more than one group
            rate = self.keep_rate_estimate * tally.sampled / tally.prompts  # per prompt
            n_prompts = min(self.spec.max_prompts_per_call, math.ceil(missing / rate))
        return n_prompts

    def _call(
        self, sampler: PromptSampler, n_prompts: int, missing: int, policy_version: int, seed: int, round_index: int
    ) -> EngineCall:
        """One engine call: `n_prompts` new prompts rolled out to the end, or (partial rollouts) a resumable call with
        the carried groups, after dropping those too old for `round_index`."""
        if self.max_token_age is None:
            return self._full_call(sampler, n_prompts, policy_version, seed)
        aged = self._drop_aged(round_index)
        groups, stats, generated = self._partial_call(sampler, n_prompts, missing, policy_version, seed)
        return EngineCall(groups, stats, generated, dropped=aged, partial=True)

    def _full_call(self, sampler: PromptSampler, n_prompts: int, policy_version: int, seed: int) -> EngineCall:
        drawn = sampler.take(n_prompts)
        result = self.agent.rollout([item for _, item in drawn], self.spec.group_size, policy_version, seed=seed)
        groups = interleaved(result.groups)
        for group, (index, _) in zip(result.groups, drawn):
            group.prompt_index = index
        for group in result.groups[len(drawn) :]:  # another role's, numbered by the item it was built from
            if 0 <= group.prompt_index < len(drawn):
                group.prompt_index = drawn[group.prompt_index][0]
        tokens = sum(t.num_generated_tokens for group in groups for t in group.trajectories)
        return EngineCall(groups, result.stats, tokens, prompts=len(drawn))

    def _judge(self, groups: list[RolloutGroup]) -> Verdict:
        """The filter's verdict on a call's finished groups. A failed episode (agent error, timeout) has no outcome:
        its group could pass as mixed and give the others advantages from a crash, so it is dropped before the
        filter's verdict counts."""
        rewards = torch.stack([g.rewards for g in groups])  # [n, G] what the advantages use
        keep = self.keep_filter(torch.stack([g.outcomes for g in groups]))  # Eq. 9 tests the 0/1 outcomes
        measured = torch.tensor([not g.failed for g in groups])
        return Verdict(rewards, keep & measured, failed=int((~measured).sum()))

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
                "never trained (docs/async.md#partial-rollouts)",
                groups,
                tokens,
            )
        self.carried = []
        return groups, tokens
