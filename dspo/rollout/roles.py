"""A round's groups by role (`RolloutGroup.role`): the order a call's groups are kept in, and `rollout/<role>/<stat>`.

An agent that plays several roles in one call (`dspo.agent.roles`) returns groups of each; the round treats them as any
groups (one filter, one B, one advantage per group) and adds, per role, what it measured of that role's groups. A
round that saw only the default role (every un-roled agent) logs nothing more: its statistics stay what they were.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspo.types import DEFAULT_ROLE, RolloutGroup


def interleaved(groups: list[RolloutGroup]) -> list[RolloutGroup]:
    """`groups` taken round-robin by role (each role's in its own order; roles in order of first appearance), so that
    the last call of a round, which fills the B groups it still misses and drops the surplus, does not keep only the
    role an agent returns first. One role: `groups` itself, unchanged."""
    by_role: dict[str, list[RolloutGroup]] = {}
    for group in groups:
        by_role.setdefault(group.role, []).append(group)
    if len(by_role) <= 1:
        return groups
    queues, out = list(by_role.values()), []
    for position in range(max(len(queue) for queue in queues)):
        out.extend(queue[position] for queue in queues if position < len(queue))
    return out


@dataclass
class _Tally:
    sampled: int = 0  # groups the agent returned
    passed: int = 0  # of them, groups the filter accepted
    kept: int = 0  # of them, groups the round trained (the filter's, up to B)
    trajectories: int = 0
    reward: float = 0.0  # what the advantages use
    outcome: float = 0.0  # what the filter tests
    tool_calls: int = 0
    truncated: int = 0
    unsearched: int = 0
    tokens: int = 0  # generated tokens, filtered groups included


class RoleStats:
    """Per-role figures of one round's sampled groups (`add` each group once, after the filter's verdict)."""

    def __init__(self) -> None:
        self.tallies: dict[str, _Tally] = {}

    def add(self, group: RolloutGroup, passed: bool, kept: bool) -> None:
        tally = self.tallies.setdefault(group.role, _Tally())
        trajectories = group.trajectories
        tally.sampled += 1
        tally.passed += bool(passed)
        tally.kept += bool(kept)
        tally.trajectories += len(trajectories)
        tally.reward += sum(t.reward for t in trajectories)
        tally.outcome += sum(float(t.outcome) for t in trajectories)
        tally.tool_calls += sum(t.num_tool_calls for t in trajectories)
        tally.truncated += sum(t.truncated for t in trajectories)
        tally.unsearched += sum(not t.num_tool_calls for t in trajectories)
        tally.tokens += sum(t.num_generated_tokens for t in trajectories)

    def result(self) -> dict[str, float]:
        """`rollout/<role>/<stat>` for every role seen, or nothing when the default role is the only one."""
        if set(self.tallies) <= {DEFAULT_ROLE}:
            return {}
        stats: dict[str, float] = {}
        for role, tally in sorted(self.tallies.items()):
            n = max(tally.trajectories, 1)
            figures = {
                "groups_sampled": float(tally.sampled),
                "groups_kept": float(tally.kept),
                "keep_rate": tally.passed / max(tally.sampled, 1),
                "sampled_reward_mean": tally.reward / n,
                "outcome_mean": tally.outcome / n,
                "tool_calls_mean": tally.tool_calls / n,
                "truncated_share": tally.truncated / n,
                "no_search_share": tally.unsearched / n,
                "generated_tokens": float(tally.tokens),
            }
            stats.update({f"rollout/{role}/{name}": value for name, value in figures.items()})
        return stats
