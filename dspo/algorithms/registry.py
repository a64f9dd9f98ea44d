"""One registry shape for every choice an algorithm config makes by name: objectives (`algorithm.loss`), group filters
(`algorithm.filter`), advantage estimators (`algorithm.advantage`).

Each entry is a record (a frozen dataclass: the function and what the trainer must know about it, declared next to it)
rather than parallel dicts of properties; an unknown name is refused with the config key and the known names. A
setting of an entry is a field of its `settings` dataclass, whose defaults are the entry's; `make_settings` validates
a config's keyword arguments against it and names the key of the one that is wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named records of one kind, selected by the config key `config_key`."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind, self.config_key = kind, config_key
        self._records: dict[str, T] = {}

    def add(self, name: str, record: T) -> None:
        """Register (or replace: a user module imported twice registers the same names again)."""
        self._records[name] = record

    def pop(self, name: str, default: T | None = None) -> T | None:
        """Remove an entry (tests that register temporary ones)."""
        return self._records.pop(name, default)

    def __getitem__(self, name: str) -> T:
        try:
            return self._records[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} '{name}' (config key {self.config_key}); choose one of {sorted(self._records)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def items(self):
        return self._records.items()


def make_settings(defaults: Any, kwargs: Mapping[str, Any] | None, config_key: str, owner: str) -> Any:
    """`defaults` (a dataclass instance, or None for an entry without settings) with `kwargs` applied; an unknown key
    is refused naming `config_key.<key>` and the entry's settings. The dataclass validates values itself."""
    kwargs = dict(kwargs or {})
    known = [f.name for f in dataclasses.fields(defaults)] if defaults is not None else []
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        have = f"its settings: {', '.join(known)}" if known else "it has no settings"
        raise ValueError(f"{config_key}.{unknown[0]}: {owner} has no setting '{unknown[0]}' ({have})")
    return dataclasses.replace(defaults, **kwargs) if defaults is not None else None
