"""Which checkpoint is healthy: the guard's bookkeeping over weight versions, free of files and trainers (issue 70).

A checkpoint holds the weights of one policy version v (the rounds completed when it was saved). Those weights sample
the round whose trajectories carry version v: the next round at `rollout.max_staleness` 0, a round k later at k >= 1,
several rounds (a span of versions) with partial rollouts. So a checkpoint's health is known only once a round that
its own weights sampled was judged, and the round judged at a round's end says nothing about the newest checkpoint at
k >= 1 (its weights have sampled nothing yet). Hence, per judged round with sampling versions [oldest, newest]:

- clean (no detector fired, none suspects the round): the newest waiting checkpoint with `last_bad < v <= oldest`
  becomes healthy (every round sampled by versions from v to `oldest` was clean: they were judged before, in order);
  the older waiting ones are superseded;
- bad (a detector fired or suspects the round): `last_bad` moves to `newest`; every waiting checkpoint up to it is
  dropped: its weights, or those it descends from, produced the round;
- a rollback target must be older than the bad round's oldest sampling weights (`target`), which the healthy one is
  unless partial rollouts carried an older episode into the round: then there is none (the guard backs off).

Departs from the guard of issue 55, which promoted the newest checkpoint at the next clean round whatever sampled it:
right at k = 0 (where both rules agree), wrong at k >= 1, where a rollback could land on the checkpoint that produced
the collapse.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dspo.types import SavedCheckpoint


@dataclass
class HealthLedger:
    """Waiting checkpoints (saved, not yet judged by a round their weights sampled), the healthy one, and the newest
    version that sampled a bad round."""

    waiting: list[SavedCheckpoint] = field(default_factory=list)  # ascending version
    healthy: SavedCheckpoint | None = None
    last_bad: int = -1

    def saved(self, checkpoint: SavedCheckpoint) -> bool:
        """A new round checkpoint waits for its judgement; False (nothing recorded) when it is not newer than every
        checkpoint known, or its weights already sampled a bad round."""
        newest = max([c.version for c in self.waiting] + [self.healthy.version if self.healthy else -1])
        if checkpoint.version <= max(newest, self.last_bad):
            return False
        self.waiting.append(checkpoint)
        return True

    def clean(self, oldest: int) -> tuple[SavedCheckpoint | None, list[SavedCheckpoint]]:
        """A round sampled by versions >= `oldest` was clean. Returns (the checkpoint that became healthy or None,
        every waiting checkpoint judged now, the promoted one included: none waits any longer)."""
        judged = [c for c in self.waiting if c.version <= oldest]
        self.waiting = [c for c in self.waiting if c.version > oldest]
        eligible = [c for c in judged if c.version > self.last_bad]
        promoted = eligible[-1] if eligible else None
        if promoted is not None:
            self.healthy = promoted
        return promoted, judged

    def bad(self, newest: int) -> list[SavedCheckpoint]:
        """A round sampled by versions <= `newest` was bad. Returns the waiting checkpoints dropped."""
        self.last_bad = max(self.last_bad, newest)
        dropped = [c for c in self.waiting if c.version <= self.last_bad]
        self.waiting = [c for c in self.waiting if c.version > self.last_bad]
        return dropped

    def target(self, bound: int | None) -> SavedCheckpoint | None:
        """The healthy checkpoint, if it is older than `bound` (the bad round's oldest sampling version; None: no
        round bound, a validation drop)."""
        if self.healthy is None or (bound is not None and self.healthy.version >= bound):
            return None
        return self.healthy

    def state_dict(self) -> dict[str, Any]:
        return {
            "waiting": [asdict(c) for c in self.waiting],
            "healthy": asdict(self.healthy) if self.healthy else None,
            "last_bad": self.last_bad,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> HealthLedger:
        healthy = state.get("healthy")
        return cls(
            waiting=[SavedCheckpoint(**c) for c in state.get("waiting", [])],
            healthy=SavedCheckpoint(**healthy) if healthy else None,
            last_bad=int(state.get("last_bad", -1)),
        )
