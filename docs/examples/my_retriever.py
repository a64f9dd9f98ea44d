"""A new retriever behind the `Retriever` protocol: BM25 hits re-ranked by title match (docs/extending.md, section 3).

Why a re-ranker: multi-hop questions name entities, and a passage *about* the named entity (its title occurs in the
query) is usually the one to read, while BM25 can rank first a passage that merely mentions the name often. This
wrapper takes BM25's top `candidates` and moves passages whose title occurs in the query (longest title first: the
most specific entity) to the front, keeping BM25's order otherwise. It accepts the BM25 config keys, so it drops into
any `retriever=` config by changing `_target_` only:

    PYTHONPATH=docs/examples dspo-train retriever._target_=my_retriever.TitleMatchReranker +retriever.candidates=20
"""

from __future__ import annotations

from typing import Any

from dspo.search import Retriever, load_retriever
from dspo.types import Passage


class TitleMatchReranker:
    """`Retriever`: re-ranks another retriever's top `candidates` hits; `base` or the BM25 keys build that retriever."""

    def __init__(self, base: Retriever | None = None, candidates: int = 20, **bm25: Any) -> None:
        if candidates < 1:
            raise ValueError(f"retriever.candidates must be >= 1, got {candidates}")
        if base is None and not bm25:
            raise ValueError("TitleMatchReranker needs `base` or the BM25 keys (retriever.index, retriever.corpus)")
        self.base = base if base is not None else load_retriever(**bm25)
        self.candidates = candidates

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-k passages per query, best first; errors of the base retriever propagate (never silent empties)."""
        hits = self.base.search(queries, max(k, self.candidates))
        return [rerank(query, passages)[:k] for query, passages in zip(queries, hits, strict=True)]


def rerank(query: str, passages: list[Passage]) -> list[Passage]:
    """Passages whose title occurs in the query first (longer titles first), then the rest; stable otherwise."""
    text = query.lower()

    def key(item: tuple[int, Passage]) -> tuple[int, int]:
        position, passage = item
        title = passage.title.strip().lower()
        matched = bool(title) and title in text
        return (0 if matched else 1, -len(title) if matched else position)

    return [passage for _, passage in sorted(enumerate(passages), key=key)]
