"""A deterministic, streamed synthetic corpus shaped like Search-R1's wiki-18 (21,015,324 passages of ~100 words).

Why synthetic: the real dump is 14 GB and may not be downloaded here; what the scale benchmark needs is its shape.
- Vocabulary: the 33 stop words of the analyzer take the top ranks (as "the", "of", "and" do in English), followed by
  2M pseudo-words; word ranks follow Zipf's law (p(r) ~ 1/r), as natural text does.
- A passage: a title of 1-3 content words (rank >= 1000) and a text of 100 words (wiki-18's passages are 100-word
  chunks of articles), in FlashRAG's `{"id", "contents": "\\"title\\"\\ntext"}` form.
- Chunk i of 100,000 passages is drawn from `numpy.random.default_rng([seed, i])`: any size is a prefix of any larger
  one, and a chunk never depends on the chunks before it.
- Queries: 1,000 passages drawn uniformly (from their own generator); each query is its passage's title and 6 words
  of its text, stop words and frequent words included, as agents write them ("what year did the ... open").
  Relevance: the query's source passage (the benchmark reports how often it is in the top 3).

Sampling 2.1 billion Zipfian words quickly: a 2^24-slot table maps a uniform draw to its rank directly; the draws that
land in a slot covering several (tail) ranks are resolved by binary search on the exact CDF.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

WIKI18_PASSAGES = 21_015_324
CHUNK = 100_000
WORDS = 100
VOCAB = 2_000_000
STOPWORDS = (
    "the",
    "of",
    "and",
    "in",
    "a",
    "to",
    "was",
    "is",
    "for",
    "on",
    "as",
    "by",
    "with",
    "at",
    "that",
    "an",
    "it",
    "his",
    "from",
    "which",
    "he",
    "be",
    "were",
    "are",
    "this",
    "or",
    "also",
    "has",
    "had",
    "its",
    "not",
    "their",
    "but",
)  # fmt: skip  (English frequency order; includes a few words the analyzer keeps, as real text does)
_TABLE_BITS = 24


class ZipfWords:
    """The vocabulary and a fast sampler of word ranks."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng([seed, 2**31])
        letters = rng.integers(ord("a"), ord("z") + 1, size=(VOCAB, 12), dtype=np.uint8)
        lengths = rng.integers(3, 13, size=VOCAB)
        pseudo = [bytes(row[:n]).decode() for row, n in zip(letters, lengths.tolist(), strict=True)]
        self.words = np.array(list(STOPWORDS) + pseudo, dtype=object)
        weights = 1.0 / np.arange(1, self.words.size + 1)
        self.cdf = np.cumsum(weights / weights.sum())
        self.cdf[-1] = 1.0
        slots = (np.arange(2**_TABLE_BITS) + 0.5) / 2**_TABLE_BITS
        edges = np.arange(2**_TABLE_BITS + 1) / 2**_TABLE_BITS
        self.table = np.searchsorted(self.cdf, slots, side="right").astype(np.int32)
        self.exact = np.searchsorted(self.cdf, edges[:-1], side="right") == np.searchsorted(
            self.cdf, np.minimum(edges[1:], 1.0) - 1e-18, side="right"
        )

    def ranks(self, rng: np.random.Generator, size: int) -> np.ndarray:
        u = rng.random(size)
        slot = (u * 2**_TABLE_BITS).astype(np.int64)
        ranks = self.table[slot].astype(np.int64)
        coarse = ~self.exact[slot]
        ranks[coarse] = np.searchsorted(self.cdf, u[coarse], side="right")
        return np.minimum(ranks, self.words.size - 1)


def chunk_passages(words: ZipfWords, seed: int, chunk: int, count: int) -> list[tuple[str, str, str]]:
    """(id, title, text) of passages chunk * CHUNK ... + count - 1."""
    rng = np.random.default_rng([seed, chunk])
    text_words = words.words[words.ranks(rng, count * WORDS)].reshape(count, WORDS).tolist()
    title_len = rng.integers(1, 4, size=count).tolist()
    content = 1000 + (words.ranks(rng, count * 3) % (words.words.size - 1000))
    titles = words.words[content].reshape(count, 3).tolist()
    base = chunk * CHUNK
    return [(str(base + i), " ".join(titles[i][: title_len[i]]).title(), " ".join(text_words[i])) for i in range(count)]


def iter_passages(size: int, seed: int = 0, words: ZipfWords | None = None) -> Iterator[tuple[str, str, str]]:
    words = words or ZipfWords(seed)
    for chunk in range((size + CHUNK - 1) // CHUNK):
        yield from chunk_passages(words, seed, chunk, min(CHUNK, size - chunk * CHUNK))


_WORDS: ZipfWords | None = None  # one vocabulary per generator process


def _chunk_job(job: tuple[int, int, int, list[int]]) -> tuple[str, list[dict]]:
    """(JSON Lines text, queries) of one chunk; `wanted`: the global indices of its query passages."""
    global _WORDS
    seed, chunk, count, wanted = job
    if _WORDS is None:
        _WORDS = ZipfWords(seed)
    rows = chunk_passages(_WORDS, seed, chunk, count)
    # letters and spaces only: the JSON is written without an encoder
    text = "".join(f'{{"id": "{pid}", "contents": "\\"{title}\\"\\n{body}"}}\n' for pid, title, body in rows)
    picker, queries = np.random.default_rng([seed, 2**33, chunk]), []
    for index in wanted:
        _, title, body = rows[index - chunk * CHUNK]
        tokens, picked = body.split(), sorted(picker.choice(WORDS, size=6, replace=False).tolist())
        queries.append({"query": " ".join([title.lower()] + [tokens[j] for j in picked]), "id": str(index)})
    return text, queries


def write_corpus(path: Path, size: int, seed: int = 0, num_queries: int = 1000, processes: int = 2) -> list[dict]:
    """Write `size` passages to `path` (JSON Lines, chunks generated in `processes` processes, written in order)
    and return the queries ([{"query", "id"}], in the order their passages were drawn)."""
    import multiprocessing

    wanted = np.random.default_rng([seed, 2**32]).choice(size, size=min(num_queries, size), replace=False).tolist()
    by_chunk: dict[int, list[int]] = {}
    for index in sorted(wanted):
        by_chunk.setdefault(index // CHUNK, []).append(index)
    chunks = (size + CHUNK - 1) // CHUNK
    jobs = [(seed, c, min(CHUNK, size - c * CHUNK), by_chunk.get(c, [])) for c in range(chunks)]
    queries: dict[str, dict] = {}
    with path.open("w", encoding="utf-8") as handle, multiprocessing.get_context("spawn").Pool(processes) as pool:
        for text, chunk_queries in pool.imap(_chunk_job, jobs):
            handle.write(text)
            queries.update({q["id"]: q for q in chunk_queries})
    return [queries[str(i)] for i in wanted]


def save_queries(path: Path, queries: list[dict]) -> None:
    path.write_text("".join(json.dumps(q) + "\n" for q in queries))
