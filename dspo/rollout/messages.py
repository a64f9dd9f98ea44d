"""What the trainer and its engine process say to each other over their two queues (issue 41: typed, not tagged
tuples). Commands go to the engine process (`dspo.rollout.serve`), replies come back to its handle
(`dspo.rollout.worker.EngineProcess`); every one is a frozen dataclass, pickled by the queue."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
class RoundDone:
    """A round generated (`dspo.rollout.spec.SampledRound`)."""

    sampled: Any


@dataclass(frozen=True)
class Predictions:
    tag: int  # the `Predict` it answers
    answers: list  # [n] dspo.eval.pipeline.Prediction


@dataclass(frozen=True)
class Failed:
    """The engine process raised; `traceback` is its formatted stack."""

    traceback: str


Command = LoadWeights | Predict | Stop
Reply = Ready | RoundDone | Predictions | Failed
