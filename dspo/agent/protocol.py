"""What an agent is to dspo (`Agent`), what one call returns (`AgentRollout`), and the one place agents are built.

An agent turns questions into scored trajectories in an environment (`dspo.env.Environment`: tools + reward). The
built-in one is the tool-calling loop (`dspo.agent.tool_calling.ToolCallingAgent`); another is a plug-in: a class
whose constructor takes `engine`, `tokenizer` and `env` (plus its own settings) and whose `rollout` returns an
`AgentRollout`. `rollout.agent` is its constructor call (`_target_` + settings, `_partial_: true`), completed here
by `build_agent` with what the caller built (the engine, the tokenizer, the environment). Every command builds its
agent here: training (in the trainer or the engine process), dspo-eval, dspo-rollout, the toy warm start, the
benchmarks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dspo.agent.config import AgentConfig
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


def build_agent(agent: Any, *, engine: Any, tokenizer: Any, env: Any) -> Agent:
    """The agent `agent` describes, on `engine` in `env`.

    agent: `rollout.agent` as Hydra built it (a partial constructor taking engine, tokenizer and env), its config (a
        mapping with `_target_`, instantiated here), an `AgentConfig` (the tool-calling loop with these limits), or
        None (the tool-calling loop with its defaults).
    """
    from dspo.agent.tool_calling import ToolCallingAgent

    if agent is None:
        agent = ToolCallingAgent
    elif isinstance(agent, AgentConfig):
        agent = functools.partial(ToolCallingAgent, config=agent)
    elif isinstance(agent, Mapping) or _is_config(agent):
        import hydra

        agent = hydra.utils.instantiate(agent, _partial_=True)
    if not callable(agent):
        raise TypeError(
            f"rollout.agent: expected an agent constructor (a _target_ with _partial_: true), got "
            f"{type(agent).__name__}"
        )
    if getattr(env, "agent", None) is not None:
        agent = _endpoint_agent(agent)
    return agent(engine=engine, tokenizer=tokenizer, env=env)


def _endpoint_agent(agent: Callable) -> Callable:
    """With `env.agent` (an agent written against the OpenAI API), the agent is the endpoint that serves it, with
    `rollout.agent`'s budgets; another `rollout.agent._target_` would be a second agent."""
    from dspo.agent.endpoint.agent import EndpointAgent
    from dspo.agent.tool_calling import ToolCallingAgent

    target = agent.func if isinstance(agent, functools.partial) else agent
    if target is EndpointAgent:
        return agent
    if target is not ToolCallingAgent:
        raise ValueError(
            f"env.agent and rollout.agent._target_={getattr(target, '__qualname__', target)} both name an agent: "
            "keep rollout.agent._target_ at its default (its budgets then apply to env.agent) or unset env.agent"
        )
    keywords = dict(agent.keywords) if isinstance(agent, functools.partial) else {}
    return functools.partial(EndpointAgent, **keywords)


def check_agent_settings(agent: Any) -> None:
    """Fail at once, naming the new key, when `rollout.agent` (however given) still sets a key that moved to the
    environment: a partial constructor is only called where the agent runs, after the engine has started."""
    from dspo.agent.config import check_agent_keys

    if isinstance(agent, functools.partial):
        check_agent_keys(agent.keywords, agent.keywords)
    elif isinstance(agent, Mapping) or _is_config(agent):
        check_agent_keys(list(agent.keys()), agent)


def agent_setting(agent: Any, key: str, default: Any = None) -> Any:
    """A setting of `rollout.agent` (`temperature`, `max_total_tokens`, ...) however it is given (see `build_agent`)."""
    if isinstance(agent, functools.partial):
        if key in agent.keywords:
            return agent.keywords[key]
        config = agent.keywords.get("config")
        return getattr(config, key, default) if config is not None else default
    if isinstance(agent, Mapping) or _is_config(agent):
        return agent.get(key, default)
    return getattr(agent, key, getattr(getattr(agent, "config", None), key, default))


def _is_config(value: Any) -> bool:
    from omegaconf import DictConfig

    return isinstance(value, DictConfig)
