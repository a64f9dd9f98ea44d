"""The one place agents are built: `build_agent` completes `rollout.agent` (a partial constructor, its config, an
`AgentConfig` or None) with the engine, the tokenizer and the environment the caller built. Every command builds its
agent here: training (in the trainer or the engine process), dspo-eval, dspo-rollout, the toy warm start, the
benchmarks. Above the agents it may build (`tool_calling`, `endpoint`); the protocol they implement is
`dspo.agent.protocol`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from dspo.agent.config import AgentConfig
from dspo.agent.protocol import Agent, is_config
from dspo.agent.tool_calling import ToolCallingAgent


def build_agent(agent: Any, *, engine: Any, tokenizer: Any, env: Any) -> Agent:
    """The agent `agent` describes, on `engine` in `env`.

    agent: `rollout.agent` as Hydra built it (a partial constructor taking engine, tokenizer and env), its config (a
        mapping with `_target_`, instantiated here), an `AgentConfig` (the tool-calling loop with these limits), or
        None (the tool-calling loop with its defaults).
    """
    if agent is None:
        agent = ToolCallingAgent
    elif isinstance(agent, AgentConfig):
        agent = functools.partial(ToolCallingAgent, config=agent)
    elif isinstance(agent, Mapping) or is_config(agent):
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
    from dspo.agent.endpoint.agent import EndpointAgent  # its HTTP server, imported only by runs that serve one

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
