"""MaxScore top-k (dspo/search/prune.py): the same documents and bit-identical scores as the dense [N] row."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from dspo.process.resources import data_dir
from dspo.search.bm25 import BM25Index
from dspo.search.corpus import load_corpus
from dspo.search.prune import CscMatrix, exact_scores, pruned_top_k, rank
from dspo.types import Passage

HOTPOTQA = data_dir() / "hotpotqa_dev500"


def dense_and_pruned(index: BM25Index, queries: list[str], k: int) -> tuple[list, list]:
    """The dense row's answers and MaxScore's."""
    index.engine.prune_min_docs = 10**12
    dense = index.search(queries, k)
    index.engine.prune_min_docs = 0
    return dense, index.search(queries, k)


def test_pruned_equals_dense_on_hotpotqa_questions() -> None:
    index = BM25Index.build(load_corpus(HOTPOTQA / "corpus.jsonl.gz"), show_progress=False)
    questions = [json.loads(line)["question"] for line in (HOTPOTQA / "questions.jsonl").read_text().splitlines()]
    for k in (1, 3, 10):
        dense, pruned = dense_and_pruned(index, questions, k)
        assert pruned == dense  # ids, titles, texts and float scores, in order


@pytest.mark.parametrize("seed", range(5))
def test_pruned_equals_dense_with_ties_repeats_and_few_matches(seed: int) -> None:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(12)]  # a tiny vocabulary: many exact ties
    docs = [Passage(str(i), "", " ".join(rng.choices(words, k=rng.randint(1, 6)))) for i in range(300)]
    index = BM25Index.build(docs, show_progress=False)
    queries = [" ".join(rng.choices(words + ["unknown"], k=rng.randint(1, 5))) for _ in range(60)]
    queries += ["unknown", "w1 w1 w1", "zzz w11"]
    for k in (1, 3, 7, 400):
        dense, pruned = dense_and_pruned(index, queries, k)
        assert pruned == dense


def test_rank_fills_with_zero_score_documents_in_corpus_order() -> None:
    docs, scores = rank(np.array([2, 5]), np.array([1.0, 3.0]), k=4, num_docs=10)
    assert docs.tolist() == [5, 2, 0, 1] and scores.tolist() == [3.0, 1.0, 0.0, 0.0]


def test_exact_scores_add_terms_in_query_order_both_directions() -> None:
    matrix = CscMatrix(
        data=np.array([1.0, 2.0, 0.5, 0.25, 4.0], dtype=np.float32),
        indices=np.array([0, 3, 1, 3, 2], dtype=np.int32),
        indptr=np.array([0, 2, 4, 5], dtype=np.int64),
        term_max=np.array([2.0, 0.5, 4.0], dtype=np.float32),
        num_docs=4,
    )
    cands = np.array([0, 1, 2, 3], dtype=np.int32)  # longer than each list: lists are located in the candidates
    assert exact_scores(matrix, cands, [0, 1, 1]).tolist() == [1.0, 1.0, 0.0, 2.5]
    few = np.array([3], dtype=np.int32)  # shorter: the candidate is looked up in each list
    assert exact_scores(matrix, few, [0, 1, 2]).tolist() == [2.25]
    docs, scores = pruned_top_k(matrix, [0, 2], k=2)
    assert docs.tolist() == [2, 3] and scores.tolist() == [4.0, 2.0]
