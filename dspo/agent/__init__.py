"""dspo.agent: what turns questions into scored trajectories (the `Agent` protocol, `build_agent`), and the built-in
tool-calling loop (`tool_calling`) with its call parsing (`parsing`) and prompts (`prompts`). Depends on the engines
and the environment (`dspo.env`), never on the rollout orchestration (`dspo.rollout`) or the trainer."""

from dspo.agent.build import build_agent
from dspo.agent.config import AgentConfig
from dspo.agent.protocol import (
    Agent,
    AgentFactory,
    AgentRollout,
    agent_setting,
    answering,
    check_agent_settings,
)

__all__ = [
    "Agent",
    "AgentConfig",
    "AgentFactory",
    "AgentRollout",
    "agent_setting",
    "answering",
    "build_agent",
    "check_agent_settings",
]
