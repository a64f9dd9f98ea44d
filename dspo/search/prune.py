"""Top-k BM25 without scoring every matching document: MaxScore pruning over the bm25s CSC matrix.

The dense path (`_Bm25sEngine.score_rows`) sums a query's posting lists into an [N] row: at 21M passages that is an
84 MB row per query and tens of milliseconds. MaxScore (Turtle & Flood, 1995) skips most of it:

1. A first threshold theta0: the k-th best exact score among a few seed documents (the best-weighted documents of
   each posting list that is not too long to partially sort).
   A caller that knows a lower bound of the k-th score (the impact tiers, dspo/search/tiers.py) passes it as
   `floor` instead, and the seeds are skipped.
2. Terms sorted by their largest possible contribution (`term_max`, stored by the streamed build, times the term's
   repetitions in the query); the longest prefix whose contributions sum to less than theta0 is "non-essential":
   a document that contains only non-essential terms scores below theta0 <= the final k-th score, so it cannot be
   in the top k.
3. Candidates = documents of the essential terms' lists (merged as sorted runs). Their partial scores (essential
   terms only) bound each score from below, so their k-th best may raise the threshold; partial + the
   non-essential terms' maxima bounds it from above.
4. The non-essential terms are added one at a time, largest maximum first, to the candidates still in reach;
   after each, a candidate whose partial score plus the maxima still to add falls below the threshold is dropped.
   Only the few left are scored exactly with every query term (at 21M passages ~21 a query, against ~20,000 when
   the bound used every non-essential maximum at once).

Exactness: candidate scores are summed in float64 over the query's terms in query order, the order the dense
path's `np.bincount` adds them, so scores are bit-identical, and ties go to the lower document index, as in
`dspo.search.bm25._top_k` (checked against it in tests/search/test_prune.py). When fewer than k documents score
above zero, the rest are the first zero-score documents in corpus order, as there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TERM_MAX = "term_max.npy"  # beside the bm25s matrices: each term's highest score, the bound MaxScore prunes by
SEED_LIST_MAX = 200_000  # lists up to this long give seed documents (a partial sort of each is cheap)
SEED_PER_TERM = 32


@dataclass(frozen=True)
class CscMatrix:
    """bm25s's eager score matrix: column t holds term t's postings (document ids ascending) and their scores."""

    data: np.ndarray  # [P] float32
    indices: np.ndarray  # [P] int32 document ids
    indptr: np.ndarray  # [V + 1] int64
    term_max: np.ndarray  # [V] float32: the largest score in each column
    num_docs: int

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


def _seed(matrix: CscMatrix, unique: np.ndarray, impact: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A few documents likely to score high: each not-too-long list's SEED_PER_TERM best-weighted documents (the
    highest-impact list's when all are long); a strong theta0 makes most terms non-essential."""
    terms = unique[lengths <= SEED_LIST_MAX]
    if terms.size == 0:
        terms = unique[[int(np.argmin(lengths))]]
    picked = []
    for term in terms.tolist():
        docs, weights = matrix.postings(term)
        if docs.size > SEED_PER_TERM:
            docs = docs[np.argpartition(weights, docs.size - SEED_PER_TERM)[-SEED_PER_TERM:]]
        picked.append(docs)
    return np.unique(np.concatenate(picked))


def merge_postings(docs: list[np.ndarray], *values: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The union of sorted document lists (unique, ascending [C]) and, for each of `values` (arrays aligned with
    `docs`), the per-document sum [C]: one merge serves every sum.

    A stable argsort of the concatenated lists is a merge of sorted runs (timsort): 26 ms against `np.unique`'s
    450 ms (which sorts from scratch) on 700k random postings of 21M documents."""
    if len(docs) == 1:
        return docs[0], *(value[0] for value in values)
    merged = np.concatenate(docs)
    if merged.size == 0:
        return merged, *(np.concatenate(value) for value in values)
    order = np.argsort(merged, kind="stable")
    merged = merged[order]
    first = np.concatenate(([True], merged[1:] != merged[:-1]))
    group = np.cumsum(first) - 1
    return merged[first], *(np.bincount(group, weights=np.concatenate(value)[order]) for value in values)


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


def pruned_top_k(matrix: CscMatrix, terms: list[int], k: int, floor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (document ids [k], scores [k] float64) of a query given as term ids (repeats count again). `floor`: a
    known lower bound of the k-th score (dspo/search/tiers.py passes one), which raises the first threshold."""
    k = min(k, matrix.num_docs)
    if not terms:
        return rank(np.zeros(0, dtype=np.int32), np.zeros(0), k, matrix.num_docs)
    unique, repeats = np.unique(np.asarray(terms, dtype=np.int64), return_counts=True)
    impact = matrix.term_max[unique].astype(np.float64) * repeats
    lengths = matrix.indptr[unique + 1] - matrix.indptr[unique]
    # a floor from the impact tiers' heads is at least as high as the seeds would give: no seeds then
    seed = _seed(matrix, unique, impact, lengths) if floor <= 0 else np.zeros(0, dtype=np.int32)
    seed_scores = exact_scores(matrix, seed, terms)
    theta0 = np.partition(seed_scores, seed.size - k)[seed.size - k] if seed.size >= k else 0.0
    theta0 = max(theta0, floor)
    by_impact = np.argsort(impact, kind="stable")
    # a margin against float rounding: the bound must stay strictly below any score it excludes
    non_essential = by_impact[np.cumsum(impact[by_impact]) * (1 + 1e-9) < theta0]
    essential = np.setdiff1d(np.arange(unique.size), non_essential)
    if essential.size == 0:  # no document reaches theta0 but the seeds (a valid floor is never above every score)
        return rank(seed, seed_scores, k, matrix.num_docs)
    lists = [matrix.postings(int(unique[i])) for i in essential]
    # partial scores from the essential terms: a lower bound of each score, to which _refine adds the rest
    weighted = [weights.astype(np.float64) * float(repeats[i]) for i, (_, weights) in zip(essential.tolist(), lists)]
    candidates, partial = merge_postings([docs for docs, _ in lists], weighted)
    order = non_essential[np.argsort(-impact[non_essential], kind="stable")]
    survivors = _refine(
        matrix, candidates, partial, [(int(unique[i]), int(repeats[i]), impact[i]) for i in order], k, theta0
    )
    return rank(survivors, exact_scores(matrix, survivors, terms), k, matrix.num_docs)


def _refine(
    matrix: CscMatrix,
    candidates: np.ndarray,
    partial: np.ndarray,
    non_essential: list[tuple[int, int, float]],
    k: int,
    theta: float,
) -> np.ndarray:
    """The candidates that may still reach theta, adding the non-essential terms (term, repeats, impact) one at a
    time, largest impact first: after each, a candidate's bound is its partial score plus the impacts still to add,
    and the k-th best partial score (a lower bound) may raise theta (MaxScore's document-at-a-time bound test,
    done a term at a time over the surviving candidates)."""
    remaining = float(sum(impact for _, _, impact in non_essential))
    for term, repeats, impact in [(None, 0, 0.0), *non_essential]:
        if term is not None:
            partial = partial + term_weights(matrix, term, candidates) * repeats
            remaining -= impact
        candidates, partial = _reaching(candidates, partial, remaining, theta)
        # a candidate whose partial score reaches theta was kept: the k-th best among the kept is the k-th overall
        if partial.size > k:
            raised = float(np.partition(partial, partial.size - k)[partial.size - k])
            if raised > theta:
                theta = raised
                candidates, partial = _reaching(candidates, partial, remaining, theta)
    return candidates


def _reaching(
    candidates: np.ndarray, partial: np.ndarray, remaining: float, theta: float
) -> tuple[np.ndarray, np.ndarray]:
    """The candidates (and their partial scores) whose bound, partial + remaining, reaches theta."""
    # margins of 1e-6: bounds computed in another summation order than the exact scores must not cut a tie
    keep = (partial + max(remaining, 0.0)) * (1 + 1e-6) >= theta * (1 - 1e-6)
    return candidates[keep], partial[keep]
