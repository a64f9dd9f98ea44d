"""Build a bm25s-format BM25 index from a passage stream in bounded memory (the 21M-passage wiki-18 on 24 GiB).

bm25s's own `BM25.index` holds every document's token ids plus three arrays of all postings and their sort at once:
8.25 GiB at 2M passages, ~82 GiB at 21M. This builder streams instead, in two passes:

1. Passages are read one at a time, written to `passages.jsonl` (the index's passage store), tokenized, and
   buffered `chunk_docs` at a time; each chunk's postings (term, document, term frequency) are sorted by term and
   spilled to disk (documents int32, frequencies uint16 or int32, a per-chunk term offset table). Only the
   vocabulary, the per-term document frequencies and the document lengths stay in memory.
2. Terms are processed in blocks of at most `block_postings` postings: each chunk's slice of the block is read
   back, the slices are merged in document order, scored, and appended to the output arrays.

The scores are bit-identical to bm25s's `method="lucene"` build (same float64 arithmetic in the same order, rounded
to float32; idf through `math.log` as bm25s computes it): `tests/search/test_streamed.py` compares every column.
The output directory is loadable by `bm25s.BM25.load` and by `dspo.search.bm25.BM25Index.load` (memory-mapped).
Also written: `term_max.npy`, each term's largest score, which the pruned top-k search (dspo/search/prune.py) needs,
and from PRUNE_MIN_DOCS passages up its lookup filters (`lookup_filter/`, dspo/search/lookup_filter.py).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import tempfile
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm.auto import tqdm

from dspo.search.backends import PRUNE_MIN_DOCS, import_bm25s
from dspo.search.passages import PassageStore, PassageWriter
from dspo.search.prune import LOOKUP_FILTER, TERM_MAX
from dspo.types import Passage

BM25S_DIR = "bm25s"
BATCH = 10_000  # passages per tokenizer task
_NAMES = {"data": "data.csc.index.npy", "indices": "indices.csc.index.npy", "indptr": "indptr.csc.index.npy"}


@dataclass
class StreamedBuild:
    """What a streamed build wrote: sizes and the SHA-256 of the stored passages (the corpus part of the digest)."""

    num_docs: int
    vocab_size: int | None  # None: the backend does not say (tantivy)
    num_postings: int  # tantivy: tokens indexed (an upper bound)
    passages_sha256: str


@dataclass
class _Chunk:
    directory: Path
    vocab_size: int  # terms known when the chunk was spilled; later terms have no postings in it

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        load = lambda name: np.load(self.directory / name, mmap_mode="r")  # noqa: E731
        return load("term_ptr.npy"), load("docs.npy"), load("tf.npy")


class _Spiller:
    """Pass 1: token ids of up to `chunk_docs` documents, spilled as term-sorted postings."""

    def __init__(self, workdir: Path, chunk_docs: int) -> None:
        self.workdir = workdir
        self.chunk_docs = chunk_docs
        self.vocab: defaultdict[str, int] = defaultdict(count().__next__)  # new term -> next id, in C
        self.doc_lengths = array("i")
        self.df = np.zeros(0, dtype=np.int64)
        self.chunks: list[_Chunk] = []
        self._ids = array("i")
        self._first_doc = 0

    def add_batch(self, words: list[str], ids: bytes, lengths: bytes) -> None:
        """One batch from `tokenize_batch`: its local term ids are mapped to global ones (one dictionary lookup per
        distinct word of the batch instead of one per token)."""
        to_global = np.fromiter(map(self.vocab.__getitem__, words), dtype=np.int32, count=len(words))
        self._ids.frombytes(to_global[np.frombuffer(ids, dtype=np.int32)].tobytes())
        self.doc_lengths.frombytes(lengths)
        if len(self.doc_lengths) - self._first_doc >= self.chunk_docs:
            self.spill()

    def spill(self) -> None:
        lengths = np.frombuffer(self.doc_lengths, dtype=np.int32)[self._first_doc :]
        if lengths.size == 0:
            return
        docs = np.repeat(np.arange(self._first_doc, self._first_doc + lengths.size, dtype=np.int64), lengths)
        terms_of_tokens = np.frombuffer(self._ids, dtype=np.int32).astype(np.int64)
        keys, tf = np.unique((terms_of_tokens << 32) | docs, return_counts=True)  # sorted by term, then document
        terms = (keys >> 32).astype(np.int64)
        vocab_size = len(self.vocab)
        per_term = np.bincount(terms, minlength=vocab_size)
        self.df = np.concatenate([self.df, np.zeros(vocab_size - self.df.size, dtype=np.int64)]) + per_term
        chunk = _Chunk(self.workdir / f"chunk{len(self.chunks):05d}", vocab_size)
        chunk.directory.mkdir()
        np.save(chunk.directory / "term_ptr.npy", np.concatenate([[0], np.cumsum(per_term)]).astype(np.int64))
        np.save(chunk.directory / "docs.npy", (keys & 0xFFFFFFFF).astype(np.int32))
        np.save(chunk.directory / "tf.npy", tf.astype(np.uint16 if tf.max() < 2**16 else np.int32))
        self.chunks.append(chunk)
        self._ids = array("i")
        self._first_doc = len(self.doc_lengths)


def tokenize_batch(tokenize: Callable[[str], list[str]], texts: list[str]) -> tuple[list[str], bytes, bytes]:
    """Tokenize texts (in a worker process): the batch's words in order of first use, each token's index in that
    list (int32 bytes), and each text's token count (int32 bytes)."""
    local: defaultdict[str, int] = defaultdict(count().__next__)
    to_local = local.__getitem__
    ids, lengths = array("i"), array("i")
    for text in texts:
        tokens = tokenize(text)
        ids.fromlist(list(map(to_local, tokens)))
        lengths.append(len(tokens))
    return list(local), ids.tobytes(), lengths.tobytes()


class TokenizerPool:
    """`task(tokenize, texts)` run over batches in `workers` spawned processes, results in submission order, at
    most 2 per worker in flight (bounded memory). No process is started for a corpus smaller than one batch, or with
    workers=0."""

    def __init__(self, task: Callable, tokenize: Callable[[str], list[str]], workers: int) -> None:
        self.task, self.tokenize, self.workers = task, tokenize, workers
        self.pending: deque = deque()
        self.pool = None

    def submit(self, texts: list[str], full: bool) -> Iterator:
        if self.workers and full and self.pool is None:
            self.pool = multiprocessing.get_context("spawn").Pool(self.workers)
        if self.pool is None:
            yield self.task(self.tokenize, texts)
            return
        self.pending.append(self.pool.apply_async(self.task, (self.tokenize, texts)))
        while len(self.pending) > 2 * self.workers:
            yield self.pending.popleft().get()

    def drain(self) -> Iterator:
        while self.pending:
            yield self.pending.popleft().get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def tokenized_batches(
    passages: Iterable[Passage],
    writer: PassageWriter,
    pool: TokenizerPool,
    id_hashes: array,
    show_progress: bool,
    total: int | None,
) -> Iterator:
    """Pass 1's loop, shared by the backends: each passage is stored and its id hashed (duplicates are found at
    the end), its title + text tokenized in batches; yields the pool's results in corpus order."""
    texts: list[str] = []
    bar = tqdm(passages, desc="tokenize", unit="passage", unit_scale=True, total=total, disable=not show_progress)
    for p in bar:
        writer.write(p)
        id_hashes.append(hash(p.id))
        texts.append(f"{p.title} {p.text}")
        if len(texts) == BATCH:
            yield from pool.submit(texts, full=True)
            texts = []
    if texts:
        yield from pool.submit(texts, full=False)
    yield from pool.drain()


def _open_npy(path: Path, dtype: str, length: int) -> BinaryIO:
    """An .npy file with its header written, ready for `length` values appended in order (no memory map: the
    pages written are not counted in the builder's resident memory)."""
    handle = path.open("wb")
    header = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (length,)}
    np.lib.format.write_array_header_2_0(handle, header)
    return handle


def _idf(df: np.ndarray, num_docs: int) -> np.ndarray:
    """Lucene's idf per term, float32, computed with math.log exactly as bm25s does (numpy's log may differ in the
    last bit, which float32 rounding usually but not always hides)."""
    return np.array([math.log(1 + (num_docs - d + 0.5) / (d + 0.5)) if d else 0.0 for d in df.tolist()], np.float32)


def _merge(spiller: _Spiller, out: Path, k1: float, b: float, block_postings: int, show_progress: bool) -> int:
    """Pass 2: write the CSC arrays (columns = terms) block by block; returns the number of postings."""
    df, num_docs = spiller.df, len(spiller.doc_lengths)
    lengths = np.frombuffer(spiller.doc_lengths, dtype=np.int32).astype(np.float64)
    avg_len = np.array(spiller.doc_lengths, dtype=np.int64).mean()  # as bm25s: mean of an int array
    idf = _idf(df, num_docs)
    indptr = np.concatenate([[0], np.cumsum(df)]).astype(np.int64)
    np.save(out / _NAMES["indptr"], indptr)
    term_max = np.zeros(df.size, dtype=np.float32)
    data_f = _open_npy(out / _NAMES["data"], "<f4", int(indptr[-1]))
    indices_f = _open_npy(out / _NAMES["indices"], "<i4", int(indptr[-1]))
    chunks = [(c.vocab_size, *c.arrays()) for c in spiller.chunks]
    bar = tqdm(total=int(indptr[-1]), desc="merge postings", unit="posting", unit_scale=True, disable=not show_progress)
    start = 0
    while start < df.size:
        stop = max(start + 1, int(np.searchsorted(indptr, indptr[start] + block_postings, side="right")) - 1)
        stop = min(stop, df.size)
        terms, docs, tf = [], [], []
        for vocab_size, ptr, chunk_docs, chunk_tf in chunks:
            lo, hi = min(start, vocab_size), min(stop, vocab_size)
            if lo == hi:
                continue
            a, z = int(ptr[lo]), int(ptr[hi])
            terms.append(np.repeat(np.arange(lo, hi, dtype=np.int32), np.diff(ptr[lo : hi + 1])))
            docs.append(np.asarray(chunk_docs[a:z]))
            tf.append(np.asarray(chunk_tf[a:z]).astype(np.float64))
        order = np.argsort(np.concatenate(terms), kind="stable")  # chunks are in document order: stays sorted
        terms_b = np.concatenate(terms)[order]
        docs_b, tf_b = np.concatenate(docs)[order], np.concatenate(tf)[order]
        # bm25s (scoring.py): tf / (k1 * ((1 - b) + b * l_d / l_avg) + tf), times the float32 idf, in float64
        scores = idf[terms_b].astype(np.float64) * (tf_b / (k1 * ((1 - b) + b * lengths[docs_b] / avg_len) + tf_b))
        scores = scores.astype(np.float32)
        nonempty = np.flatnonzero(df[start:stop]) + start
        term_max[nonempty] = np.maximum.reduceat(scores, indptr[nonempty] - indptr[start])
        data_f.write(scores.tobytes())
        indices_f.write(docs_b.tobytes())
        bar.update(scores.size)
        start = stop
    bar.close()
    data_f.close()
    indices_f.close()
    np.save(out.parent / TERM_MAX, term_max)
    return int(indptr[-1])


def build_streamed(
    passages: Iterable[Passage],
    directory: str | Path,
    tokenize: Callable[[str], list[str]],
    k1: float,
    b: float,
    chunk_docs: int = 200_000,
    block_postings: int = 16_000_000,
    show_progress: bool = True,
    total: int | None = None,
    workers: int | None = None,
) -> StreamedBuild:
    """Write passages, bm25s matrices and term maxima for `passages` into the (existing, empty) `directory`.

    `total`: the passage count if known (for the progress bar). `workers`: tokenizer processes (None: one per core;
    0: tokenize in this process). Spill files live in a temporary folder beside the
    output (same disk: at 21M passages they take ~10 GB) and are removed afterwards, also on failure.
    """
    directory = Path(directory)
    writer = PassageWriter(directory)
    work = Path(tempfile.mkdtemp(prefix=".spill-", dir=directory.parent))
    workers = default_workers() if workers is None else workers
    tokenizers = TokenizerPool(tokenize_batch, tokenize, workers)
    try:
        spiller = _Spiller(work, chunk_docs)
        id_hashes = array("q")
        for result in tokenized_batches(passages, writer, tokenizers, id_hashes, show_progress, total):
            spiller.add_batch(*result)
        spiller.spill()
        sha256 = writer.close()
        if not len(writer):
            raise ValueError("cannot build a BM25 index over zero passages")
        check_unique_ids(directory, id_hashes)
        out = directory / BM25S_DIR
        out.mkdir()
        postings = _merge(spiller, out, k1, b, block_postings, show_progress)
        if len(writer) >= PRUNE_MIN_DOCS:  # an index that will prune: see dspo/search/lookup_filter.py
            _write_lookup_filter(out, len(writer))
        _write_bm25s_meta(out, dict(spiller.vocab), k1, b, len(writer))
        return StreamedBuild(len(writer), len(spiller.vocab), postings, sha256)
    finally:
        tokenizers.close()
        shutil.rmtree(work, ignore_errors=True)


def _write_lookup_filter(out: Path, num_docs: int) -> None:
    from dspo.search import lookup_filter  # compiles with numba

    indices = np.asarray(np.load(out / _NAMES["indices"], mmap_mode="r"))
    lookup_filter.build(indices, np.load(out / _NAMES["indptr"]), num_docs, out.parent / LOOKUP_FILTER)


def default_workers() -> int:
    """Tokenizer processes: one per core (the main process reads, writes and merges beside them), at most 8."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def check_unique_ids(directory: Path, id_hashes: array) -> None:
    """Raise ValueError naming a duplicate passage id (8 bytes per passage in memory, not the ids themselves)."""
    hashes = np.sort(np.frombuffer(id_hashes, dtype=np.int64))
    clashing = set(hashes[1:][hashes[1:] == hashes[:-1]].tolist())
    if not clashing:
        return
    first: dict[str, int] = {}
    for i, p in enumerate(PassageStore(directory)):
        if hash(p.id) in clashing:
            if p.id in first:
                raise ValueError(
                    f"duplicate passage id {p.id!r} (passages #{first[p.id] + 1} and #{i + 1}); ids must be unique"
                )
            first[p.id] = i


def _write_bm25s_meta(out: Path, vocab: dict[str, int], k1: float, b: float, num_docs: int) -> None:
    params = {
        "k1": k1, "b": b, "delta": 0.5, "method": "lucene", "idf_method": "lucene", "dtype": "float32",
        "int_dtype": "int32", "num_docs": num_docs, "version": import_bm25s().__version__, "backend": "numpy",
    }  # fmt: skip
    (out / "params.index.json").write_text(json.dumps(params, indent=4))
    with (out / "vocab.index.json").open("w", encoding="utf-8") as handle:
        json.dump(vocab, handle, ensure_ascii=False)
