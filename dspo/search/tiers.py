"""Exact top-k from each long posting list's best-scored head: impact tiers over the bm25s CSC matrix.

MaxScore (dspo/search/prune.py) still reads every essential term's whole posting list; at 21M passages a query with
a frequent word reads millions of postings. Here each list longer than `head_size` keeps its `head_size`
best-scored postings (its head, stored in document order) and the largest score of the rest (`rest_max`); shorter
lists are their own heads (rest 0). A query then reads heads only:

1. Candidates: the documents of the query terms' heads. For each, the head scores it appears in give a lower
   bound of its score, and adding `rest_max` of every term whose head it is not in gives an upper bound.
2. theta: the k-th best of the lower bounds and of the exact scores of the PROBE candidates with the best upper
   bounds; the final k-th score is at least theta.
3. A document in no head scores at most R = the sum of the terms' `rest_max` (times each term's repetitions). If
   R < theta, no such document can be in the top k (with a float margin, so not even as a tie); the candidates
   whose upper bound reaches theta are scored exactly with every query term (prune.exact_scores, the dense path's
   order, so bit-identical) and ranked as the dense path ranks.
4. Otherwise the query falls back to MaxScore, seeded with theta as its first threshold.

This is the two-tier index idea (Long & Suel; Fagin's threshold algorithm) with an exactness test per query rather
than an approximate early stop, as score-at-a-time engines (JASS) do: the ranking stays the dense path's, tested in
tests/search/test_tiers.py against it on random tie-heavy corpora.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from dspo.search.prune import CscMatrix, exact_scores, merge_postings, pruned_top_k, rank

TIERS_DIR = "impact_tiers"  # beside the bm25s matrices
HEAD_SIZE = 1024  # postings kept per long list (measured at 21M: bench/results/retrieval.json `scale`)
_FILES = ("indptr", "docs", "scores", "rest_max")
PROBE = 32  # candidates scored exactly to set the threshold
_MARGIN = 1e-6  # bounds are summed in another order than exact scores: they must not cut a tie


@dataclass(frozen=True)
class ImpactTiers:
    """The heads of the lists longer than `head_size` (shorter lists are read whole from the matrix)."""

    head_size: int
    indptr: np.ndarray  # [V + 1] int64: term t's head is docs/scores[indptr[t]:indptr[t + 1]] (empty: short list)
    docs: np.ndarray  # [H] int32, ascending within a head
    scores: np.ndarray  # [H] float32
    rest_max: np.ndarray  # [V] float32: the largest score outside the head (0 for short lists)

    def head(self, matrix: CscMatrix, term: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(documents, scores, rest bound) of `term`: its head, or its whole list when that is short."""
        lo, hi = int(self.indptr[term]), int(self.indptr[term + 1])
        if lo == hi:
            docs, scores = matrix.postings(term)
            return docs, scores, 0.0
        return self.docs[lo:hi], self.scores[lo:hi], float(self.rest_max[term])

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for name in _FILES:
            np.save(directory / f"{name}.npy", getattr(self, name))
        (directory / "tiers.json").write_text(json.dumps({"head_size": self.head_size}) + "\n")

    @classmethod
    def load(cls, directory: Path, mmap: bool) -> ImpactTiers | None:
        """The tiers saved in `directory`, or None when there are none (an index built before them)."""
        meta = directory / "tiers.json"
        if not meta.is_file():
            return None
        mode = "r" if mmap else None
        arrays = {name: np.load(directory / f"{name}.npy", mmap_mode=mode, allow_pickle=False) for name in _FILES}
        return cls(head_size=int(json.loads(meta.read_text())["head_size"]), **arrays)


def build_tiers(matrix: CscMatrix, head_size: int = HEAD_SIZE, show_progress: bool = False) -> ImpactTiers:
    """Each list longer than `head_size`: its `head_size` best-scored postings in document order, and the best
    score left out."""
    if head_size < 1:
        raise ValueError(f"head_size must be >= 1, got {head_size}")
    lengths = np.diff(matrix.indptr)
    long_terms = np.flatnonzero(lengths > head_size)
    indptr = np.zeros(lengths.size + 1, dtype=np.int64)
    indptr[long_terms + 1] = head_size
    np.cumsum(indptr, out=indptr)
    docs = np.empty(long_terms.size * head_size, dtype=np.int32)
    scores = np.empty(long_terms.size * head_size, dtype=np.float32)
    rest_max = np.zeros(lengths.size, dtype=np.float32)
    for term in tqdm(long_terms.tolist(), desc="impact tiers", unit="list", disable=not show_progress):
        lo, hi = int(matrix.indptr[term]), int(matrix.indptr[term + 1])
        weights = np.asarray(matrix.data[lo:hi])
        cut = weights.size - head_size
        # positions >= cut hold the head (the best scores), position cut - 1 the best of the rest; which of equal
        # scores at the boundary join the head does not matter to exactness (the rest's bound includes them)
        part = np.argpartition(weights, [cut - 1, cut])
        head = np.sort(part[cut:])
        rest_max[term] = weights[part[cut - 1]]
        at = int(indptr[term])
        docs[at : at + head_size] = matrix.indices[lo:hi][head]
        scores[at : at + head_size] = weights[head]
    return ImpactTiers(head_size, indptr, docs, scores, rest_max)


@dataclass
class TierCounts:
    """How queries were answered: from the heads alone, or by the MaxScore fallback (bench/_scale.py reports it)."""

    heads: int = 0
    fallback: int = 0


def tiered_top_k(
    matrix: CscMatrix, tiers: ImpactTiers, terms: list[int], k: int, counts: TierCounts | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (document ids [k], scores [k] float64) of a query given as term ids (repeats count again): the same
    documents and scores as the dense path's, from the heads alone when they decide it."""
    counts = counts if counts is not None else TierCounts()
    k = min(k, matrix.num_docs)
    if not terms:
        return rank(np.zeros(0, dtype=np.int32), np.zeros(0), k, matrix.num_docs)
    unique, repeats = np.unique(np.asarray(terms, dtype=np.int64), return_counts=True)
    heads = [tiers.head(matrix, int(term)) for term in unique.tolist()]
    rest = np.array([r for _, _, r in heads]) * repeats  # [U]
    if sum(d.size for d, _, _ in heads) < k:
        counts.fallback += 1
        return pruned_top_k(matrix, terms, k)
    weights = [s.astype(np.float64) * rep for (_, s, _), rep in zip(heads, repeats.tolist())]
    # per candidate: the head scores it has (a lower bound) and the rest bounds of the heads it is in
    head_rests = [np.full(d.size, r) for (d, _, _), r in zip(heads, rest)]
    candidates, lower, covered = merge_postings([d for d, _, _ in heads], weights, head_rests)
    upper = lower + rest.sum() - covered
    theta = _threshold(matrix, terms, k, candidates, lower, upper)
    if theta <= 0 or rest.sum() * (1 + _MARGIN) >= theta * (1 - _MARGIN):
        counts.fallback += 1
        return pruned_top_k(matrix, terms, k, floor=theta * (1 - _MARGIN))
    counts.heads += 1
    survivors = candidates[upper * (1 + _MARGIN) >= theta * (1 - _MARGIN)]
    return rank(survivors, exact_scores(matrix, survivors, terms), k, matrix.num_docs)


def _threshold(
    matrix: CscMatrix, terms: list[int], k: int, candidates: np.ndarray, lower: np.ndarray, upper: np.ndarray
) -> float:
    """A lower bound of the final k-th score: the k-th best of the candidates' lower bounds, or of the exact scores
    of the PROBE candidates with the best upper bounds (a few binary searches). At 21M passages it was often well
    below the final k-th score (4.8 against 8.4), which the MaxScore fallback then raises; probing up to 2,048
    candidates, or the best lower bounds too, did not change the rate measurably."""
    theta = float(np.partition(lower, lower.size - k)[lower.size - k]) if lower.size >= k else 0.0
    probe = max(PROBE, k)
    best = candidates if candidates.size <= probe else np.sort(candidates[np.argpartition(-upper, probe)[:probe]])
    exact = exact_scores(matrix, best, terms)
    if exact.size >= k:
        theta = max(theta, float(np.partition(exact, exact.size - k)[exact.size - k]))
    return theta
