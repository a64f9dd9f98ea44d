"""The retrieval cache (dspo/search/cache.py): analyzed-query keys, per-batch dedupe, LRU bound, statistics."""

from __future__ import annotations

import pickle
import threading

import pytest

from dspo.search.bm25 import BM25Index
from dspo.search.cache import CachedRetriever, cache_counts, cache_hit_rate, with_cache
from dspo.types import Passage

DOCS = [
    Passage("a", "Paris", "Paris is the capital of France."),
    Passage("b", "Berlin", "Berlin is the capital of Germany."),
    Passage("c", "Rome", "Rome is the capital of Italy."),
]


class Counting:
    """A retriever that records what reaches it."""

    def __init__(self) -> None:
        self.index = BM25Index.build(DOCS, show_progress=False)
        self.tokenizer, self.digest = self.index.tokenizer, self.index.digest
        self.calls: list[list[str]] = []

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls.append(list(queries))
        return self.index.search(queries, k)


def test_batch_is_deduplicated_and_normalized_queries_share_an_entry() -> None:
    inner = Counting()
    cached = CachedRetriever(inner, max_entries=10)
    got = cached.search(["capital of France", "Capital, of FRANCE!", "the capital of france", "germany"], 1)
    assert inner.calls == [["capital of France", "germany"]]  # one search per distinct analyzed query
    assert [hits[0].id for hits in got] == ["a", "a", "a", "b"]
    assert got == [inner.index.search([q], 1)[0] for q in ["capital of France"] * 3 + ["germany"]]
    assert cached.cache_stats() | {} == {"hits": 2, "misses": 2, "hit_rate": 0.5, "entries": 2, "max_entries": 10}
    cached.search(["france capital"], 1)  # other word order: another key (scores are summed in query order)
    cached.search(["capital of france"], 1)
    assert inner.calls[-1] == ["france capital"] and cached.hits == 3


def test_k_and_index_digest_are_part_of_the_key() -> None:
    inner = Counting()
    cached = CachedRetriever(inner, max_entries=10)
    cached.search(["italy"], 1)
    cached.search(["italy"], 2)
    inner.digest = "another-index"
    cached.search(["italy"], 1)
    assert len(inner.calls) == 3


def test_lru_evicts_least_recently_used() -> None:
    inner = Counting()
    cached = CachedRetriever(inner, max_entries=2)
    for query in ["paris", "berlin", "paris", "rome", "berlin"]:
        cached.search([query], 1)
    assert [c[0] for c in inner.calls] == ["paris", "berlin", "rome", "berlin"]  # berlin was evicted by rome
    assert cached.cache_stats()["entries"] == 2


def test_results_are_copies_and_attributes_pass_through() -> None:
    index = BM25Index.build(DOCS, show_progress=False)
    cached = with_cache(index, 4)
    first = cached.search(["rome"], 2)[0]
    first.clear()
    assert len(cached.search(["rome"], 2)[0]) == 2
    assert cached.digest == index.digest and cached.backend == "bm25s" and len(cached) == 3
    assert with_cache(index, 0) is index
    with pytest.raises(ValueError, match="cache_size must be >= 0"):
        with_cache(index, -1)
    clone = pickle.loads(pickle.dumps(cached))
    assert clone.cache_stats()["entries"] == 0 and clone.search(["rome"], 1)[0][0].id == "c"


def test_threads_share_the_cache_safely() -> None:
    cached = CachedRetriever(BM25Index.build(DOCS, show_progress=False), max_entries=3)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(200):
                cached.search([["paris", "berlin", "rome", "france", "italy"][(seed + i) % 5]], 1)
        except BaseException as err:  # noqa: BLE001 (collected for the assertion)
            errors.append(err)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and cached.hits + cached.misses == 800 and len(cached._entries) <= 3


def test_hit_rate_between_two_counts() -> None:
    cached = CachedRetriever(Counting(), max_entries=10)
    before = cache_counts(cached)
    cached.search(["paris", "paris", "rome"], 1)
    assert cache_hit_rate(before, cache_counts(cached)) == {
        "retrieval/cache_hit_rate": 1 / 3,
        "retrieval/cache_lookups": 3.0,
    }
    assert cache_counts(object()) is None and cache_hit_rate(None, None) == {}


def test_restored_keys_give_the_hits_and_evictions_of_the_cache_they_were_read_from() -> None:
    """Issue 74: a k >= 1 checkpoint stores the engine process's cached keys, not their passages; a cache restored from
    them counts the same hits and misses and evicts the same keys as the one never stopped, and returns the same
    passages (fetched at a restored key's first hit)."""
    from dspo.rollout.plain import decode, encode

    first = ["rome", "capital of France", "germany"]
    later = [["capital of France"], ["italy", "rome"], ["germany", "berlin"], ["capital of france"]]
    whole = CachedRetriever(Counting(), max_entries=3)
    whole.search(first, 1)
    keys = decode(encode(whole.keys()))  # as a checkpoint holds them
    restored = CachedRetriever(Counting(), max_entries=3)
    restored.restore(keys)
    for queries in later:
        before = (whole.hits, whole.misses), (restored.hits, restored.misses)
        assert restored.search(queries, 1) == whole.search(queries, 1)
        assert (whole.hits - before[0][0], whole.misses - before[0][1]) == (
            restored.hits - before[1][0],
            restored.misses - before[1][1],
        )
        assert restored.keys() == whole.keys()
    assert whole.hits > 0 and whole.misses > len(first)  # both hits and evictions happened
