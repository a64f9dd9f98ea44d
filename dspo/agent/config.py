"""An episode's limits (`AgentConfig`) and the settings that left the agent for the environment.

Light on purpose (no torch, no engine): `dspo.process.runtime.run_command` checks a command line against `MOVED_TO_ENV`
before Hydra composes it, so that `rollout.agent.topk=5` fails naming `env.tools.search.topk`, not with Hydra's
"Key 'topk' is not in struct".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

OVERFLOW_MODES = ("end", "compact")  # rollout.agent.overflow (dspo.agent.compaction)

# rollout.agent.<key> -> where it lives now: the search tool's limits and the reward's answer guard belong to the
# environment (conf/env/*.yaml), which every agent shares; the agent keeps what shapes an episode.
MOVED_TO_ENV = {
    "topk": "env.tools.search.topk",
    "max_queries_per_call": "env.tools.search.max_queries_per_call",
    "max_query_chars": "env.tools.search.max_query_chars",
    "max_answer_words": "env.reward.max_answer_words",
}


# renamed config nodes (issue 41: "environment" means only `env`): an override under the old name names the new one
RENAMED_NODES = {"callbacks.environment": "callbacks.rollout"}


class MovedSettingError(ValueError):
    """A setting given where it used to be; the message names where it lives now."""


def moved_message(key: str, value: Any = None) -> str:
    new = MOVED_TO_ENV[key]
    shown = "VALUE" if value is None else value
    return (
        f"rollout.agent.{key} moved to the environment: set {new}={shown} instead (conf/env/*.yaml give it; "
        "environments with other tool names: env.tools.<tool>.<key>)"
    )


def check_agent_keys(keys: Iterable[str], values: Mapping[str, Any] | None = None) -> None:
    """Raise `MovedSettingError` for the first moved key among `keys` (an agent's keyword arguments)."""
    for key in keys:
        if key in MOVED_TO_ENV:
            raise MovedSettingError(moved_message(key, (values or {}).get(key)))


def check_moved_overrides(overrides: Iterable[str]) -> None:
    """A command line that sets a moved key (`rollout.agent.topk=5`, `+rollout.agent.topk=5`) or one under a renamed
    node (`callbacks.environment.X`) fails naming the new key, before Hydra refuses it as a key not in the config."""
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+~")
        if sep and key.startswith("rollout.agent.") and key.removeprefix("rollout.agent.") in MOVED_TO_ENV:
            raise MovedSettingError(moved_message(key.removeprefix("rollout.agent."), value))
        for old, new in RENAMED_NODES.items():
            if key == old or key.startswith(old + "."):
                renamed = new + key.removeprefix(old)
                raise MovedSettingError(f"{key} is now {renamed} (the rollout callback's config node was renamed)")


@dataclass
class AgentConfig:
    """Limits of one episode. `max_total_tokens` caps prompt + response (the trainer's sequence length). The tools'
    limits and the reward's answer guard are the environment's (`MOVED_TO_ENV`)."""

    max_turns: int = 4
    max_new_tokens_per_turn: int = 256
    max_obs_tokens: int = 256
    max_total_tokens: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    tag_format: str = "qwen"  # "qwen" | "searchr1"
    system_prompt: str | None = None
    # when the next turn (its tool response + max_new_tokens_per_turn) would pass max_total_tokens: "end" the episode
    # (truncated), or "compact" the oldest tool responses into one-line notes (dspo.agent.compaction)
    overflow: str = "end"

    def __post_init__(self) -> None:
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"rollout.agent.overflow={self.overflow!r}: expected one of {', '.join(OVERFLOW_MODES)}")
        # The trainer's logprobs and the rollout-correction weights (dspo.algorithms.rollout_correction) compare the
        # engine's logprob with the full-vocabulary softmax at `temperature`; a nucleus renormalizes over a subset, so
        # every sampled token would look off-policy. top_k is no option at all (vLLM ignores the model's defaults).
        if self.top_p != 1.0:
            raise ValueError(
                f"rollout.agent.top_p={self.top_p}: only 1.0 is supported; top-p sampling makes the engine's logprobs "
                "incomparable with the trainer's full-vocabulary logprobs. Use temperature to control sampling."
            )

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> AgentConfig:
        """From `rollout.agent`'s keyword arguments: a moved key names its new place, an unknown key the known ones."""
        check_agent_keys(settings, settings)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"rollout.agent.{unknown[0]}: not an agent setting (known: {', '.join(sorted(known))})")
        return cls(**settings)
