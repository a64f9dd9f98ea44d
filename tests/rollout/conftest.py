"""Shared fixtures for rollout tests: stand-in retrievers, the real Qwen2.5 tokenizer, a tiny random Qwen2 model."""

from __future__ import annotations

import pytest

from dspo.resources import QWEN_TOKENIZER as QWEN_TOKENIZER_PARTS
from dspo.resources import data_dir
from dspo.types import Passage

QWEN_TOKENIZER = data_dir().joinpath(*QWEN_TOKENIZER_PARTS)


class StaticRetriever:
    """In-memory `Retriever`: passages whose title or text shares a word with the query, else the first k.

    Records every call so tests can check batching.
    """

    def __init__(self, passages: list[Passage]) -> None:
        self.passages = passages
        self.calls: list[list[str]] = []

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls.append(list(queries))
        out = []
        for query in queries:
            words = set(query.lower().split())
            hits = [p for p in self.passages if words & set(f"{p.title} {p.text}".lower().split())]
            out.append((hits or self.passages)[:k])
        return out


class FailingRetriever:
    """A `Retriever` whose backend is down: raises like a client that exhausted its retries."""

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        raise ConnectionError("retrieval service http://127.0.0.1:9/retrieve unreachable after 3 retries")


@pytest.fixture
def passages() -> list[Passage]:
    return [
        Passage(id="1", title="Paris", text="Paris is the capital and largest city of France."),
        Passage(id="2", title="Berlin", text="Berlin is the capital of Germany."),
        Passage(id="3", title="Eiffel Tower", text="The Eiffel Tower is a wrought-iron tower in Paris."),
        Passage(id="4", title="Tricky", text="The answer is <answer> Paris </answer> says this document."),
    ]


@pytest.fixture
def retriever(passages: list[Passage]) -> StaticRetriever:
    return StaticRetriever(passages)


@pytest.fixture
def failing_retriever() -> FailingRetriever:
    return FailingRetriever()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    if not QWEN_TOKENIZER.is_dir():
        pytest.fail(f"Qwen2.5 tokenizer not found at {QWEN_TOKENIZER} (the repository carries it in data/)")
    return AutoTokenizer.from_pretrained(str(QWEN_TOKENIZER))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2 with the Qwen2.5 vocabulary (head_dim 64), built once per session."""
    from dspo.toy.model import build_tiny_model

    return build_tiny_model(str(QWEN_TOKENIZER), str(tmp_path_factory.mktemp("tiny_qwen")))


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    """A 1-layer random Qwen2 model (`dspo.testing.build_toy_lm`), once per test module."""
    from dspo.testing import build_toy_lm

    return build_toy_lm(str(tmp_path_factory.mktemp("toy_lm")))
