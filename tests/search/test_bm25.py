"""BM25 index: scoring formula, backend agreement, save/load, build_or_load_index, the Hydra retriever config."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from dspo.process.resources import data_dir
from dspo.search.base import Retriever
from dspo.search.bm25 import BM25Index, Tokenizer, _top_k, build_or_load_index, load_retriever, recall_at_k
from dspo.search.corpus import load_corpus
from dspo.types import Passage

REPO = Path(__file__).resolve().parents[2]
HOTPOTQA = data_dir() / "hotpotqa_dev500"

DOCS = [
    Passage("d0", "Paris", "Paris is the capital of France."),
    Passage("d1", "Berlin", "Berlin is the capital of Germany. Berlin is big."),
    Passage("d2", "Cats", "The cat sat on the mat."),
    Passage("d3", "Dogs", "Dogs chase cats and cats chase mice."),
]


def write_corpus(path: Path, passages: list[Passage]) -> Path:
    path.write_text("".join(json.dumps({"id": p.id, "contents": p.contents}) + "\n" for p in passages))
    return path


def lucene_score(query: list[str], doc: list[str], docs: list[list[str]], k1: float = 1.2, b: float = 0.75) -> float:
    """Reference Lucene BM25, written out from the formula."""
    avgdl = sum(map(len, docs)) / len(docs)
    total = 0.0
    for term in query:
        df = sum(term in d for d in docs)
        if df == 0:
            continue
        idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
        tf = doc.count(term)
        total += idf * tf / (tf + k1 * (1 - b + b * len(doc) / avgdl))
    return total


def test_tokenizer_lowercases_drops_stopwords_no_stemming() -> None:
    assert Tokenizer()("The Cats, and DOGS' 2nd home!") == ["cats", "dogs", "2nd", "home"]


@pytest.mark.parametrize("backend", ["bm25s", "rank_bm25"])
def test_scores_match_lucene_formula(backend: str) -> None:
    index = BM25Index.build(DOCS, backend=backend, show_progress=False)
    tok = Tokenizer()
    docs = [tok(f"{p.title} {p.text}") for p in DOCS]
    hits = index.search(["cats chase berlin"], k=4)[0]
    assert isinstance(index, Retriever) and len(index) == 4
    for hit in hits:
        i = [p.id for p in DOCS].index(hit.id)
        assert hit.score == pytest.approx(lucene_score(tok("cats chase berlin"), docs[i], docs), rel=1e-5)
    assert hits[0].id == "d3" and hits[0].title == "Dogs" and hits[0].text == DOCS[3].text
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_k_is_capped_and_unknown_query_gets_zero_scores_in_corpus_order() -> None:
    index = BM25Index.build(DOCS, show_progress=False)
    assert len(index.search(["paris"], k=50)[0]) == 4
    hits = index.search(["zzz unknown the"], k=2)[0]
    assert [(h.id, h.score) for h in hits] == [("d0", 0.0), ("d1", 0.0)]
    assert index.search([], k=3) == []
    with pytest.raises(ValueError, match="k must be >= 1"):
        index.search(["paris"], k=0)
    with pytest.raises(TypeError, match="list of queries"):
        index.search("paris", k=1)  # type: ignore[arg-type]


def test_top_k_breaks_ties_by_corpus_order() -> None:
    scores = np.array([1.0, 3.0, 1.0, 3.0, 0.0, 2.0], dtype=np.float32)
    assert _top_k(scores, 3).tolist() == [1, 3, 5]
    assert _top_k(scores, 5).tolist() == [1, 3, 5, 0, 2]
    assert _top_k(scores, 6).tolist() == [1, 3, 5, 0, 2, 4]


def test_build_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown BM25 backend"):
        BM25Index.build(DOCS, backend="faiss", show_progress=False)
    with pytest.raises(ValueError, match="zero passages"):
        BM25Index.build([], show_progress=False)
    with pytest.raises(ValueError, match="b=2"):
        BM25Index.build(DOCS, b=2, show_progress=False)


@pytest.mark.parametrize("backend", ["bm25s", "rank_bm25"])
@pytest.mark.parametrize("mmap", [False, True])
def test_save_load_round_trip(tmp_path: Path, backend: str, mmap: bool) -> None:
    index = BM25Index.build(DOCS, backend=backend, show_progress=False)
    index.save(tmp_path / "ix")
    loaded = BM25Index.load(tmp_path / "ix", mmap=mmap)
    queries = ["capital of germany", "cats", "mice dogs"]
    assert loaded.backend == backend and len(loaded) == len(index)
    assert loaded.search(queries, 3) == index.search(queries, 3)


def test_save_refuses_to_clobber(tmp_path: Path) -> None:
    index = BM25Index.build(DOCS, show_progress=False)
    index.save(tmp_path / "ix")
    with pytest.raises(FileExistsError, match="overwrite=true"):
        index.save(tmp_path / "ix", overwrite=False)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a dspo index"):
        index.save(tmp_path / "user")
    with pytest.raises(FileNotFoundError, match="dspo-index corpus=PATH"):
        BM25Index.load(tmp_path / "nothing")


def test_build_or_load_index_reuses_then_rebuilds_on_change(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", DOCS)
    first = build_or_load_index(corpus, tmp_path / "ix", show_progress=False)
    manifest_path = tmp_path / "ix" / "manifest.json"
    built_at = manifest_path.stat().st_mtime_ns
    manifest = json.loads(manifest_path.read_text())
    assert manifest["corpus"]["size"] == corpus.stat().st_size and manifest["num_passages"] == 4
    again = build_or_load_index(corpus, tmp_path / "ix", show_progress=False)
    assert again.search(["cats"], 2) == first.search(["cats"], 2)
    assert manifest_path.stat().st_mtime_ns == built_at  # loaded, not rebuilt
    write_corpus(corpus, [*DOCS, Passage("d4", "Mice", "Mice eat cheese.")])
    rebuilt = build_or_load_index(corpus, tmp_path / "ix", show_progress=False)
    assert len(rebuilt) == 5 and rebuilt.search(["cheese"], 1)[0][0].id == "d4"
    other = build_or_load_index(corpus, tmp_path / "ix", backend="rank_bm25", show_progress=False)
    assert other.backend == "rank_bm25" and BM25Index.load(tmp_path / "ix").backend == "rank_bm25"


def test_load_retriever_without_corpus_needs_an_index(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no BM25 index"):
        load_retriever(str(tmp_path / "none"))


def test_retriever_configs_instantiate(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", DOCS)
    with initialize_config_dir(config_dir=str(REPO / "conf" / "retriever"), version_base="1.3"):
        cfg = compose("bm25", overrides=[f"index={tmp_path / 'ix'}", f"corpus={corpus}", "show_progress=false"])
        built = instantiate(cfg)
        cfg_loaded = compose("bm25", overrides=[f"index={tmp_path / 'ix'}"])
        loaded = instantiate(cfg_loaded)
        remote = instantiate(compose("remote"))
    assert isinstance(built, Retriever) and isinstance(remote, Retriever)
    assert loaded.search(["paris capital"], 1)[0][0].id == "d0"
    assert remote.url == "http://127.0.0.1:8000/retrieve" and remote.max_wait_s == 600.0


@pytest.fixture(scope="module")
def hotpotqa_results() -> dict:
    passages = load_corpus(HOTPOTQA / "corpus.jsonl.gz")
    rows = [json.loads(line) for line in (HOTPOTQA / "questions.jsonl").read_text().splitlines() if line.strip()]
    queries = [row["question"] for row in rows]
    out = {"gold": [row["metadata"]["supporting_titles"] for row in rows]}
    for backend in ("bm25s", "rank_bm25"):
        out[backend] = BM25Index.build(passages, backend=backend, show_progress=False).search(queries, 5)
    return out


@pytest.mark.slow
def test_backends_agree_on_hotpotqa_questions(hotpotqa_results: dict) -> None:
    fast, ref = hotpotqa_results["bm25s"], hotpotqa_results["rank_bm25"]
    assert len(fast) == 500
    agree = sum([p.id for p in a] == [p.id for p in b] for a, b in zip(fast, ref)) / len(fast)
    print(f"\nbm25s vs rank_bm25 top-5 id agreement: {agree:.3f}")
    assert agree >= 0.99
    diffs = [abs(p.score - q.score) for a, b in zip(fast, ref) for p, q in zip(a, b)]
    assert max(diffs) < 1e-3


@pytest.mark.slow
def test_recall_at_5_of_supporting_titles(hotpotqa_results: dict) -> None:
    recall = recall_at_k(hotpotqa_results["bm25s"], hotpotqa_results["gold"])
    print(f"\nrecall@5 of supporting titles (bm25s): {recall:.3f}")
    assert recall >= 0.70
    assert recall_at_k(hotpotqa_results["rank_bm25"], hotpotqa_results["gold"]) == pytest.approx(recall, abs=0.01)
