"""Environments as plug-ins: the tools an agent can call and the reward it is paid (`env` config group)."""

from dspo.env.environment import Environment, check_credit_fits
from dspo.env.rewards import EpisodeRecord, Reward, RewardResult, SubEMReward, TurnRecord
from dspo.env.search_tool import SearchTool
from dspo.env.tools import CallContext, InvalidCall, Tool, ToolResult, ToolUnavailableError

__all__ = [
    "CallContext",
    "Environment",
    "EpisodeRecord",
    "InvalidCall",
    "Reward",
    "RewardResult",
    "SearchTool",
    "SubEMReward",
    "Tool",
    "ToolResult",
    "ToolUnavailableError",
    "TurnRecord",
    "check_credit_fits",
]
