"""MaxScore (Turtle & Flood, 1995), compiled with numba: the pruned top-k of dspo/search/prune.py.

Why compiled: the numpy version this replaces merged the essential terms' posting lists with a sort and looked every
candidate up in each other list with a binary search; at 21M passages it answered 80 queries/s on one core, and a
query whose words are all frequent took 100-530 ms. Here each essential posting is read once, the other lists are
looked up with a galloping search from where the last lookup left them, and the threshold rises as soon as a good
document is seen, so the essential set shrinks during the walk rather than once before it. numba ships with vLLM
(both the CPU and the CUDA builds).

Two additions, measured at 21M passages (one core, bench/_scale.py's queries): a lookup into a long list first asks
its lookup filter (dspo/search/lookup_filter.py), which answers most misses without a search (walk 4.6 -> 3.8 ms a
query), and the walk starts from a seeded threshold (`_seed_threshold`: 3.8 -> 3.6 ms). Through `BM25Index.search`:
192 -> 247-258 queries/s in warm reruns (229 in the pass right after the build), p99 24 -> 18-20 ms
(bench/results/retrieval.json `scale`).

Why windows rather than a document-at-a-time merge (Lucene's BooleanScorer idea): a merge compares every essential
list's head for each document and mispredicts most of those branches (166 queries/s at 21M against 214 here).

The walk sums scores in its own order (the terms' impact order), so it returns *candidates*: every document whose
approximate score reaches the final threshold within a relative margin of 1e-6 (far above float64 rounding of a
few dozen terms). The caller rescores them exactly in the dense path's order (prune.exact_scores) and ranks them,
so results stay bit-identical to the dense row, ties included.
"""

from __future__ import annotations

import numba
import numpy as np

WINDOW = 4096  # documents whose essential postings are summed at once: a multiple of 4,096 (one summary word)
SEED_DOCS = 1024  # documents of the highest-impact list scored before the walk for a first threshold
MARGIN = 1e-6  # bounds are summed in another order than exact scores: they must not cut a tie


@numba.njit(cache=True, nogil=True, inline="always")
def _reaches(bound: float, theta: float) -> bool:
    return bound * (1.0 + MARGIN) >= theta * (1.0 - MARGIN)


@numba.njit(cache=True, nogil=True, inline="always")
def _cut(theta: float) -> float:
    """A bound reaching this reaches theta: (1 - 2 MARGIN) <= (1 - MARGIN) / (1 + MARGIN), so `bound >= _cut(theta)`
    keeps every document `_reaches` keeps (a few more at most), one comparison instead of two products (-2% time)."""
    return theta * (1.0 - 2.0 * MARGIN)


_DEBRUIJN = 0x03F79D71B4CB0A89  # a de Bruijn constant: the top 6 bits of (it << i) mod 2**64 differ for each i < 64
_DEBRUIJN_SLOTS = np.zeros(64, dtype=np.int64)
for _bit in range(64):
    _DEBRUIJN_SLOTS[((_DEBRUIJN << _bit) & (2**64 - 1)) >> 58] = _bit
_DEBRUIJN = np.uint64(_DEBRUIJN)


@numba.njit(cache=True, nogil=True, inline="always")
def _lowest_bit(word: np.uint64) -> int:
    """The index of `word`'s lowest set bit (a de Bruijn multiplication: no branch, no loop)."""
    isolated = word & (~word + np.uint64(1))
    return _DEBRUIJN_SLOTS[(isolated * _DEBRUIJN) >> np.uint64(58)]


@numba.njit(cache=True, nogil=True)
def _advance(docs: np.ndarray, pos: int, end: int, target: int) -> int:
    """The first position in [pos, end) whose document is >= target (galloping, then binary search)."""
    if pos >= end or docs[pos] >= target:
        return pos
    lo, step = pos, 1  # invariant: docs[lo] < target
    hi = pos + 1
    while hi < end and docs[hi] < target:
        lo = hi
        step *= 2
        hi = lo + step
    if hi > end:
        hi = end
    lo += 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if docs[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(cache=True, nogil=True)
def _heap_push(heap: np.ndarray, size: int, value: float) -> int:
    """Push `value` on the min-heap heap[:size] (room is left); returns the new size."""
    i = size
    heap[i] = value
    while i > 0:
        parent = (i - 1) >> 1
        if heap[parent] <= heap[i]:
            break
        heap[parent], heap[i] = heap[i], heap[parent]
        i = parent
    return size + 1


@numba.njit(cache=True, nogil=True)
def _heap_replace_min(heap: np.ndarray, size: int, value: float) -> None:
    heap[0] = value
    i = 0
    while True:
        left, smallest = 2 * i + 1, i
        if left < size and heap[left] < heap[smallest]:
            smallest = left
        if left + 1 < size and heap[left + 1] < heap[smallest]:
            smallest = left + 1
        if smallest == i:
            return
        heap[smallest], heap[i] = heap[i], heap[smallest]
        i = smallest


@numba.njit(cache=True, nogil=True, inline="always")
def _filtered_out(words: np.ndarray, at: int, shift: int, doc: int) -> bool:
    """The list's lookup filter (starting at words[at]; -1: none) says `doc` is not in it."""
    if at < 0:
        return False
    block = doc >> shift
    return not (words[at + (block >> 6)] >> np.uint64(block & 63)) & np.uint64(1)


@numba.njit(cache=True, nogil=True, inline="always")
def _lookup(
    indices: np.ndarray, data: np.ndarray, pos: int, end: int, doc: int, at: int, shift: int, words: np.ndarray
) -> tuple[int, float]:
    """(the list's new cursor, `doc`'s score in the list or 0.0): the filter first, then the galloping search."""
    if _filtered_out(words, at, shift, doc):
        return pos, 0.0  # the cursor stays: later documents are larger, the search from it still holds
    p = _advance(indices, pos, end, doc)
    if p < end and indices[p] == doc:
        return p, np.float64(data[p])
    return p, 0.0


@numba.njit(cache=True, nogil=True)
def _seed_threshold(
    indices: np.ndarray,
    data: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    weight: np.ndarray,
    prefix: np.ndarray,
    k: int,
    filter_at: np.ndarray,
    filter_shift: np.ndarray,
    filter_words: np.ndarray,
) -> float:
    """A first threshold: the k-th best approximate score among the first SEED_DOCS documents of the highest-impact
    list (0.0 if it holds fewer than k). They are real documents, so the final k-th best score is at least this;
    starting the walk from it rather than 0 shrinks the essential set from the first window on (3.8 -> 3.6 ms a
    query at 21M passages). The walk still visits these documents itself: each is counted once there."""
    terms = starts.size
    if terms == 0 or k < 1:
        return 0.0
    top = terms - 1
    cursor = starts.copy()
    heap = np.empty(k, dtype=np.float64)
    size = 0
    theta = 0.0
    for p in range(starts[top], min(ends[top], starts[top] + SEED_DOCS)):
        doc = indices[p]
        score = data[p] * weight[top]
        t = top - 1
        while t >= 0 and _reaches(score + prefix[t], theta):
            cursor[t], value = _lookup(
                indices, data, cursor[t], ends[t], doc, filter_at[t], filter_shift[t], filter_words
            )
            score += value * weight[t]
            t -= 1
        if t >= 0:
            continue  # cannot reach the k-th best seen: its exact score does not matter here
        if size < k:
            size = _heap_push(heap, size, score)
        elif score > heap[0]:
            _heap_replace_min(heap, size, score)
        if size == k and heap[0] > theta:
            theta = heap[0]
    return theta


@numba.njit(cache=True, nogil=True)
def maxscore_candidates(
    indices: np.ndarray,  # [P] int32: every posting list's documents, ascending within a list
    data: np.ndarray,  # [P] float32: the postings' scores
    starts: np.ndarray,  # [T] int64: each query term's list is indices[starts[t]:ends[t]]
    ends: np.ndarray,  # [T] int64
    weight: np.ndarray,  # [T] float64: the term's repetitions in the query
    impact: np.ndarray,  # [T] float64: the term's largest possible contribution; ascending
    k: int,
    floor: float,  # a known lower bound of the k-th best score (0 when none)
    filter_at: np.ndarray,  # [T] int64: where the term's lookup filter starts in filter_words; -1: none
    filter_shift: np.ndarray,  # [T] int64: a filter bit covers 2**shift documents
    filter_words: np.ndarray,  # [W] uint64: dspo/search/lookup_filter.py
) -> tuple[np.ndarray, np.ndarray, float]:
    """(documents [C] int32 ascending, approximate scores [C] float64, final threshold): the documents that may be in
    the top k. Terms 0..e-1 are non-essential while their impacts sum below the threshold theta: a document only
    they contain cannot reach it, so documents come from the essential lists e..T-1 and the others are looked up,
    largest impact first, only while the document's partial score plus their impacts still reaches theta.

    The essential lists are read a window of WINDOW documents at a time into an accumulator (each posting one add);
    a bitmap then yields the window's documents in order, which the galloping lookups need. Before the walk, theta
    starts from the k-th best of the first SEED_DOCS documents of the highest-impact list (`_seed_threshold`)."""
    terms = starts.size
    pos = starts.copy()
    prefix = np.cumsum(impact)  # prefix[j]: the most terms 0..j can add
    heap = np.empty(max(k, 1), dtype=np.float64)
    heap_size = 0
    theta = max(
        floor, _seed_threshold(indices, data, starts, ends, weight, prefix, k, filter_at, filter_shift, filter_words)
    )
    cut = _cut(theta)  # _reaches(bound, theta) folded into one comparison for the per-document checks
    out_docs = np.empty(256, dtype=np.int32)
    out_scores = np.empty(256, dtype=np.float64)
    found = 0
    acc = np.zeros(WINDOW, dtype=np.float64)
    words = np.zeros(WINDOW // 64, dtype=np.uint64)  # bit s: slot s holds a document
    summary = np.zeros(WINDOW // 4096, dtype=np.uint64)  # bit w of summary[i]: words[64 * i + w] is not empty
    one = np.uint64(1)
    essential = 0
    while essential < terms and not _reaches(prefix[essential], theta):
        essential += 1
    no_doc = np.iinfo(np.int32).max
    while essential < terms:
        start = no_doc
        for t in range(essential, terms):
            if pos[t] < ends[t] and indices[pos[t]] < start:
                start = indices[pos[t]]
        if start == no_doc:
            break
        stop = start + WINDOW
        for t in range(essential, terms):
            p, end, w = pos[t], ends[t], weight[t]
            while p < end and indices[p] < stop:
                slot = indices[p] - start
                words[slot >> 6] |= one << np.uint64(slot & 63)
                summary[slot >> 12] |= one << np.uint64((slot >> 6) & 63)
                acc[slot] += data[p] * w
                p += 1
            pos[t] = p
        window_essential = essential  # the lists summed into acc: fixed until the window is done
        for group in range(summary.size):
            while summary[group]:
                word_at = group * 64 + _lowest_bit(summary[group])
                summary[group] &= summary[group] - one
                word = words[word_at]
                words[word_at] = 0
                while word:
                    slot = word_at * 64 + _lowest_bit(word)
                    word &= word - one
                    doc = start + slot
                    score = acc[slot]
                    acc[slot] = 0.0
                    t = window_essential - 1
                    while t >= 0 and score + prefix[t] >= cut:
                        # _lookup written out: called here, it measured 4.7 rather than 3.6 ms a query at 21M
                        if _filtered_out(filter_words, filter_at[t], filter_shift[t], doc):
                            t -= 1
                            continue
                        p = _advance(indices, pos[t], ends[t], doc)
                        pos[t] = p
                        if p < ends[t] and indices[p] == doc:
                            score += data[p] * weight[t]
                        t -= 1
                    if t >= 0 or score < cut:
                        continue
                    if found == out_docs.size:
                        out_docs = np.concatenate((out_docs, np.empty(found, dtype=np.int32)))
                        out_scores = np.concatenate((out_scores, np.empty(found, dtype=np.float64)))
                    out_docs[found] = doc
                    out_scores[found] = score
                    found += 1
                    if heap_size < k:
                        heap_size = _heap_push(heap, heap_size, score)
                    elif score > heap[0]:
                        _heap_replace_min(heap, heap_size, score)
                    if heap_size == k and k > 0 and heap[0] > theta:
                        theta = heap[0]
                        cut = _cut(theta)
        while essential < terms and not _reaches(prefix[essential], theta):
            essential += 1
    keep = np.empty(found, dtype=np.bool_)
    for i in range(found):
        keep[i] = _reaches(out_scores[i], theta)
    return out_docs[:found][keep], out_scores[:found][keep], theta
