"""Roles in a round: one agent call that plays several roles, each with its own prompts, reward and statistics.

Search self-play (a proposer writes questions a solver then answers), Multi-Agent Evolve (proposer, solver, judge), a
planner over a frozen answerer: one policy, several roles in the same round, where a later role's prompts are built from
an earlier role's episodes and one role's reward may depend on another's outcomes. `RoleAgent` is that shape as an
agent plug-in (`rollout.agent._target_: dspo.agent.roles.RoleAgent`, built by `build_agent` like any other): the
trainer, the filter, the advantages, the rollout correction and rounds ahead (k >= 1) see groups, as always.

One call: the first role plays the round's items; each later role plays the items its `derive` builds from the parts
played so far (each built item names the episode it came from, `origin`); then `settle` may rewrite rewards across
roles (`FailureRateReward`: a proposer paid by how often the solver failed on its question). Every group is tagged with
its role (`RolloutGroup.role`), and the round logs `rollout/<role>/<stat>` beside the un-roled figures
(`dspo.rollout.roles`).

What a call returns: the first role's groups in `items` order (group i is item i's: the sampler numbers them), then each
later role's, numbered (`prompt_index`) by the round item their origin descends from. Every group has `group_size`
trajectories (one filter over all). Statistics: each role's call statistics prefixed `<role>/` (counts and means, by
its agent's kinds; call-only figures are left to the round, which computes per-role ones from the groups), the
un-prefixed ones merged over the roles by their kinds, and `settle`'s own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dspo.agent.accounting import CALL_STAT_KINDS
from dspo.agent.build import build_agent
from dspo.agent.protocol import Agent, AgentRollout
from dspo.agent.stats import Kind, kind_of
from dspo.types import QAItem, RolloutGroup

ROLE_SEED_STRIDE = 7_919  # role i samples with seed + i * stride: the first role's draws are a plain agent's
ORIGIN = "origin"  # QAItem.metadata key of a built item: {"role", "group", "episode"} it was built from
# the two call-only figures the round reads from a call (dspo.rollout.sampler): merged over roles, not dropped
_ROUND_READS = {"tool_calls_mean": Kind.MEAN, "invalid_calls": Kind.SUM}


@dataclass
class RolePart:
    """One role's share of a call: the items it played and its agent's result (groups tagged with the role)."""

    role: str
    items: list[QAItem]  # [n] what it played
    groups: list[RolloutGroup]  # [n] in `items` order
    stats: dict[str, float]
    kinds: Mapping[str, Kind]  # its agent's stat kinds

    @property
    def trajectories(self) -> int:
        return sum(len(group.trajectories) for group in self.groups)


Derive = Callable[[Sequence[RolePart]], list[QAItem]]  # parts played so far -> this role's items (`derived_item`)
Settle = Callable[[Sequence[RolePart]], dict[str, float]]  # every part -> its statistics; may rewrite rewards


class Role:
    """One role of a `RoleAgent`. Config keys `rollout.agent.roles.<i>.<key>`.

    Args:
        name: logged as `rollout/<name>/...`; unique within the agent.
        agent: its agent (`rollout.agent`'s forms: a partial constructor, a config, an `AgentConfig`, None for the
            tool-calling loop), on the run's engine and tokenizer.
        env: its environment (tools + reward; None: the run's `env`).
        derive: builds its items from the parts played before it (None for the first role, required for the others).
            A derive with `bind(engine, tokenizer)` gets the policy's engine when the agent is built (to run the
            policy, as SSP's check does: `dspo.agent.selfplay`), one with `stat_kinds` and `last_stats` adds what it
            measured of each call to the round's statistics.
    """

    def __init__(self, name: str, agent: Any = None, env: Any = None, derive: Derive | None = None) -> None:
        if not name or "/" in name:
            raise ValueError(f"rollout.agent.roles: role name {name!r} must be non-empty and without '/'")
        self.name, self.agent, self.env, self.derive = name, agent, env, derive


class RoleAgent:
    """Plays `roles` in order in one call (see the module). Args:
    engine, tokenizer, env: given by `build_agent` (every role shares the engine: one policy).
    roles: the roles, in playing order; the first plays the round's items.
    settle: run after every role played, on all parts: rewrites rewards across roles, returns statistics.
    answer_role: the role that answers held-out questions (validation, test, dspo-eval; default: the last one).
    **settings: the tool-calling loop's settings (`rollout.agent.max_turns`, `temperature`, `tag_format`, ...) for
        every role whose `agent` is None; a role with an agent of its own keeps that agent's.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        env: Any,
        roles: Sequence[Role],
        settle: Settle | None = None,
        answer_role: str | None = None,
        **settings: Any,
    ) -> None:
        self.roles = list(roles)
        check_roles(self.roles)
        names = [role.name for role in self.roles]
        if answer_role is not None and answer_role not in names:
            raise ValueError(f"rollout.agent.answer_role={answer_role!r}: not one of the roles {names}")
        self.env, self.settle, self.answer_role = env, settle, answer_role or names[-1]
        self.settings = settings
        self.agents: dict[str, Agent] = {
            role.name: build_agent(self._agent_of(role), engine=engine, tokenizer=tokenizer, env=role.env or env)
            for role in self.roles
        }
        for role in self.roles:  # a derive that runs the policy (SSP's check) gets its engine
            if callable(getattr(role.derive, "bind", None)):
                role.derive.bind(engine=engine, tokenizer=tokenizer)
        kinds = [getattr(agent, "stat_kinds", CALL_STAT_KINDS) for agent in self.agents.values()]
        self.stat_kinds: dict[str, Kind] = {**_union(kinds), **getattr(settle, "stat_kinds", {})}
        for role in self.roles:
            self.stat_kinds.update(getattr(role.derive, "stat_kinds", {}))
        for name, agent_kinds in zip(names, kinds):
            self.stat_kinds.update({f"{name}/{key}": kind for key, kind in agent_kinds.items()})

    def _agent_of(self, role: Role) -> Any:
        if role.agent is not None or not self.settings:
            return role.agent
        from dspo.agent.tool_calling import ToolCallingAgent

        return functools.partial(ToolCallingAgent, **self.settings)

    @property
    def answerer(self) -> Agent:
        """The agent that answers held-out questions (`dspo.agent.protocol.answering`)."""
        return self.agents[self.answer_role]

    @property
    def retriever(self):
        """The first role's search retriever (the round counts its retries), None without one."""
        return getattr(self.agents[self.roles[0].name], "retriever", None)

    def rollout(
        self,
        items: Sequence[QAItem],
        group_size: int,
        policy_version: int,
        greedy: bool = False,
        seed: int | None = None,
    ) -> AgentRollout:
        parts: list[RolePart] = []
        for position, role in enumerate(self.roles):
            role_items = list(items) if role.derive is None else list(role.derive(parts))
            role_seed = None if seed is None else seed + position * ROLE_SEED_STRIDE
            parts.append(self._play(role, role_items, group_size, policy_version, greedy, role_seed, parts))
        extra = dict(self.settle(parts)) if self.settle is not None else {}
        for role in self.roles[1:]:  # what a derive measured of this call (SSP's refusals by reason)
            extra.update(getattr(role.derive, "last_stats", {}))
        return AgentRollout([group for part in parts for group in part.groups], {**merge_stats(parts), **extra})

    def _play(self, role: Role, items, group_size, policy_version, greedy, seed, earlier) -> RolePart:
        agent = self.agents[role.name]
        if items:
            result = agent.rollout(items, group_size, policy_version, greedy=greedy, seed=seed)
            groups, stats = result.groups, dict(result.stats)
        else:  # nothing to play this call (every proposal invalid): no engine call
            groups, stats = [], {}
        if [group.item.id for group in groups] != [item.id for item in items]:
            raise RuntimeError(f"role {role.name}: its agent returned groups for other items than it was given")
        for position, group in enumerate(groups):
            group.role = role.name
            group.prompt_index = position if role.derive is None else prompt_of(group.item, earlier)
        return RolePart(role.name, items, groups, stats, getattr(agent, "stat_kinds", CALL_STAT_KINDS))


def check_roles(roles: Sequence[Role]) -> None:
    """Unique names; the first role plays the round's items, each later one derives its own."""
    if not roles:
        raise ValueError("rollout.agent.roles: give at least one role")
    names = [role.name for role in roles]
    if len(set(names)) != len(names):
        raise ValueError(f"rollout.agent.roles: role names must be unique, got {names}")
    if roles[0].derive is not None:
        raise ValueError(f"rollout.agent.roles.0.derive: the first role ({names[0]}) plays the round's items; unset it")
    for position, role in enumerate(roles[1:], start=1):
        if role.derive is None:
            raise ValueError(
                f"rollout.agent.roles.{position}.derive: role {role.name} needs a derive (its items, built from the "
                "roles before it)"
            )


def _union(kinds: Sequence[Mapping[str, Kind]]) -> dict[str, Kind]:
    out: dict[str, Kind] = {}
    for table in kinds:
        out.update(table)
    return out


# ------------------------------------------------------------------------------------------ built items
def derived_item(part: RolePart, group: int, episode: int, question: str, answers: list[str], **metadata) -> QAItem:
    """An item built from episode `episode` of group `group` of `part`: it remembers its origin (`origin`)."""
    source = part.groups[group].item
    origin = {"role": part.role, "group": group, "episode": episode}
    return QAItem(
        id=f"{source.id}/{part.role}{episode}",
        question=question,
        golden_answers=list(answers),
        benchmark=source.benchmark,
        metadata={**metadata, ORIGIN: origin},
    )


def origin(item: QAItem) -> tuple[str, int, int] | None:
    """(role, group, episode) an item was built from, None for a round's own item."""
    found = item.metadata.get(ORIGIN)
    return None if found is None else (found["role"], int(found["group"]), int(found["episode"]))


def prompt_of(item: QAItem, parts: Sequence[RolePart]) -> int:
    """The position, among the round's items, of the item `item` descends from (following origins back)."""
    by_role = {part.role: part for part in parts}
    found = origin(item)
    while found is not None:
        role, group, _ = found
        if role not in by_role or not 0 <= group < len(by_role[role].groups):
            raise ValueError(f"item {item.id}: its origin {found} is no group played before it")
        source = by_role[role].groups[group]
        if origin(source.item) is None:
            return source.prompt_index
        found = origin(source.item)
    raise ValueError(f"item {item.id}: a later role's item must name its origin (dspo.agent.roles.derived_item)")


# ------------------------------------------------------------------------------------------ statistics
def merge_stats(parts: Sequence[RolePart]) -> dict[str, float]:
    """The call's statistics: each role's prefixed `<role>/<key>` (its counts and means), and the un-prefixed ones
    merged over roles as the round merges calls (counts add up, means are weighted by trajectories; of the call-only
    figures, the two the round reads: `tool_calls_mean` and `invalid_calls`)."""
    sums: dict[str, float] = {}
    weighted: dict[str, float] = {}
    weights: dict[str, int] = {}
    prefixed: dict[str, float] = {}
    for part in parts:
        for key, value in part.stats.items():
            kind = _ROUND_READS.get(key) or kind_of(key, part.kinds)
            if kind is Kind.CALL:
                continue
            if key not in _ROUND_READS:
                prefixed[f"{part.role}/{key}"] = value
            if kind is Kind.SUM:
                sums[key] = sums.get(key, 0.0) + value
            else:
                weighted[key] = weighted.get(key, 0.0) + value * part.trajectories
                weights[key] = weights.get(key, 0) + part.trajectories
    means = {key: value / max(weights[key], 1) for key, value in weighted.items()}
    return {**sums, **means, **prefixed}


# ------------------------------------------------------------------------------------------ a settle
class FailureRateReward:
    """A proposer paid by how hard its question was: the share of the solver's episodes that failed on the item built
    from it (its `outcome` too, so the filter keeps proposer groups whose questions differ in difficulty). A proposal
    no item was built from (invalid) earns 0.

    A solver episode that crashed (`Trajectory.failed`: its agent raised or timed out) has no outcome, so it pays no
    one: it is neither a failure nor a success, and the rate is over the episodes that ran (its own group is dropped
    by the round, `RolloutGroup.failed`). Counted as failures, crashes paid the proposer for the solver's errors. A
    proposal whose solver episodes all crashed was not measured: it earns 0, as an invalid one (no pay for a crash),
    and is counted. An episode the budget ended (`truncated`) is the solver's own failure and counts as one.

    Statistics: `<proposer>/valid_share` (episodes whose proposal became an item), `<proposer>/difficulty` (the mean
    failure rate over the measured ones), `<proposer>/unmeasured` (proposals whose solver episodes all crashed) and
    `<proposer>/solver_crashed` (solver episodes on proposals that crashed).

    Args:
        proposer, solver: the two roles' names.
    """

    def __init__(self, proposer: str = "proposer", solver: str = "solver") -> None:
        self.proposer, self.solver = proposer, solver
        self.stat_kinds = {
            f"{proposer}/valid_share": Kind.MEAN,
            f"{proposer}/difficulty": Kind.MEAN,
            f"{proposer}/unmeasured": Kind.SUM,
            f"{proposer}/solver_crashed": Kind.SUM,
        }

    def __call__(self, parts: Sequence[RolePart]) -> dict[str, float]:
        by_role = {part.role: part for part in parts}
        for name in (self.proposer, self.solver):
            if name not in by_role:
                raise ValueError(f"rollout.agent.settle: no role named {name!r} (roles: {list(by_role)})")
        failure: dict[tuple[int, int], float] = {}  # measured proposals only
        built, crashed = 0, 0
        for group in by_role[self.solver].groups:
            found = origin(group.item)
            if found is not None and found[0] == self.proposer:
                built += 1
                ran = [t for t in group.trajectories if not t.failed]
                crashed += len(group.trajectories) - len(ran)
                if ran:
                    failure[found[1:]] = sum(float(t.outcome) <= 0 for t in ran) / len(ran)
        episodes = 0
        for g, group in enumerate(by_role[self.proposer].groups):
            for e, trajectory in enumerate(group.trajectories):
                episodes += 1
                trajectory.reward = trajectory.outcome = failure.get((g, e), 0.0)
                trajectory.reward_components["difficulty"] = trajectory.reward
        measured = list(failure.values())
        return {
            f"{self.proposer}/valid_share": built / max(episodes, 1),
            f"{self.proposer}/difficulty": sum(measured) / max(len(measured), 1),
            f"{self.proposer}/unmeasured": float(built - len(measured)),
            f"{self.proposer}/solver_crashed": float(crashed),
        }
