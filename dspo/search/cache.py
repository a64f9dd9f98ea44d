"""An LRU cache in front of a retriever, with per-batch deduplication and hit statistics.

A training round sends the same query many times: the G samples of one question often search the same words, and
later rounds revisit the same questions. Keys are (the query's analyzed tokens, k, the index digest): two queries that
differ only in case, punctuation or stop words share an entry, since the index would rank them identically (word
order stays in the key: scores are summed in query order, and float sums may differ in the last bit), and an entry
never outlives a change of index. Within one `search` call each distinct key is searched once.
`cache_stats()` feeds `retrieval/cache_hit_rate` in the rollout statistics and dspo-serve's `/health`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from dspo.search.base import Retriever
from dspo.types import Passage


class CachedRetriever:
    """`retriever` behind an LRU of `max_entries` results; other attributes are the wrapped retriever's."""

    def __init__(self, retriever: Retriever, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError(f"cache_size must be >= 1 (0 turns the cache off in the config), got {max_entries}")
        self.retriever = retriever
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, list[Passage]] = OrderedDict()
        self._lock = threading.Lock()  # tool calls may come from several threads of one agent
        self.hits = self.misses = 0

    def __getattr__(self, name: str) -> Any:  # digest, backend, passages, retries, ... of the wrapped retriever
        if name.startswith("__") or name in ("retriever", "_entries", "_lock"):
            raise AttributeError(name)
        return getattr(self.retriever, name)

    def __len__(self) -> int:
        return len(self.retriever)  # type: ignore[arg-type]

    def __getstate__(self) -> dict:
        return {"retriever": self.retriever, "max_entries": self.max_entries}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["retriever"], state["max_entries"])

    def _key(self, query: str, k: int, digest: str | None) -> tuple:
        tokenizer = getattr(self.retriever, "tokenizer", None)
        words = tuple(tokenizer(query)) if tokenizer is not None else (" ".join(query.split()),)
        return words, k, digest

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        if isinstance(queries, str):
            raise TypeError("search() takes a list of queries, not a single string")
        digest = getattr(self.retriever, "digest", None)  # once per call: an index computes it by hashing
        keys = [self._key(query, k, digest) for query in queries]
        found: dict[tuple, list[Passage] | None] = {}
        with self._lock:
            for key in dict.fromkeys(keys):
                if key in self._entries:
                    self._entries.move_to_end(key)
                    found[key] = self._entries[key]
        missing: dict[tuple, str] = {}
        restored: dict[tuple, str] = {}  # hits on keys `restore` put back, whose passages are fetched now
        for key, query in zip(keys, queries, strict=True):
            if key not in found:
                missing.setdefault(key, query)
            elif found[key] is None:
                restored.setdefault(key, query)
        if missing or restored:
            fetch = {**missing, **restored}
            fresh = self.retriever.search(list(fetch.values()), k)
            found.update(zip(fetch, fresh, strict=True))
            with self._lock:
                for key in restored:  # a hit: it keeps the place its lookup gave it
                    if key in self._entries:
                        self._entries[key] = found[key]
                for key in missing:
                    self._entries[key] = found[key]
                    self._entries.move_to_end(key)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        with self._lock:
            self.misses += len(missing)
            self.hits += len(queries) - len(missing)
        return [list(found[key]) for key in keys]

    def keys(self) -> list[tuple]:
        """The cached keys, least recently used first: what decides the hits to come (a checkpoint of a k >= 1 run
        stores them, dspo.rollout.in_flight)."""
        with self._lock:
            return list(self._entries)

    def restore(self, keys: list[tuple]) -> None:
        """Cache `keys` (from `keys`), in that order, their passages fetched at their first hit: the hits and misses to
        come are those of the cache they were read from, without storing its passages."""
        with self._lock:
            self._entries = OrderedDict((tuple(key), None) for key in keys[-self.max_entries :])

    def cache_stats(self) -> dict:
        with self._lock:
            lookups = self.hits + self.misses
            return {
                "hits": self.hits,
                "misses": self.misses,
                "hit_rate": self.hits / lookups if lookups else 0.0,
                "entries": len(self._entries),
                "max_entries": self.max_entries,
            }


def with_cache(retriever: Retriever, cache_size: int) -> Retriever:
    """`retriever` behind a `CachedRetriever` of `cache_size` entries; unchanged when cache_size is 0."""
    if cache_size < 0:
        raise ValueError(f"cache_size must be >= 0 (0: no cache), got {cache_size}")
    return CachedRetriever(retriever, cache_size) if cache_size else retriever


def cache_counts(retriever: object) -> tuple[int, int] | None:
    """(hits, misses) so far of a retriever with a cache, else None."""
    stats = getattr(retriever, "cache_stats", None)
    if stats is None:
        return None
    counts = stats()
    return counts["hits"], counts["misses"]


def cache_hit_rate(before: tuple[int, int] | None, after: tuple[int, int] | None) -> dict[str, float]:
    """`retrieval/cache_hit_rate` and `retrieval/cache_lookups` between two `cache_counts` (none without a cache)."""
    if before is None or after is None:
        return {}
    hits, lookups = after[0] - before[0], after[0] + after[1] - before[0] - before[1]
    return {"retrieval/cache_hit_rate": hits / lookups if lookups else 0.0, "retrieval/cache_lookups": float(lookups)}
