"""Partial rollouts (`rollout.partial_rollouts`, issue 43 point 3): what one resumable rollout call of the tool-calling
agent takes and returns.

A round's generation may stop once it has enough finished groups (`stop`, asked after every turn); the groups whose
episodes have not all ended are returned as `CarriedGroup`s and continued by the next call, on whatever weights the
engine holds then. Each token keeps the version that generated it (`Episode.versions`, `Trajectory.token_versions`),
so the importance weights of `algorithm.rollout_correction` use, token by token, the engine logprob of the policy that
sampled it; a group is dropped once its oldest token is more than `rollout.max_token_age` rounds old. The age bound
selects on length: a group is trained only if all its episodes finish within it, so the longest episodes are the ones
dropped, and no importance weight corrects that (docs/async.md#partial-rollouts).

Departures from AReaL/slime (which interrupt generation mid-turn and recompute the KV cache): episodes are carried
between turns, never inside one, so every model turn is sampled by one policy and the engine needs no interruption.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dspo.agent.episode import Episode
from dspo.types import QAItem, RolloutGroup

# after a turn: the groups that finished in it (scored) -> True to stop the call there
StopFn = Callable[[list[RolloutGroup]], bool]


@dataclass
class CarriedGroup:
    """The G episodes of one prompt, some still running, between two rollout calls."""

    item: QAItem
    prompt_index: int  # the prompt sampler's index (RolloutGroup.prompt_index once it finishes)
    episodes: list[Episode]  # [G]
    started: int  # the policy version that generated its first tokens
    # of `generated_tokens`, those already counted in an earlier call's round (`rollout/generated_tokens` credits each
    # token to the round that generated it, not to the one the group finishes in)
    counted: int = 0

    @property
    def done(self) -> bool:
        return all(ep.done for ep in self.episodes)

    def episode_tokens(self) -> list[int]:
        """The model tokens each of its episodes generated so far (what `Trajectory.num_generated_tokens` counts)."""
        return [sum(ep.mask) + sum(sum(s.response_mask) for s in ep.segments) for ep in self.episodes]

    @property
    def generated_tokens(self) -> int:
        return sum(self.episode_tokens())

    def age(self, round_index: int) -> int:
        """Rounds between its oldest tokens' weights and round `round_index`."""
        return round_index - self.started


@dataclass
class PartialRollout:
    """One resumable call's result."""

    groups: list[RolloutGroup]  # the groups that finished in this call, in the order they finished
    carried: list[CarriedGroup]  # the groups still running when it stopped, for the next call
    stats: dict[str, float] = field(default_factory=dict)  # as AgentRollout.stats, over the finished trajectories


def token_staleness(groups: list[RolloutGroup], round_index: int) -> list[int]:
    """round_index − the version that generated it, for every trained token of `groups`."""
    return [round_index - v for g in groups for t in g.trajectories for v in t.trained_token_versions()]
