"""Lookup filters (dspo/search/lookup_filter.py): the hand-computed layout, no posting ever filtered out, and the
filters an index writes, loads memory-mapped, and rebuilds when they are missing or stale."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dspo.search import lookup_filter, streamed
from dspo.search.bm25 import BM25Index
from dspo.search.prune import LOOKUP_FILTER
from dspo.types import Passage


def test_layout_gives_long_lists_about_eight_bits_per_posting() -> None:
    # 1,024 documents: lists need 1024 / 256 = 4 postings. df 4 -> 1024 / 32 = 32 documents a bit (shift 5),
    # 32 bits: one word; df 200 -> a bit per document (shift 0), 1,024 bits: 16 words; df 3 and 0 -> none
    offset, shift, total = lookup_filter.layout(np.cumsum([0, 4, 3, 200, 0]), num_docs=1024)
    assert offset.tolist() == [0, -1, 1, -1] and shift.tolist() == [5, 0, 0, 0] and total == 17


@pytest.mark.parametrize("seed", range(4))
def test_every_posting_has_its_bit_and_most_other_blocks_do_not(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_docs = 50_000
    lists = [np.sort(rng.choice(num_docs, size=int(rng.integers(1, 20_000)), replace=False)) for _ in range(12)]
    indices = np.concatenate(lists).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum([lst.size for lst in lists])])
    lookup = lookup_filter.build(indices, indptr, num_docs)
    for t, docs in enumerate(lists):
        if lookup.offset[t] < 0:
            assert docs.size * lookup_filter.MIN_DF_DIVISOR < num_docs
            continue
        blocks = np.arange(num_docs) >> lookup.shift[t]
        words = lookup.words[lookup.offset[t] + (blocks >> 6)]
        marked = ((words >> (blocks & 63).astype(np.uint64)) & np.uint64(1)).astype(bool)
        assert marked[docs].all()  # a filter never answers "absent" for a document the list holds
        absent = np.setdiff1d(np.arange(num_docs), docs)
        assert marked[absent].mean() < 0.25  # ~1 bit in 8 set: most misses are answered by the filter


def random_passages(n: int) -> list[Passage]:
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    return [Passage(str(i), "", " ".join(rng.choice(words, size=8))) for i in range(n)]


def test_a_pruning_index_writes_its_filters_and_loads_them_memory_mapped(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(streamed, "PRUNE_MIN_DOCS", 100)
    passages = random_passages(300)
    (tmp_path / "ix").mkdir()
    streamed.build_streamed(passages, tmp_path / "ix", str.split, 1.2, 0.75, show_progress=False, workers=0)
    assert (tmp_path / "ix" / LOOKUP_FILTER / "words.npy").is_file()
    loaded = lookup_filter.load(tmp_path / "ix" / LOOKUP_FILTER)
    assert isinstance(loaded.words.base, np.memmap) or isinstance(loaded.words, np.memmap)
    indices = np.load(tmp_path / "ix" / "bm25s" / "indices.csc.index.npy")
    indptr = np.load(tmp_path / "ix" / "bm25s" / "indptr.csc.index.npy")
    fresh = lookup_filter.build(indices, indptr, 300)
    assert np.array_equal(fresh.words, loaded.words) and np.array_equal(fresh.offset, loaded.offset)


def test_missing_or_stale_filters_are_built_in_memory(tmp_path, caplog) -> None:
    index = BM25Index.build(random_passages(300), show_progress=False)
    index.save(tmp_path / "ix")  # 300 < PRUNE_MIN_DOCS: no filters written
    assert not (tmp_path / "ix" / LOOKUP_FILTER).exists()
    loaded = BM25Index.load(tmp_path / "ix", mmap=True)
    loaded.engine.prune_min_docs = 0
    with caplog.at_level(logging.INFO, logger="dspo.search.lookup_filter"):
        hits = loaded.search(["w1 w2 w3"], 3)
    assert "building them in memory" in caplog.text and loaded.engine.pruning_matrix().lookup is not None
    other = lookup_filter.build(np.zeros(2, np.int32), np.array([0, 1, 2]), 300, tmp_path / "ix" / LOOKUP_FILTER)
    assert other.offset.size == 2  # a vocabulary of 2: not this index's
    again = BM25Index.load(tmp_path / "ix", mmap=True)
    again.engine.prune_min_docs = 0
    with caplog.at_level(logging.WARNING, logger="dspo.search.lookup_filter"):
        assert again.search(["w1 w2 w3"], 3) == hits
    assert "does not match" in caplog.text


def test_saved_filters_whose_layout_differs_are_never_used(tmp_path, caplog) -> None:
    # the walk reads the words without bounds checks: a tampered offset or a truncated words file must be rebuilt
    indices = np.arange(0, 1000, 3, dtype=np.int32)
    indptr = np.array([0, indices.size], dtype=np.int64)
    good = lookup_filter.build(indices, indptr, 1000)
    folder = tmp_path / "filters"
    for tamper in ("offset", "words"):
        lookup_filter.build(indices, indptr, 1000, folder)
        if tamper == "offset":
            np.save(folder / "offset.npy", np.array([10**9], dtype=np.int64))
        else:
            np.save(folder / "words.npy", np.zeros(1, dtype=np.uint64))
        with caplog.at_level(logging.WARNING, logger="dspo.search.lookup_filter"):
            caplog.clear()
            used = lookup_filter.load_or_build(folder, indices, indptr, 1000)
        assert "does not match" in caplog.text, tamper
        assert np.array_equal(used.words, good.words) and np.array_equal(used.offset, good.offset)
