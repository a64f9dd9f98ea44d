"""The `tantivy` backend: BM25 at the paper's scale (21M passages) on an on-disk, memory-mapped inverted index.

Why a second engine: bm25s's score matrix is exact and fast to ~1M passages, but its top-k reads every posting of a
query's terms (MaxScore in dspo/search/prune.py only trims that), and at 21M passages a query's frequent words have
millions of postings. tantivy (a Rust search library in Lucene's family) keeps compressed posting lists with
per-block maximum scores and answers top-k with block-max WAND, skipping most of them (bench/retrieval.py --scale).

Departures from the bm25s backend, on purpose:
- k1 = 1.2 and b = 0.75 are fixed: tantivy hard-codes them (tantivy 0.27, src/query/bm25.rs); other values are
  refused when the index is built, naming `k1`/`b`.
- Document lengths are stored in one byte, as Lucene does (exact below 24 tokens, rounded down above), so scores and
  rankings follow Lucene's BM25 rather than the exact-length bm25s one; tantivy's scores carry Lucene's old
  (k1 + 1) factor, divided out here so scores are on the bm25s scale. Ties go to tantivy's internal document order.
- The analyzer is dspo's: passages are tokenized by `dspo.search.bm25.Tokenizer` (in worker processes) and handed
  to tantivy pre-split on spaces, so documents and queries are tokenized by the same code as the other backends.
Passages themselves live in dspo's passage store (dspo/search/passages.py); tantivy stores only each row number.
"""

from __future__ import annotations

import os
import shutil
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from dspo.search.passages import PassageWriter
from dspo.search.streamed import (
    StreamedBuild,
    TokenizerPool,
    check_unique_ids,
    default_workers,
    tokenized_batches,
)
from dspo.types import Passage

TANTIVY_DIR = "tantivy"
K1, B = 1.2, 0.75  # tantivy's BM25 constants
_ANALYZER = "dspo_pretokenized"


def check_tantivy_parameters(k1: float, b: float) -> None:
    if (k1, b) != (K1, B):
        raise ValueError(
            f"backend=tantivy scores with tantivy's fixed BM25 parameters k1={K1}, b={B}; got k1={k1}, b={b}. "
            "Set k1=1.2 b=0.75, or use backend=bm25s for other values."
        )


def _open(path: Path, create: bool):
    import tantivy

    builder = tantivy.SchemaBuilder()
    builder.add_text_field("body", stored=False, tokenizer_name=_ANALYZER, index_option="freq")
    builder.add_unsigned_field("row", stored=True)
    schema = builder.build()
    index = tantivy.Index(schema, path=str(path), reuse=not create)
    # split on whitespace only: the text is already dspo-tokenized (tantivy's own "whitespace" may drop long tokens)
    index.register_tokenizer(_ANALYZER, tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.whitespace()).build())
    return index, schema


def join_tokens_batch(tokenize: Callable[[str], list[str]], texts: list[str]) -> list[str]:
    """Worker task: each text as its dspo tokens joined by spaces."""
    return [" ".join(tokenize(text)) for text in texts]


def build_tantivy(
    passages: Iterable[Passage],
    directory: Path,
    tokenize: Callable[[str], list[str]],
    show_progress: bool = True,
    total: int | None = None,
    workers: int | None = None,
    heap_bytes: int = 4 << 30,
) -> StreamedBuild:
    """Write passages and a tantivy index into the (existing, empty) `directory` in bounded memory: tantivy's
    writer flushes a segment whenever its `heap_bytes` budget (split over its threads) is used and merges segments
    on disk. A large budget means fewer, larger segments: each segment is searched on its own (its own top-k
    threshold), so fewer segments answer faster."""
    import tantivy

    writer = PassageWriter(directory)
    (directory / TANTIVY_DIR).mkdir()
    index, _ = _open(directory / TANTIVY_DIR, create=True)
    workers = default_workers() if workers is None else workers
    threads = max(1, workers)
    index_writer = index.writer(min(heap_bytes, threads * 4_000_000_000), threads)  # tantivy: < 4 GiB a thread
    pool = TokenizerPool(join_tokens_batch, tokenize, workers)
    id_hashes, row, postings = array("q"), 0, 0
    try:
        for bodies in tokenized_batches(passages, writer, pool, id_hashes, show_progress, total):
            for body in bodies:
                doc = tantivy.Document()
                doc.add_text("body", body)
                doc.add_unsigned("row", row)
                index_writer.add_document(doc)
                row += 1
                postings += body.count(" ") + 1 if body else 0  # tokens, an upper bound of the postings
        index_writer.commit()
        index_writer.wait_merging_threads()
    finally:
        pool.close()
    sha256 = writer.close()
    if not row:
        raise ValueError("cannot build a BM25 index over zero passages")
    check_unique_ids(directory, id_hashes)
    return StreamedBuild(row, None, postings, sha256)


class TantivyEngine:
    """Searches a tantivy index directory; opened lazily in each process (server workers fork after loading)."""

    def __init__(self, path: Path, num_docs: int) -> None:
        self.path = path
        self.num_docs = num_docs
        self._opened: tuple | None = None
        self._pid = -1

    def _searcher(self):
        if self._opened is None or self._pid != os.getpid():
            index, schema = _open(self.path, create=False)
            self._opened, self._pid = (index.searcher(), schema), os.getpid()
        return self._opened

    def __getstate__(self) -> dict:
        return {"path": self.path, "num_docs": self.num_docs, "_opened": None, "_pid": -1}

    def top_k(self, token_lists: list[list[str]], k: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(rows [k], scores [k]) per query; a repeated query word counts again (one clause per occurrence)."""
        import tantivy

        searcher, schema = self._searcher()
        k = min(k, self.num_docs)
        for tokens in token_lists:
            rows, scores = [], []
            if tokens:
                clauses = [(tantivy.Occur.Should, tantivy.Query.term_query(schema, "body", tok)) for tok in tokens]
                for score, address in searcher.search(tantivy.Query.boolean_query(clauses), k, count=False).hits:
                    rows.append(searcher.doc(address)["row"][0])
                    scores.append(score / (K1 + 1.0))
            yield _fill(rows, scores, k)

    def save(self, path: Path) -> None:
        shutil.copytree(self.path, path / TANTIVY_DIR)

    @classmethod
    def load(cls, path: Path, num_docs: int) -> TantivyEngine:
        if not (path / TANTIVY_DIR / "meta.json").is_file():
            raise FileNotFoundError(f"{path / TANTIVY_DIR}: no tantivy index; rebuild with dspo-index backend=tantivy")
        return cls(path / TANTIVY_DIR, num_docs)


def _fill(rows: list[int], scores: list[float], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Fewer than k matches: the first other rows in corpus order, score 0 (as the bm25s backend does)."""
    taken, row = set(rows), 0
    while len(rows) < k:
        if row not in taken:
            rows.append(row)
            scores.append(0.0)
        row += 1
    return np.asarray(rows, dtype=np.int64), np.asarray(scores, dtype=np.float64)
