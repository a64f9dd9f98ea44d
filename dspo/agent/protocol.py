"""What an agent is to dspo (`Agent`), what one call returns (`AgentRollout`), and how `rollout.agent` is read.

An agent turns questions into scored trajectories in an environment (`dspo.env.Environment`: tools + reward). The
built-in one is the tool-calling loop (`dspo.agent.tool_calling.ToolCallingAgent`); another is a plug-in: a class
whose constructor takes `engine`, `tokenizer` and `env` (plus its own settings) and whose `rollout` returns an
`AgentRollout`. `rollout.agent` is its constructor call (`_target_` + settings, `_partial_: true`), completed by
`dspo.agent.build.build_agent` with what the caller built (the engine, the tokenizer, the environment). This module
is the bottom of the agent layer: the agents import it, and `build` (which imports the agents) sits above them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dspo.types import QAItem, RolloutGroup


@dataclass(frozen=True)
class AgentRollout:
    """One `Agent.rollout` call's result."""

    # [len(items)] in `items` order, `group_size` trajectories each; an agent of several roles (`dspo.agent.roles`)
    # returns those first, then the groups its other roles played in the same call (`RolloutGroup.role`)
    groups: list[RolloutGroup]
    stats: dict[str, float] = field(default_factory=dict)  # the call's statistics (tool calls, timers, reward/...)


@runtime_checkable
class Agent(Protocol):
    """What training, evaluation and the commands need from an agent. `env` is the environment it acts in (its
    credit and curricula are read from it); an agent without one is trained with trajectory credit."""

    env: Any

    def rollout(
        self,
        items: Sequence[QAItem],
        group_size: int,
        policy_version: int,
        greedy: bool = False,
        seed: int | None = None,
    ) -> AgentRollout: ...


def answering(agent: Agent) -> Agent:
    """The agent that answers held-out questions (validation, test, dspo-eval): an agent of several roles names it
    (`answerer`: `dspo.agent.roles.RoleAgent`'s answering role), any other agent answers itself."""
    return getattr(agent, "answerer", None) or agent


AgentFactory = Callable[..., Agent]  # (engine=, tokenizer=, env=) -> Agent: `rollout.agent` once Hydra built it


def check_agent_settings(agent: Any) -> None:
    """Fail at once, naming the new key, when `rollout.agent` (however given) still sets a key that moved to the
    environment: a partial constructor is only called where the agent runs, after the engine has started."""
    from dspo.agent.config import check_agent_keys

    if isinstance(agent, functools.partial):
        check_agent_keys(agent.keywords, agent.keywords)
    elif isinstance(agent, Mapping) or is_config(agent):
        check_agent_keys(list(agent.keys()), agent)


def agent_setting(agent: Any, key: str, default: Any = None) -> Any:
    """A setting of `rollout.agent` (`temperature`, `max_total_tokens`, ...) however it is given (see `build_agent`)."""
    if isinstance(agent, functools.partial):
        if key in agent.keywords:
            return agent.keywords[key]
        config = agent.keywords.get("config")
        return getattr(config, key, default) if config is not None else default
    if isinstance(agent, Mapping) or is_config(agent):
        return agent.get(key, default)
    return getattr(agent, key, getattr(getattr(agent, "config", None), key, default))


def is_config(value: Any) -> bool:
    from omegaconf import DictConfig

    return isinstance(value, DictConfig)
