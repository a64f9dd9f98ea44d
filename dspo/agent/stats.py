"""What kind each statistic of an agent's rollout call is, declared by the code that produces it.

An agent's `AgentRollout.stats` are per call; a round makes several calls, and `dspo.rollout.sampler.RoundSampler`
folds them into the round's `rollout/<key>` by the key's `Kind`: counts add up, means are weighted by the trajectories
of the calls that reported them, and a call-only figure (timers, the call's own token count) is left to the round,
which computes its own from the groups. Each producer owns its table (`dspo.agent.accounting.CALL_STAT_KINDS`,
`dspo.agent.compaction.STAT_KINDS`, the endpoint agent's), and an agent names the union as its `stat_kinds`.

A key is declared exactly (`"compactions"`) or as a family, a name ending in "/" that covers every key under it
(`"invalid/"`: `invalid/<tool>/<kind>`); an exact declaration wins over a family. A key that no table declares is
kept as a mean and warned about once (`kind_of`), never dropped.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Kind(enum.Enum):
    SUM = "sum"  # a count: the round's figure is the sum over its calls
    MEAN = "mean"  # a per-trajectory mean: the round's is weighted by each call's trajectories
    CALL = "call"  # the call's own figure; the round computes its own from the groups (or does not log it)


_warned: set[str] = set()


def kind_of(key: str, kinds: Mapping[str, Kind]) -> Kind:
    """`key`'s declared kind in `kinds` (exact, then the longest family); an undeclared key is a mean, with a warning
    the first time it is seen."""
    if key in kinds:
        return kinds[key]
    families = [name for name in kinds if name.endswith("/") and key.startswith(name)]
    if families:
        return kinds[max(families, key=len)]
    if key not in _warned:
        _warned.add(key)
        log.warning(
            "rollout statistic %r has no declared kind (sum, mean or call): logged as rollout/%s, averaged over the "
            "round's trajectories. Declare it in the agent's stat_kinds (dspo.agent.stats)",
            key,
            key,
        )
    return Kind.MEAN
