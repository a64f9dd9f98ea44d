"""Streamed bm25s build (dspo/search/streamed.py): bit-identical to bm25s's in-memory build, bounded chunks,
duplicate ids refused, and the passage store it writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dspo.process.resources import data_dir
from dspo.search.backends import import_bm25s
from dspo.search.bm25 import BM25Index, Tokenizer, build_index_streamed, build_or_load_index, read_manifest
from dspo.search.corpus import load_corpus
from dspo.search.passages import OFFSETS, PassageStore
from dspo.search.streamed import TERM_MAX, build_streamed
from dspo.types import Passage

HOTPOTQA = data_dir() / "hotpotqa_dev500"


def columns(model) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    data, indices, indptr = model.scores["data"], model.scores["indices"], model.scores["indptr"]
    return {
        term: (np.asarray(indices[indptr[c] : indptr[c + 1]]), np.asarray(data[indptr[c] : indptr[c + 1]]))
        for term, c in model.vocab_dict.items()
        if c + 1 < len(indptr)
    }


@pytest.mark.parametrize(("k1", "b", "workers"), [(1.2, 0.75, 0), (0.9, 0.4, 2)])
def test_streamed_matrix_is_bit_identical_to_bm25s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, k1: float, b: float, workers: int
) -> None:
    passages = load_corpus(HOTPOTQA / "corpus.jsonl.gz")
    reference = BM25Index.build(passages, k1=k1, b=b, show_progress=False).engine.model
    # tiny batches, chunks and blocks: many tokenizer tasks, spills and merge blocks, so their seams are exercised
    monkeypatch.setattr("dspo.search.streamed.BATCH", 700)
    (tmp_path / "ix").mkdir()
    built = build_streamed(
        passages, tmp_path / "ix", Tokenizer(), k1, b, chunk_docs=1000, block_postings=4000, workers=workers
    )
    model = import_bm25s().BM25.load(str(tmp_path / "ix" / "bm25s"), mmap=True)
    got, want = columns(model), columns(reference)
    assert built.num_docs == len(passages) and built.vocab_size == len(got) == len(want)
    assert set(got) == set(want)
    for term, (docs, scores) in want.items():
        assert np.array_equal(got[term][0], docs) and np.array_equal(got[term][1], scores), term
    term_max = np.load(tmp_path / "ix" / TERM_MAX)
    assert term_max[model.vocab_dict["france"]] == want["france"][1].max()
    assert not list(tmp_path.glob(".spill-*")), "spill files must be removed"


def test_streamed_index_searches_like_the_in_memory_one(tmp_path: Path) -> None:
    passages = load_corpus(HOTPOTQA / "corpus.jsonl.gz")
    questions = [json.loads(line)["question"] for line in (HOTPOTQA / "questions.jsonl").read_text().splitlines()]
    memory = BM25Index.build(passages, show_progress=False)
    build_index_streamed(iter(passages), tmp_path / "ix", show_progress=False)
    disk = BM25Index.load(tmp_path / "ix", mmap=True)
    assert isinstance(disk.passages, PassageStore) and len(disk) == len(passages)
    assert disk.search(questions, 5) == memory.search(questions, 5)
    assert disk.digest == memory.digest == read_manifest(tmp_path / "ix")["digest"]


def test_digest_names_corpus_parameters_and_backend(tmp_path: Path) -> None:
    docs = [Passage("a", "A", "alpha beta"), Passage("b", "B", "beta gamma")]
    base = BM25Index.build(docs, show_progress=False).digest
    assert len(base) == 16
    assert BM25Index.build(docs, k1=0.9, b=0.4, show_progress=False).digest != base
    assert BM25Index.build(docs, backend="rank_bm25", show_progress=False).digest != base
    assert BM25Index.build([docs[0], Passage("b", "B", "beta delta")], show_progress=False).digest != base
    assert BM25Index.build(list(docs), show_progress=False).digest == base


def test_streamed_build_refuses_duplicate_ids_and_leaves_nothing(tmp_path: Path) -> None:
    docs = [Passage("a", "A", "alpha"), Passage("b", "B", "beta"), Passage("a", "C", "gamma")]
    with pytest.raises(ValueError, match=r"duplicate passage id 'a' \(passages #1 and #3\)"):
        build_index_streamed(docs, tmp_path / "ix", show_progress=False)
    assert not (tmp_path / "ix").exists() and list(tmp_path.iterdir()) == []


def test_old_index_without_offsets_loads_and_keeps_its_digest(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"t{i}\nword{i} common"}) + "\n" for i in range(5)))
    index = build_or_load_index(corpus, tmp_path / "ix", show_progress=False)
    (tmp_path / "ix" / OFFSETS).unlink()  # as written before the offset table existed
    manifest = read_manifest(tmp_path / "ix")
    del manifest["passages_sha256"], manifest["digest"]
    (tmp_path / "ix" / "manifest.json").write_text(json.dumps(manifest))
    old = BM25Index.load(tmp_path / "ix")
    assert old.digest == index.digest and old.search(["word3"], 1)[0][0].id == "3"
    assert [p.id for p in old.passages] == [str(i) for i in range(5)]
    assert [p.id for p in old.passages[1:4:2]] == ["1", "3"] and old.passages[-1].id == "4"
    with pytest.raises(IndexError, match="out of range"):
        old.passages[5]
