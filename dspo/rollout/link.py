"""`TrainerLink`: what a round producer needs from whoever trains, as plain values and callables (issue 41).

The producer and its engine sides (`dspo.rollout.producer`, `dspo.rollout.sides`) never see a trainer object: the
policy's weights and their version, where training is, an all-ranks vote and the rank's place come through this
dataclass. `dspo.callbacks.rollout_callback.trainer_link` fills it from Lightning's trainer and module; a script or a
standalone orchestrator fills it from its own loop, and the tests fill it by hand (tests/rollout/test_producer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


def _alone(flag: bool) -> bool:
    return flag


def _start() -> tuple[int, int | None]:
    return (0, None)


def _fitting() -> bool:
    return True


def _no_sampler() -> Any:
    return None


@dataclass(frozen=True)
class TrainerLink:
    """Args:
    weights: the policy's full weights as (name, tensor) pairs; under FSDP an all-gather, so every rank calls it.
    weights_version: optimizer steps applied to them (a skipped, non-finite step does not count: the engine keeps
        the weights it has).
    progress: (global step, max steps or None): curricula read it, the engine process gets it with each push.
    all_true: True when every rank's flag is True (one collective; alone: the flag itself).
    max_over_ranks: per position, the largest of every rank's counts (one collective); None on one rank.
    fitting: whether rounds will be consumed (training) or the engine only answers evaluation.
    sampler: where the prompt sampler is when the producer was given none (the data module's, once it has one).
    rank, world_size, local_rank, num_nodes: this rank's place.
    device: the trainer's device on this rank (an engine process shares it unless given GPUs of its own).
    """

    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    weights_version: Callable[[], int]
    progress: Callable[[], tuple[int, int | None]] = _start
    all_true: Callable[[bool], bool] = _alone
    max_over_ranks: Callable[[list[int]], list[int]] | None = None
    fitting: Callable[[], bool] = _fitting
    sampler: Callable[[], Any] = _no_sampler
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    num_nodes: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def local_world_size(self) -> int:
        return max(1, self.world_size // max(self.num_nodes, 1))


def on_every_rank(link: TrainerLink, what: str, call: Callable[[], Any]) -> Any:
    """`call()`, its failure agreed on by every rank (one collective): a rank that raised alone would leave the others
    waiting in the next collective (the gradient all-reduce, a barrier) until the job's walltime."""
    failure = None
    try:
        result = call()
    except Exception as error:  # noqa: BLE001 - re-raised below, on every rank
        failure = error
    if link.world_size > 1 and not link.all_true(failure is None):
        raise failure or RuntimeError(f"another rank failed while {what} (its engine process or transfer); see its log")
    if failure is not None:
        raise failure
    return result
