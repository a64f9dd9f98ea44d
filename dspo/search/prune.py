"""Top-k BM25 without scoring every matching document: MaxScore pruning over the bm25s CSC matrix.

The dense path (`_Bm25sEngine.score_rows`) sums a query's posting lists into an [N] row: at 21M passages that is an
84 MB row per query and tens of milliseconds. MaxScore (Turtle & Flood, 1995) skips most of it: with the terms
sorted by their largest possible contribution (`term_max`, stored by the streamed build, times the term's
repetitions in the query), the longest prefix whose contributions sum below the threshold theta (the k-th best
score so far) is "non-essential": a document only those terms contain cannot reach the top k. Documents come from
the essential lists; the others are looked up only while a document's partial score plus what they can add still
reaches theta. The walk is compiled (dspo/search/maxscore.py) and returns candidates; they are scored here.

Exactness: candidate scores are summed in float64 over the query's terms in query order, the order the dense
path's `np.bincount` adds them, so scores are bit-identical, and ties go to the lower document index, as in
`dspo.search.bm25._top_k` (checked against it in tests/search/test_prune.py). When fewer than k documents score
above zero, the rest are the first zero-score documents in corpus order, as there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the filter module compiles with numba: imported only where an index is large enough to prune
    from dspo.search.lookup_filter import LookupFilter

_NO_WORDS = np.zeros(0, dtype=np.uint64)
TERM_MAX = "term_max.npy"  # beside the bm25s matrices: each term's highest score, the bound MaxScore prunes by
LOOKUP_FILTER = "lookup_filter"  # beside them too: dspo/search/lookup_filter.py, written for indexes that prune


@dataclass(frozen=True)
class CscMatrix:
    """bm25s's eager score matrix: column t holds term t's postings (document ids ascending) and their scores."""

    data: np.ndarray  # [P] float32
    indices: np.ndarray  # [P] int32 document ids
    indptr: np.ndarray  # [V + 1] int64
    term_max: np.ndarray  # [V] float32: the largest score in each column
    num_docs: int
    lookup: LookupFilter | None = None  # which blocks of documents the long columns touch (lookup_filter.py)

    def postings(self, term: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = int(self.indptr[term]), int(self.indptr[term + 1])
        return self.indices[lo:hi], self.data[lo:hi]


def term_weights(matrix: CscMatrix, term: int, candidates: np.ndarray) -> np.ndarray:
    """Term `term`'s score [C] float64 in each of the sorted unique `candidates` (0 where absent).

    The cheaper direction is taken: a short list is located in the candidates, or the candidates are looked up in a
    long list (both binary searches over sorted arrays)."""
    out = np.zeros(candidates.size, dtype=np.float64)
    docs, weights = matrix.postings(term)
    if docs.size == 0 or candidates.size == 0:
        return out
    if docs.size <= candidates.size:
        at = np.searchsorted(candidates, docs)
        inside = at < candidates.size
        found = np.zeros(docs.size, dtype=bool)
        found[inside] = candidates[at[inside]] == docs[inside]
        out[at[found]] = weights[found]
    else:
        at = np.minimum(np.searchsorted(docs, candidates), docs.size - 1)
        found = docs[at] == candidates
        out[found] = weights[at[found]]
    return out


def exact_scores(matrix: CscMatrix, candidates: np.ndarray, terms: list[int]) -> np.ndarray:
    """Scores [C] float64 of sorted unique `candidates`, adding each query term (repeats included) in query order
    (adding 0.0 where a term is absent leaves a sum unchanged, so this is the dense row's arithmetic)."""
    scores = np.zeros(candidates.size, dtype=np.float64)
    for term in terms:
        scores += term_weights(matrix, term, candidates)
    return scores


def rank(candidates: np.ndarray, scores: np.ndarray, k: int, num_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (document, score) pairs, best first, ties to the lower document; zero-score fill in corpus order."""
    positive = scores > 0
    cand, sub = candidates[positive], scores[positive]
    if cand.size > k:
        threshold = np.partition(sub, sub.size - k)[sub.size - k]
        keep = sub >= threshold
        cand, sub = cand[keep], sub[keep]
    order = np.lexsort((cand, -sub))[:k]
    docs, best = cand[order].astype(np.int64), sub[order]
    missing = min(k, num_docs) - docs.size
    if missing > 0:  # fewer than k positive scores: the first other documents, in corpus order, score zero
        taken, fill, doc = set(docs.tolist()), [], 0
        while len(fill) < missing:
            if doc not in taken:
                fill.append(doc)
            doc += 1
        docs = np.concatenate([docs, np.asarray(fill, dtype=np.int64)])
        best = np.concatenate([best, np.zeros(missing)])
    return docs, best


def pruned_top_k(matrix: CscMatrix, terms: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (document ids [k], scores [k] float64) of a query given as term ids (repeats count again).

    A first threshold from the long lists' best-scored heads (impact tiers) was tried in front of the walk: it cost
    more than it saved at every size (21M passages: 189 against 214 queries/s; 1M: 1,287 against 1,978)."""
    from dspo.search.maxscore import maxscore_candidates  # numba compiles on first use: only large indexes pay

    k = min(k, matrix.num_docs)
    if not terms:
        return rank(np.zeros(0, dtype=np.int32), np.zeros(0), k, matrix.num_docs)
    unique, repeats = np.unique(np.asarray(terms, dtype=np.int64), return_counts=True)
    impact = matrix.term_max[unique].astype(np.float64) * repeats
    order = np.argsort(impact, kind="stable")
    unique, repeats, impact = unique[order], repeats[order], impact[order]
    starts = matrix.indptr[unique].astype(np.int64, copy=False)
    ends = matrix.indptr[unique + 1].astype(np.int64, copy=False)
    if matrix.lookup is None:
        at, shift, words = np.full(unique.size, -1, dtype=np.int64), np.zeros(unique.size, np.int64), _NO_WORDS
    else:
        at, shift, words = matrix.lookup.offset[unique], matrix.lookup.shift[unique], matrix.lookup.words
    # candidates come back ascending and unique, as exact_scores needs them
    candidates, _, _ = maxscore_candidates(
        matrix.indices, matrix.data, starts, ends, repeats.astype(np.float64), impact, k, 0.0, at, shift, words
    )
    return rank(candidates, exact_scores(matrix, candidates, terms), k, matrix.num_docs)
