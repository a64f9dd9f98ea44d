"""Impact tiers (dspo/search/tiers.py): heads and their rest bound built exactly, the heads-only answer taken only
when it is exact, and every answer the dense row's (documents and bit-identical scores)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from dspo.resources import data_dir
from dspo.search.bm25 import BM25Index, build_index_streamed
from dspo.search.corpus import load_corpus
from dspo.search.prune import CscMatrix
from dspo.search.tiers import TIERS_DIR, ImpactTiers, TierCounts, build_tiers, tiered_top_k
from dspo.types import Passage

HOTPOTQA = data_dir() / "hotpotqa_dev500"


def dense_and_tiered(index: BM25Index, queries: list[str], k: int, head_size: int) -> tuple[list, list]:
    engine = index.engine
    engine.prune_min_docs = 10**12
    dense = index.search(queries, k)
    engine.prune_min_docs, engine._tiers = 0, build_tiers(engine.matrix(), head_size)
    return dense, index.search(queries, k)


def small_matrix() -> CscMatrix:
    # term 0: 5 postings (scores 1, 3, 2, 3, 0.5 on documents 0, 2, 4, 6, 8); term 1: 2 postings
    return CscMatrix(
        data=np.array([1.0, 3.0, 2.0, 3.0, 0.5, 4.0, 1.0], dtype=np.float32),
        indices=np.array([0, 2, 4, 6, 8, 1, 4], dtype=np.int32),
        indptr=np.array([0, 5, 7], dtype=np.int64),
        term_max=np.array([3.0, 4.0], dtype=np.float32),
        num_docs=10,
    )


def test_heads_hold_the_best_postings_in_document_order_and_the_rest_bound() -> None:
    tiers = build_tiers(small_matrix(), head_size=2)
    docs, scores, rest = tiers.head(small_matrix(), 0)
    assert docs.tolist() == [2, 6] and scores.tolist() == [3.0, 3.0] and rest == 2.0
    docs, scores, rest = tiers.head(small_matrix(), 1)  # a short list is read whole from the matrix: no rest
    assert docs.tolist() == [1, 4] and scores.tolist() == [4.0, 1.0] and rest == 0.0
    assert tiers.indptr.tolist() == [0, 2, 2]


def test_heads_decide_a_query_only_when_no_other_document_can_reach_the_top() -> None:
    matrix, tiers, counts = small_matrix(), build_tiers(small_matrix(), head_size=2), TierCounts()
    # k=1: document 1 (4.0) beats anything outside the heads (at most 2.0 + 0): answered from the heads
    docs, scores = tiered_top_k(matrix, tiers, [0, 1], k=1, counts=counts)
    assert docs.tolist() == [1] and scores.tolist() == [4.0]
    assert (counts.heads, counts.fallback) == (1, 0)
    # k=4: document 4 (2.0 + 1.0 = 3.0) is not in term 0's head but is in term 1's (short, whole) list: scored
    # exactly, it ties documents 2 and 6, and nothing outside the heads (<= 2.0) can reach 3.0
    docs, scores = tiered_top_k(matrix, tiers, [0, 1], k=4, counts=counts)
    assert docs.tolist() == [1, 2, 4, 6] and scores.tolist() == [4.0, 3.0, 3.0, 3.0]
    assert (counts.heads, counts.fallback) == (2, 0)
    # k=5: the heads hold 4 documents; the fallback finds the 5th (document 0, 1.0) in term 0's rest
    docs, scores = tiered_top_k(matrix, tiers, [0, 1], k=5, counts=counts)
    assert docs.tolist() == [1, 2, 4, 6, 0] and scores.tolist() == [4.0, 3.0, 3.0, 3.0, 1.0]
    assert (counts.heads, counts.fallback) == (2, 1)


def test_build_refuses_an_empty_head() -> None:
    with pytest.raises(ValueError, match="head_size must be >= 1"):
        build_tiers(small_matrix(), head_size=0)


@pytest.mark.parametrize("head_size", [1, 2, 8, 64])
def test_tiered_equals_dense_on_hotpotqa_questions(head_size: int) -> None:
    index = BM25Index.build(load_corpus(HOTPOTQA / "corpus.jsonl.gz"), show_progress=False)
    questions = [json.loads(line)["question"] for line in (HOTPOTQA / "questions.jsonl").read_text().splitlines()]
    for k in (1, 3, 10):
        dense, tiered = dense_and_tiered(index, questions, k, head_size)
        assert tiered == dense  # ids, titles, texts and float scores, in order
        counts = index.engine.tier_counts
        assert counts.heads + counts.fallback == len(questions)
        assert counts.fallback > 0 and (head_size < 8 or counts.heads > 0)  # both paths are exercised
        index.engine.tier_counts = TierCounts()


@pytest.mark.parametrize("seed", range(5))
def test_tiered_equals_dense_with_ties_repeats_and_few_matches(seed: int) -> None:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(12)]  # a tiny vocabulary: many exact ties, at the heads' edges too
    docs = [Passage(str(i), "", " ".join(rng.choices(words, k=rng.randint(1, 6)))) for i in range(300)]
    index = BM25Index.build(docs, show_progress=False)
    queries = [" ".join(rng.choices(words + ["unknown"], k=rng.randint(1, 5))) for _ in range(60)]
    queries += ["unknown", "w1 w1 w1", "zzz w11"]
    for head_size in (1, 3, 20):
        for k in (1, 3, 7, 400):
            dense, tiered = dense_and_tiered(index, queries, k, head_size)
            assert tiered == dense


def test_streamed_build_saves_the_tiers_the_loaded_index_uses(tmp_path: Path) -> None:
    passages = load_corpus(HOTPOTQA / "corpus.jsonl.gz")
    build_index_streamed(iter(passages), tmp_path / "ix", show_progress=False)
    saved = ImpactTiers.load(tmp_path / "ix" / TIERS_DIR, mmap=True)
    disk = BM25Index.load(tmp_path / "ix", mmap=True)
    want = build_tiers(disk.engine.matrix())
    assert saved is not None and disk.engine.tiers() is not None
    for name in ("indptr", "docs", "scores", "rest_max"):
        assert np.array_equal(getattr(saved, name), getattr(want, name)), name
    assert ImpactTiers.load(tmp_path / "nothing", mmap=True) is None  # an older index: computed on first use
