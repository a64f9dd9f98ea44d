"""The compiled MaxScore walk (dspo/search/maxscore.py): hand-computed candidates, the galloping search, and on
random lists every document of the true top k among the candidates, whatever valid floor it starts from."""

from __future__ import annotations

import numpy as np
import pytest

from dspo.search import lookup_filter
from dspo.search.maxscore import SEED_DOCS, _advance, _seed_threshold, maxscore_candidates


def lists_to_arrays(lists: list[dict[int, float]]) -> tuple[np.ndarray, ...]:
    """{document: score} per term -> (indices, data, starts, ends) as the CSC matrix holds them."""
    indices = np.array([d for postings in lists for d in sorted(postings)], dtype=np.int32)
    data = np.array([postings[d] for postings in lists for d in sorted(postings)], dtype=np.float32)
    lengths = np.array([len(postings) for postings in lists], dtype=np.int64)
    ends = np.cumsum(lengths)
    return indices, data, ends - lengths, ends


def walk(
    lists: list[dict[int, float]], weight: list[float], k: int, floor: float = 0.0, num_docs: int | None = None
) -> tuple:
    """The walk over `lists`; with `num_docs`, the long lists get lookup filters (as an index of that size would)."""
    indices, data, starts, ends = lists_to_arrays(lists)
    weights = np.asarray(weight, dtype=np.float64)
    impact = np.array([max(p.values()) for p in lists]) * weights
    order = np.argsort(impact, kind="stable")
    at, shift, words = np.full(len(lists), -1, dtype=np.int64), np.zeros(len(lists), np.int64), np.zeros(0, np.uint64)
    if num_docs is not None:
        lookup = lookup_filter.build(indices, np.concatenate([[0], ends]), num_docs)
        at, shift, words = lookup.offset, lookup.shift, lookup.words
        assert (at >= 0).any()  # the test exercises the filter
    args = (starts[order], ends[order], weights[order], impact[order], k, floor, at[order], shift[order], words)
    return maxscore_candidates(indices, data, *args)


def test_hand_computed_walk_skips_documents_only_the_small_terms_hold() -> None:
    # term a (impact 1): docs 0, 1, 2; term b (impact 2): docs 1, 3; term c (impact 4): docs 2, 3.
    # scores: 0 -> 1, 1 -> 1+2 = 3, 2 -> 1+4 = 5, 3 -> 2+4 = 6; top 1 = doc 3 (6).
    lists = [{0: 1.0, 1: 1.0, 2: 1.0}, {1: 2.0, 3: 2.0}, {2: 4.0, 3: 4.0}]
    docs, scores, theta = walk(lists, [1.0, 1.0, 1.0], k=1)
    assert docs.tolist() == [3] and scores.tolist() == [6.0] and theta == 6.0
    # from a floor of 5.5, a and b together (3) cannot reach it: only c's documents are walked
    docs, scores, theta = walk(lists, [1.0, 1.0, 1.0], k=1, floor=5.5)
    assert docs.tolist() == [3] and theta == 6.0
    # top 2 keeps doc 2 (5) and doc 3 (6); a repeated term counts twice: a x3 makes doc 0 score 3
    docs, scores, theta = walk(lists, [1.0, 1.0, 1.0], k=2)
    assert docs.tolist() == [2, 3] and scores.tolist() == [5.0, 6.0] and theta == 5.0
    docs, scores, _ = walk(lists, [3.0, 1.0, 1.0], k=4)
    assert docs.tolist() == [0, 1, 2, 3] and scores.tolist() == [3.0, 5.0, 7.0, 6.0]


def test_ties_at_the_threshold_are_all_kept() -> None:
    lists = [{d: 1.0 for d in range(10)}]
    docs, scores, theta = walk(lists, [1.0], k=3)
    assert docs.tolist() == list(range(10)) and theta == 1.0


def test_documents_on_window_edges_are_scored_once_with_every_term() -> None:
    edges = [0, 4095, 4096, 8191, 8192, 50_000]
    lists = [{d: 1.0 for d in edges}, {d: 2.0 for d in edges[1::2]}]
    docs, scores, _ = walk(lists, [1.0, 1.0], k=len(edges))
    assert docs.tolist() == edges and scores.tolist() == [1.0, 3.0, 1.0, 3.0, 1.0, 3.0]


@pytest.mark.parametrize("seed", range(3))
def test_advance_finds_the_first_document_at_or_after_the_target(seed: int) -> None:
    rng = np.random.default_rng(seed)
    docs = np.unique(rng.integers(0, 5_000, size=700)).astype(np.int32)
    for _ in range(300):
        pos, target = int(rng.integers(0, docs.size + 1)), int(rng.integers(-5, 5_010))
        expected = max(pos, int(np.searchsorted(docs, target)))
        assert _advance(docs, pos, docs.size, target) == expected


@pytest.mark.parametrize("seed", range(8))
def test_candidates_hold_the_true_top_k_from_any_valid_floor(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # 400 documents: one window of the walk; 20,000: several, lists crossing their edges
    num_docs, num_terms = [400, 20_000][seed % 2], int(rng.integers(1, 7))
    lists = []
    for _ in range(num_terms):
        docs = rng.choice(num_docs, size=int(rng.integers(1, min(num_docs, 3_000))), replace=False)
        # few distinct scores: ties everywhere
        lists.append({int(d): float(rng.integers(1, 6)) / 4 for d in docs})
    weight = rng.integers(1, 3, size=num_terms).astype(float).tolist()
    dense = np.zeros(num_docs)
    for postings, w in zip(lists, weight):
        for d, s in postings.items():
            dense[d] += np.float32(s) * w
    for k in (1, 3, 10):
        kth = np.sort(dense)[::-1][k - 1]
        must = set(np.flatnonzero(dense >= kth).tolist()) - set(np.flatnonzero(dense == 0).tolist())
        for floor in (0.0, kth * float(rng.uniform(0, 1)), kth):
            for filtered in (None, num_docs):
                docs, scores, theta = walk(lists, weight, k, floor, num_docs=filtered)
                assert must <= set(docs.tolist()), (k, floor, filtered)
                assert np.all(np.diff(docs) > 0) and np.allclose(scores, dense[docs], rtol=1e-12)
                assert theta == pytest.approx(kth)


def test_seed_threshold_is_the_kth_best_of_the_top_lists_first_documents() -> None:
    # top list c (impact 4): docs 2, 3, 9; a: 0, 1, 2; b: 1, 3. Scores of c's documents: 2 -> 5, 3 -> 6, 9 -> 4
    lists = [{0: 1.0, 1: 1.0, 2: 1.0}, {1: 2.0, 3: 2.0}, {2: 4.0, 3: 4.0, 9: 4.0}]
    indices, data, starts, ends = lists_to_arrays(lists)
    weight, prefix = np.ones(3), np.cumsum([1.0, 2.0, 4.0])
    none = (np.full(3, -1, dtype=np.int64), np.zeros(3, np.int64), np.zeros(0, np.uint64))
    seed = [_seed_threshold(indices, data, starts, ends, weight, prefix, k, *none) for k in (1, 2, 3, 4)]
    assert seed == [6.0, 5.0, 4.0, 0.0]  # k = 4: fewer than k documents, no threshold


def test_seed_reads_only_the_first_seed_docs_of_the_top_list() -> None:
    # the best document sits past the first SEED_DOCS: the seed does not see it, the walk does
    top = {d: 1.0 for d in range(SEED_DOCS)} | {SEED_DOCS + 5: 9.0}
    lists = [{SEED_DOCS + 5: 0.5}, top]
    indices, data, starts, ends = lists_to_arrays(lists)
    none = (np.full(2, -1, dtype=np.int64), np.zeros(2, np.int64), np.zeros(0, np.uint64))
    assert _seed_threshold(indices, data, starts, ends, np.ones(2), np.cumsum([0.5, 9.0]), 1, *none) == 1.0
    docs, scores, theta = walk(lists, [1.0, 1.0], k=1)
    assert docs.tolist() == [SEED_DOCS + 5] and theta == 9.5
