"""What the trainer and its engine process say to each other over their two queues (issue 41: typed, not tagged
tuples). Commands go to the engine process (`dspo.rollout.engine_process_main`), replies come back to its handle
(`dspo.rollout.engine_process.EngineProcess`); every one is a frozen dataclass, pickled by the queue."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not a name of this module: every dataclass here is a message
    from dspo.types import RolloutGroup


# ------------------------------------------------------------------------------------------ trainer -> engine process
@dataclass(frozen=True)
class LoadWeights:
    """Push `sequence` is in the weight transport: load it before the next round (`dspo.rollout.transfer`)."""

    sequence: int  # pushes so far, this one included
    progress: tuple[int, int | None]  # (global step, max steps) for curricula


@dataclass(frozen=True)
class Predict:
    """Greedy answers to `items` at the weights loaded last (between two rounds)."""

    tag: int  # echoed in the reply
    items: list  # [n] QAItem
    version: int  # policy_version to tag the trajectories with


@dataclass(frozen=True)
class Stop:
    """End the loop between two rounds."""


# ------------------------------------------------------------------------------------------ engine process -> trainer
@dataclass(frozen=True)
class Ready:
    """The engine, agent and environment are built."""

    pid: int
    credit: str  # the environment's credit as built there (trajectory | turn)


@dataclass(frozen=True)
class SampledRound:
    """One round as the engine process produced it. Groups are this rank's share, unbuilt (the trainer pads them)."""

    index: int  # round r
    groups: list[RolloutGroup]  # [B / world] kept groups
    stats: dict[str, float]  # RoundSampler.sample_round's statistics
    weights_round: int  # completed rounds of the weights that sampled it (every trajectory's newest tokens)
    # where round r+1 starts, which the trainer's checkpoint saves: the engine process's prompt sampler after the round
    # (over-sampled prompts included) and its filter's keep-rate prior
    sampler_state: dict[str, int] | None = None
    keep_rate: float | None = None
    idle_s: float = 0.0  # time the engine process waited for weights before starting it
    generation: tuple[float, float] = (0.0, 0.0)  # time.time() when its generation started and ended
    # with checkpointing.in_flight (k >= 1): the engine process's state after this round, which a checkpoint stores
    # with the rounds in flight (dspo.rollout.in_flight): {"carried": partial rollouts' CarriedGroups or None,
    # "rng": {"torch": ByteTensor, "python": random.getstate()}}
    resume: dict | None = None


@dataclass(frozen=True)
class RoundDone:
    """A round generated."""

    sampled: SampledRound


@dataclass(frozen=True)
class Loaded:
    """Push `sequence` is loaded (or its weights were unchanged). At k = 1 the trainer writes the next push only after
    this: a push written over one the engine process has not loaded yet would give a round newer weights than the
    bound's, depending on timing (issue 74; `EngineProcess.push_weights`)."""

    sequence: int


@dataclass(frozen=True)
class Predictions:
    tag: int  # the `Predict` it answers
    answers: list  # [n] dspo.eval.pipeline.Prediction


@dataclass(frozen=True)
class Failed:
    """The engine process raised; `traceback` is its formatted stack."""

    traceback: str


Command = LoadWeights | Predict | Stop
Reply = Ready | RoundDone | Predictions | Failed | Loaded
