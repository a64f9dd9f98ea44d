"""Lookup filters: which blocks of documents a long posting list touches, one bit per block, so the MaxScore walk
(dspo/search/maxscore.py) can answer "this document is not in that list" without searching the list.

Why: at 21M passages most of the walk's ~100k lookups per query go to long lists (frequent words) and most of them
miss. A galloping search pays several unpredictable branches and a cache line of the list for each miss; a bit test
pays one read of a small array, and its branch is predictable because misses dominate. Measured on the synthetic
21M index (bench/_scale.py queries, one core): walk 4.6 ms -> 3.8 ms per query. It is a filter, not an index: a set
bit still needs the search (the block may hold other documents), so answers do not change.

Layout: term t's filter is `words[offset[t] : offset[t] + ceil(blocks / 64)]`, a bit per block of `2**shift[t]`
documents, with the block size chosen so a list's filter has about `BITS_PER_POSTING` bits per posting (at most one
bit per document). Only lists holding at least `1 / MIN_DF_DIVISOR` of the documents get one (offset -1 otherwise):
at 21M passages that is 1,761 terms and 0.75 GiB (6% of the matrix), built in 4 s and written by the build beside it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np

BITS_PER_POSTING = 8  # about 1 bit in 8 set: most lookups that miss the list also miss the filter
MIN_DF_DIVISOR = 256  # filtering lists down to N/1,024 too: 3.67 against 3.72 ms at 21M, for 1.5x the memory
_NAMES = ("words", "offset", "shift")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookupFilter:
    words: np.ndarray  # [W] uint64: every filtered term's bits, one filter after another
    offset: np.ndarray  # [V] int64: where term t's filter starts in words; -1 for a list without one
    shift: np.ndarray  # [V] int64: one bit of term t's filter covers documents [i << shift, (i + 1) << shift)


def layout(indptr: np.ndarray, num_docs: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(offset [V], shift [V], total words) for a CSC matrix's lists (`indptr` [V + 1])."""
    df = np.diff(np.asarray(indptr, dtype=np.int64))
    filtered = df * MIN_DF_DIVISOR >= max(num_docs, 1)  # so df >= 1 where filtered
    shift = np.zeros(df.size, dtype=np.int64)
    ratio = num_docs / (BITS_PER_POSTING * df[filtered])  # documents per bit at BITS_PER_POSTING; at least 1
    shift[filtered] = np.floor(np.log2(np.maximum(ratio, 1.0))).astype(np.int64)
    blocks = ((max(num_docs, 1) - 1) >> shift) + 1
    sizes = np.where(filtered, (blocks + 63) // 64, 0)
    offset = np.where(filtered, np.cumsum(sizes) - sizes, -1).astype(np.int64)
    return offset, shift, int(sizes.sum())


@numba.njit(cache=True, nogil=True)
def _mark(indices: np.ndarray, indptr: np.ndarray, offset: np.ndarray, shift: np.ndarray, words: np.ndarray) -> None:
    one = np.uint64(1)
    for t in range(offset.size):
        at = offset[t]
        if at < 0:
            continue
        s = shift[t]
        for p in range(indptr[t], indptr[t + 1]):
            block = indices[p] >> s
            words[at + (block >> 6)] |= one << np.uint64(block & 63)


def build(indices: np.ndarray, indptr: np.ndarray, num_docs: int, directory: Path | None = None) -> LookupFilter:
    """Filters for every long list of the matrix (`indices` [P] int32, `indptr` [V + 1]). With `directory`, the
    arrays are written there (the words straight into a memory-mapped file) and the returned filter maps them."""
    offset, shift, total = layout(indptr, num_docs)
    if directory is None:
        words = np.zeros(total, dtype=np.uint64)
    else:
        directory.mkdir(parents=True, exist_ok=True)
        words = np.lib.format.open_memmap(directory / "words.npy", mode="w+", dtype=np.uint64, shape=(total,))
    if total:
        _mark(indices, np.asarray(indptr, dtype=np.int64), offset, shift, words)
    if directory is None:
        return LookupFilter(words, offset, shift)
    words.flush()
    del words
    np.save(directory / "offset.npy", offset)
    np.save(directory / "shift.npy", shift)
    return load(directory)


def load(directory: Path) -> LookupFilter:
    """The filters written by `build(..., directory)`, the words memory-mapped (shared by worker processes)."""
    words = np.load(directory / "words.npy", mmap_mode="r")
    return LookupFilter(np.asarray(words), np.load(directory / "offset.npy"), np.load(directory / "shift.npy"))


def load_or_build(directory: Path | None, indices: np.ndarray, indptr: np.ndarray, num_docs: int) -> LookupFilter:
    """The saved filters if `directory` holds them and their layout is this matrix's, else filters built in memory.

    The layout is checked in full (every offset and shift, and the words' count): the walk reads the words without
    bounds checks, so filters from another index or another build must never reach it."""
    if directory is not None and all((directory / f"{name}.npy").is_file() for name in _NAMES):
        saved = load(directory)
        offset, shift, total = layout(indptr, num_docs)
        fits = saved.words.size == total and np.array_equal(saved.offset, offset) and np.array_equal(saved.shift, shift)
        if fits:
            return saved
        log.warning("%s does not match this index's layout: rebuilding the lookup filters in memory", directory)
    elif directory is not None:
        log.info("no lookup filters in %s (an index from an older build): building them in memory", directory.parent)
    return build(indices, indptr, num_docs)
