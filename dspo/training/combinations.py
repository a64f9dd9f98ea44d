"""Which training switches cannot work together, refused when the config is composed (before anything is built).

Each switch a user sets by a config key is a `Setting`: a name as a user writes it (`rollout.agent.overflow=compact`)
and a test on the composed config. `REFUSED` lists the pairs of settings that cannot train together, each with why;
`check_combinations` refuses a config holding any of them with one message naming both keys, the reason and the way
out. Every other pair trains: `tests/training/test_combinations.py` runs a covering design over the switches (each pair
of settings in at least one short run, two ranks where the pair includes ranks) and asserts every refusal here. A new
switch is one line there, and its impossible pairs one line each here (docs/training.md#switches-that-combine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf


@dataclass(frozen=True)
class Setting:
    """A switch at some values: the config `key`, `holds(cfg)` whether the composed config has it, and a `note` on
    what the value means; messages show the key with the config's own value."""

    key: str
    holds: Callable[[DictConfig], bool]
    note: str = ""

    def label(self, cfg: DictConfig) -> str:
        value = OmegaConf.select(cfg, self.key, default=None)
        shown = str(value).lower() if isinstance(value, bool) else value  # as written on a command line
        return f"{self.key}={shown}" + (f" ({self.note})" if self.note else "")


def _select(cfg: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default)


def _objective(cfg: DictConfig):
    """The record of `algorithm.loss` (None when the name is unknown: AlgorithmConfig refuses it, naming the key)."""
    from dspo.algorithms.losses import OBJECTIVES

    name = _select(cfg, "algorithm.loss", "dspo")
    return OBJECTIVES[name] if name in OBJECTIVES else None  # noqa: SIM401 - a Registry has no get


def _correction_level(cfg: DictConfig) -> str | None:
    from dspo.algorithms.rollout_correction import CORRECTION_MODES

    mode = _select(cfg, "algorithm.rollout_correction.mode", "none")
    return CORRECTION_MODES[mode].level if mode in CORRECTION_MODES else None


PARTIAL = Setting("rollout.partial_rollouts", lambda c: _select(c, "rollout.partial_rollouts") is True)
SYNCHRONOUS = Setting("rollout.max_staleness", lambda c: _select(c, "rollout.max_staleness", 0) == 0)
COMPACT = Setting("rollout.agent.overflow", lambda c: _select(c, "rollout.agent.overflow") == "compact")
# env=openenv / env=verifiers build their env.agent themselves (dspo/env/external.py): behind the endpoint too
EXTERNAL_ENVS = ("dspo.env.openenv.openenv_environment", "dspo.env.verifiers_env.verifiers_environment")
ENDPOINT = Setting(
    "env.agent",
    lambda c: _select(c, "env.agent") is not None or _select(c, "env._target_") in EXTERNAL_ENVS,
    "an agent behind the endpoint (env.agent, env=openenv, env=verifiers)",
)
TURN_CREDIT = Setting("env.reward.credit", lambda c: _select(c, "env.reward.credit") == "turn")
PLANNER = Setting(
    "env.reward._target_",
    lambda c: _select(c, "env.reward._target_") == "dspo.env.planner.PlannerReward",
    "env=planner",
)
GOAL_REFLECT = Setting(
    "env.reward._target_",
    lambda c: _select(c, "env.reward._target_") == "dspo.env.goal_reflect.GoalReflectReward",
    "env=goal_reflect",
)
ROLES = Setting(
    "rollout.agent._target_",
    lambda c: _select(c, "rollout.agent._target_") == "dspo.agent.roles.RoleAgent",
    "roles in a round",
)
SEQUENCE_OBJECTIVE = Setting(
    "algorithm.loss",
    lambda c: _objective(c) is not None and not _objective(c).token_advantages,
    "one advantage per sequence",
)
SEQUENCE_RATIO = Setting(
    "algorithm.loss",
    lambda c: _objective(c) is not None and _objective(c).ratio_level == "sequence",
    "one ratio per sequence",
)
TOKEN_CORRECTION = Setting(
    "algorithm.rollout_correction.mode", lambda c: _correction_level(c) == "token", "a weight per token"
)


@dataclass(frozen=True)
class Refusal:
    first: Setting
    second: Setting
    why: str  # why they cannot train together, and what to use instead


REFUSED: tuple[Refusal, ...] = (
    Refusal(
        PARTIAL,
        SYNCHRONOUS,
        "at 0 every round is sampled by the newest weights, so no episode can be carried into the next round; set "
        "rollout.max_staleness >= 1 or rollout.partial_rollouts=false (docs/async.md#partial-rollouts)",
    ),
    Refusal(
        PARTIAL,
        COMPACT,
        "a carried episode's compacted contexts are not tracked per policy version; use one of them",
    ),
    Refusal(
        PARTIAL,
        ENDPOINT,
        "an agent behind the endpoint runs each episode to its end in one call (its coroutine cannot be carried into "
        "the next round); set rollout.partial_rollouts=false",
    ),
    Refusal(
        COMPACT,
        ENDPOINT,
        "the agent keeps its own context (a call over budget is refused with a 400 it can handle); set "
        "rollout.agent.overflow=end",
    ),
    Refusal(
        TURN_CREDIT,
        SEQUENCE_OBJECTIVE,
        "per-turn credit gives each turn's tokens their own advantage, and a sequence-level objective takes one per "
        "sequence; use env.reward.credit=trajectory, or algorithm=dapo / algorithm=grpo",
    ),
    Refusal(
        TURN_CREDIT,
        COMPACT,
        "a compacted episode is trained as several samples and per-turn credit covers one token sequence; use "
        "env.reward.credit=trajectory or rollout.agent.overflow=end",
    ),
    Refusal(
        TURN_CREDIT,
        ENDPOINT,
        "an agent behind the endpoint may rewrite its history, which splits the episode into several samples, and "
        "per-turn credit covers one token sequence; use env.reward.credit=trajectory",
    ),
    Refusal(
        TURN_CREDIT,
        PLANNER,
        "the planner's reward (the answerer's outcome, the plan's quality, its cost) is known when the episode ends, "
        "so no turn has a reward of its own; use env.reward.credit=trajectory",
    ),
    Refusal(
        ROLES,
        PARTIAL,
        "an episode carried into the next round would leave its role's later roles without it (a solver's question "
        "is built from a finished proposer episode in the same call); set rollout.partial_rollouts=false",
    ),
    Refusal(
        ROLES,
        ENDPOINT,
        "the endpoint serves one agent written against the OpenAI API, and roles are agents of their own; unset "
        "env.agent (each role's agent is rollout.agent.roles.<i>.agent)",
    ),
    Refusal(
        ROLES,
        GOAL_REFLECT,
        "a reflection is paid when it agrees with whether the results held the item's gold page (env.reward.gold_key), "
        "and a question written in the round names none; use env=search (or env=simulated with "
        "env.tools.search.noise for noisy results)",
    ),
    Refusal(
        TOKEN_CORRECTION,
        SEQUENCE_RATIO,
        "a sequence-level objective has one ratio per sequence, so it takes one weight per sequence; use a seq_* "
        "mode (seq_prod_tis corrects stale rounds) or a token-level algorithm (dapo, grpo)",
    ),
)


def refusals(cfg: DictConfig) -> list[str]:
    """One message per refused pair the composed config holds."""
    return [
        f"{r.first.label(cfg)} with {r.second.label(cfg)}: {r.why}"
        for r in REFUSED
        if r.first.holds(cfg) and r.second.holds(cfg)
    ]


def check_combinations(cfg: DictConfig) -> None:
    """Refuse a composed config that holds a pair of settings that cannot train together (`REFUSED`)."""
    found = refusals(cfg)
    if found:
        raise ValueError("these settings cannot train together:\n  " + "\n  ".join(found))
