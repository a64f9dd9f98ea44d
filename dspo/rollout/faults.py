"""Fault injection at named points of the run-ahead path (issue 38): how tests kill the engine process or the trainer
at the worst moment, or make one rank of several fail alone, without patching the code under test.

`DSPO_FAULT` holds one or more comma-separated specs `POINT[@RANK][#HIT][=ACTION]`:

    engine.holding_weights   engine process, the shared-memory weights lock held, before loading them
    engine.mid_load          engine process, inside the engine's load, after the first tensor was handed over
    engine.generating        engine process, a round's generation under way
    engine.waiting           engine process, idle, waiting for the weights the staleness bound needs
    engine.mid_write_round   engine process, half of a round's reply written to the trainer (`dspo.rollout.channel`)
    engine.mid_write_predictions  engine process, half of a predictions reply written
    engine.receiver          engine process, its weight receiver thread, a push header read (`raise`: the thread
                             fails, as on a CUDA out-of-memory of its staging buffers)
    trainer.mid_send         trainer, the weights lock held and the first tensor written
    trainer.push             trainer, before it sends a push
    trainer.take             trainer, before it takes a round

RANK: only the process whose rank (`RANK`, else `LOCAL_RANK`: Lightning's own launcher sets only the latter; an
engine process inherits its trainer's) is RANK;
HIT: the HIT-th time the point is reached (default 1); ACTION: `kill` (SIGKILL itself: no handler, no cleanup, as the
out-of-memory killer does; default) or `raise` (`FaultInjected`). Unset, every point is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

POINTS = (
    "engine.holding_weights",
    "engine.mid_load",
    "engine.generating",
    "engine.waiting",
    "engine.mid_write_round",
    "engine.mid_write_predictions",
    "engine.receiver",
    "trainer.mid_send",
    "trainer.push",
    "trainer.take",
)
ACTIONS = ("kill", "raise")
_hits: dict[str, int] = {}


class FaultInjected(RuntimeError):
    """Raised at a point whose DSPO_FAULT action is `raise`."""


@dataclass(frozen=True)
class Fault:
    point: str
    rank: int | None = None
    hit: int = 1
    action: str = "kill"


def parse_faults(text: str) -> list[Fault]:
    """`DSPO_FAULT`'s specs; ValueError naming the variable and the bad part."""
    faults = []
    for spec in filter(None, (part.strip() for part in text.split(","))):
        rest, _, action = spec.partition("=")
        rest, _, hit = rest.partition("#")
        point, _, rank = rest.partition("@")
        if point not in POINTS or (action or "kill") not in ACTIONS or not (hit or "1").isdigit():
            raise ValueError(
                f"DSPO_FAULT={text!r}: {spec!r} is not POINT[@RANK][#HIT][=ACTION] with POINT in {', '.join(POINTS)} "
                f"and ACTION in {', '.join(ACTIONS)}"
            )
        if rank and not rank.isdigit():
            raise ValueError(f"DSPO_FAULT={text!r}: the rank in {spec!r} must be a whole number")
        faults.append(Fault(point, int(rank) if rank else None, int(hit or 1), action or "kill"))
    return faults


def armed(point: str) -> bool:
    """Whether DSPO_FAULT names `point` at all (for points whose code takes another path to be interruptible)."""
    text = os.environ.get("DSPO_FAULT")
    return bool(text) and any(fault.point == point for fault in parse_faults(text))


def fault_point(point: str) -> None:
    """Act on `DSPO_FAULT` if it names this point, for this rank, at this hit; otherwise nothing."""
    text = os.environ.get("DSPO_FAULT")
    if not text:
        return
    _hits[point] = _hits.get(point, 0) + 1
    rank = int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)  # Lightning's launcher sets LOCAL_RANK
    for fault in parse_faults(text):
        if fault.point == point and fault.rank in (None, rank) and fault.hit == _hits[point]:
            if fault.action == "raise":
                raise FaultInjected(f"DSPO_FAULT: {point} on rank {rank} (hit {fault.hit})")
            os.kill(os.getpid(), signal.SIGKILL)
