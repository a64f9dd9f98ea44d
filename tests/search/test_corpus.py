"""Corpus loading: both line formats, streaming, gzip, and the path:line errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dspo.process.resources import data_dir
from dspo.search.corpus import iter_corpus, load_corpus, split_contents

HOTPOTQA_CORPUS = data_dir() / "hotpotqa_dev500" / "corpus.jsonl.gz"


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_flashrag_and_title_text_forms(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "c.jsonl",
        [
            json.dumps({"id": "a", "contents": '"Paris"\nParis is the capital.\nSecond line.'}),
            "",
            json.dumps({"id": 7, "title": "Rome", "text": "Rome is old."}),
            json.dumps({"id": "c", "contents": "no title here"}),
        ],
    )
    passages = load_corpus(path)
    assert [(p.id, p.title, p.text) for p in passages] == [
        ("a", "Paris", "Paris is the capital.\nSecond line."),
        ("7", "Rome", "Rome is old."),
        ("c", "", "no title here"),
    ]
    assert passages[0].contents == '"Paris"\nParis is the capital.\nSecond line.'
    assert all(p.score == 0.0 for p in passages)


def test_iter_corpus_streams_and_reads_gzip(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for i in range(3):
            handle.write(json.dumps({"id": str(i), "contents": f'"T{i}"\nbody {i}'}) + "\n")
    stream = iter_corpus(path)
    assert next(stream).title == "T0"  # a generator: nothing is read before it is consumed
    assert [p.id for p in stream] == ["1", "2"]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"contents": '"T"\nx'}), "missing key 'id'"),
        (json.dumps({"id": 1.5, "contents": "x"}), "'id' must be a string or an integer"),
        (json.dumps({"id": "x", "title": "T"}), "need either 'contents'"),
        (json.dumps({"id": "x", "contents": 3}), "'contents' must be a string"),
        (json.dumps({"id": "x", "title": 3, "text": "t"}), "'title' and 'text' must be strings"),
    ],
)
def test_malformed_line_names_path_line_and_reason(tmp_path: Path, line: str, reason: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"id": "ok", "contents": '"T"\nfine'}), "", line])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{reason}"):
        load_corpus(path)


def test_duplicate_ids_missing_and_empty_files(tmp_path: Path) -> None:
    rows = [json.dumps({"id": "a", "text": "x"}), json.dumps({"id": "a", "text": "y"})]
    dup = write_lines(tmp_path / "dup.jsonl", rows)
    with pytest.raises(ValueError, match=r"dup\.jsonl:2: duplicate passage id 'a' \(first seen on line 1\)"):
        load_corpus(dup)
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        load_corpus(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="corpus is empty"):
        load_corpus(write_lines(tmp_path / "empty.jsonl", [""]))


def test_split_contents_keeps_inner_quotes() -> None:
    assert split_contents('"A "quoted" title"\ntext') == ('A "quoted" title', "text")
    assert split_contents("Plain title\ntext") == ("Plain title", "text")


def test_hotpotqa_corpus_loads() -> None:
    passages = load_corpus(HOTPOTQA_CORPUS)
    assert len(passages) == 4943
    assert passages[0].title == "Meet Corliss Archer"
