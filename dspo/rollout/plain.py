"""Rollout records as plain data a checkpoint can hold and `torch.load(weights_only=True)` can read (issue 74).

In-flight rounds and carried episodes are dataclasses (`RolloutGroup`, `Trajectory`, `Episode`, ...) with Counters,
tuples and dicts keyed by tuples inside. Pickling them would make a checkpoint something only the full unpickler reads
(docs/security.md: a checkpoint is loaded with torch's safe loader, never unpickled). Here every node becomes a dict,
list, str, number, None, tuple or tensor: a dataclass is `{"__dc__": name, "f": {field: value}}` with its name looked
up in `_allowed()` on the way back (no other type can be built from a checkpoint), a Counter, a tuple or a dict with
non-string keys a tagged list of pairs.

Departure from a plain encoder: long runs of ints or floats are packed into one tensor each (uint8 for 0..255, else
int32 or int64; float32 when every value round-trips through it exactly, else float64), so a round of 512 groups x 5
trajectories x 4k tokens is a few tensors per trajectory (ids int32, engine logprobs float32, mask one byte a token),
not millions of pickled Python numbers; `decode` gives back the same Python ints and floats, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch

PACK_MIN = 8  # lists at least this long of only ints (or only floats) travel as one tensor
_INT32 = (-(2**31), 2**31 - 1)


def _allowed() -> dict[str, type]:
    """The only classes `decode` builds: the records of a round and of an episode in progress."""
    from dspo.agent.compaction import Spliced
    from dspo.agent.episode import Episode
    from dspo.agent.parsing import ParsedCall
    from dspo.agent.partial import CarriedGroup
    from dspo.env.rewards import TurnRecord
    from dspo.env.tools import ToolResult
    from dspo.rollout.messages import SampledRound
    from dspo.types import Passage, QAItem, RolloutGroup, Segment, Trajectory

    classes = (Spliced, Episode, ParsedCall, CarriedGroup, TurnRecord, ToolResult, SampledRound)
    return {cls.__name__: cls for cls in (*classes, Passage, QAItem, RolloutGroup, Segment, Trajectory)}


def encode(value: Any) -> Any:
    """`value` as plain data (module docstring); TypeError naming the type for anything else (a set, an object)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if type(value) in (int, float):
        return value
    if isinstance(value, list):
        packed = _packed(value)
        return packed if packed is not None else [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, Counter):
        return {"__counter__": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__map__": [[encode(k), encode(v)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if _allowed().get(name) is not type(value):
            raise TypeError(f"{name} cannot be stored in a checkpoint's in-flight rounds (not in dspo.rollout.plain)")
        return {"__dc__": name, "f": {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    raise TypeError(f"{type(value).__name__} cannot be stored in a checkpoint's in-flight rounds")


def _packed(values: list) -> torch.Tensor | None:
    """One tensor for a long list of only ints or only floats (exact: see the module docstring), else None."""
    if len(values) < PACK_MIN:
        return None
    kinds = {type(v) for v in values}
    if kinds == {int}:
        low, high = min(values), max(values)
        dtype = torch.uint8 if low >= 0 and high <= 255 else torch.int32  # masks and versions: a byte a token
        return torch.tensor(values, dtype=dtype if _INT32[0] <= low and high <= _INT32[1] else torch.int64)
    if kinds == {float}:
        single = torch.tensor(values, dtype=torch.float32)
        return single if single.tolist() == values else torch.tensor(values, dtype=torch.float64)
    return None


def decode(value: Any) -> Any:
    """The value `encode` was given (dataclasses only of `ALLOWED` types; anything else is a ValueError)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__counter__" in value:
        return Counter({_key(decode(k)): decode(v) for k, v in value["__counter__"]})
    if "__map__" in value:
        return {_key(decode(k)): decode(v) for k, v in value["__map__"]}
    if "__dc__" in value:
        return _dataclass(value["__dc__"], value["f"])
    return {k: decode(v) for k, v in value.items()}


def _key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key  # a key was hashable: a list can only have been a tuple


def _dataclass(name: str, fields: dict[str, Any]) -> Any:
    cls = _allowed().get(name)
    if cls is None:
        raise ValueError(f"a checkpoint's in-flight rounds name the type {name!r}, which dspo does not build from one")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(fields) - set(known)
    if unknown:
        raise ValueError(f"a checkpoint's in-flight {name} has fields this dspo does not know: {sorted(unknown)}")
    given = {k: decode(v) for k, v in fields.items()}
    instance = cls(**{k: v for k, v in given.items() if known[k].init})
    for k, v in given.items():
        if not known[k].init:
            object.__setattr__(instance, k, v)
    return instance
