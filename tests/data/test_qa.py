"""QA loaders: the three schemas on small fixtures, the shared benchmark files, and the error paths."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from dspo.data.qa import QADataError, check_source, load_benchmarks, load_qa, looks_like_path
from dspo.process.resources import data_dir

BENCHMARKS = data_dir() / "benchmarks"
COUNTS = {
    "nq": 998,  # 1,000 rows; 2 have only golds that normalize to "" (`---`, `)`) and are skipped
    "triviaqa": 1000,
    "popqa": 1000,
    "hotpotqa": 500,
    "2wikimultihopqa": 500,
    "musique": 500,
    "bamboogle": 125,
}

SEARCH_R1_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first. "
    "Question: who wrote hamlet?\n"
)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_flashrag_jsonl(tmp_path: Path) -> None:
    rows = [
        {"id": "a1", "question": " who wrote hamlet? ", "golden_answers": ["Shakespeare", "W. Shakespeare"]},
        {"id": "a2", "question": "capital of france", "golden_answers": ["Paris"], "metadata": {"level": "easy"}},
    ]
    items = load_qa(write_jsonl(tmp_path / "mini.jsonl", rows))
    assert [i.id for i in items] == ["a1", "a2"]
    assert items[0].question == "who wrote hamlet?"
    assert items[0].golden_answers == ["Shakespeare", "W. Shakespeare"]
    assert {i.benchmark for i in items} == {"mini"}
    assert items[1].metadata == {"level": "easy"}


def test_search_r1_parquet_with_prompt_only(tmp_path: Path) -> None:
    import datasets

    rows = {
        "data_source": ["nq", "hotpotqa"],
        "prompt": [[{"role": "user", "content": SEARCH_R1_PROMPT}], [{"role": "user", "content": "Question: x y?"}]],
        "ability": ["fact-reasoning"] * 2,
        "reward_model": [
            {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
            {"style": "rule", "ground_truth": {"target": ["z"]}},
        ],
        "extra_info": [{"split": "train", "index": 7}, {"split": "train", "index": 8}],
    }
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    items = load_qa(str(path))
    assert [i.question for i in items] == ["who wrote hamlet?", "x y?"]
    assert [i.benchmark for i in items] == ["nq", "hotpotqa"]
    assert [i.id for i in items] == ["nq_7", "hotpotqa_8"]
    assert items[0].golden_answers == ["Shakespeare"]
    # A folder resolves to its `<split>.parquet`.
    assert [i.question for i in load_qa(str(tmp_path), split="train")] == ["who wrote hamlet?", "x y?"]


def test_search_r1_string_prompt_and_target_prefers_question_column(tmp_path: Path) -> None:
    rows = [
        {
            "id": "q0",
            "question": "who wrote hamlet?",
            "prompt": SEARCH_R1_PROMPT,
            "data_source": "nq",
            "reward_model": {"ground_truth": {"target": "Shakespeare"}},
        },
        {
            "prompt": "Question: who painted guernica?",
            "data_source": "nq",
            "reward_model": {"ground_truth": {"target": 1937}},
        },
    ]
    items = load_qa(write_jsonl(tmp_path / "sr1.jsonl", rows))
    assert items[0].question == "who wrote hamlet?" and items[0].golden_answers == ["Shakespeare"]
    assert items[1].question == "who painted guernica?" and items[1].golden_answers == ["1937"]
    assert items[1].id == "nq_1"


def test_plain_answer_and_answers(tmp_path: Path) -> None:
    one = load_qa(write_jsonl(tmp_path / "one.jsonl", [{"question": "q?", "answer": "x"}]))
    many = load_qa(write_jsonl(tmp_path / "many.json", [{"question": "q?", "answers": ["x", "b"]}]))
    assert one[0].golden_answers == ["x"] and one[0].id == "one_0" and one[0].benchmark == "one"
    assert many[0].golden_answers == ["x", "b"] and many[0].benchmark == "many"


def test_benchmark_argument_and_limit(tmp_path: Path) -> None:
    rows = [{"id": str(i), "question": f"q{i}", "golden_answers": ["x"]} for i in range(5)]
    items = load_qa(write_jsonl(tmp_path / "x.jsonl", rows), benchmark="custom", limit=3)
    assert [i.id for i in items] == ["0", "1", "2"] and {i.benchmark for i in items} == {"custom"}
    assert load_qa(str(tmp_path / "x.jsonl"), limit=0) == []


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_shared_benchmark_files(name: str) -> None:
    items = load_qa(str(BENCHMARKS / f"{name}.jsonl"))
    assert len(items) == COUNTS[name]
    assert {i.benchmark for i in items} == {name}
    assert all(i.question and i.golden_answers and all(isinstance(g, str) for g in i.golden_answers) for i in items)
    assert len({i.id for i in items}) == len(items)


def test_load_benchmarks_files_and_limit() -> None:
    files = {name: str(BENCHMARKS / f"{name}.jsonl") for name in COUNTS}
    sets = load_benchmarks(files, limit=3)
    assert list(sets) == list(COUNTS)
    assert all(len(v) == 3 and {i.benchmark for i in v} == {k} for k, v in sets.items())
    full = load_benchmarks(files)
    assert {k: len(v) for k, v in full.items()} == COUNTS


def test_load_benchmarks_single_path_groups_by_data_source(tmp_path: Path) -> None:
    rows = [
        {"id": "1", "question": "a?", "golden_answers": ["x"], "data_source": "nq"},
        {"id": "2", "question": "b?", "golden_answers": ["y"], "data_source": "hotpotqa"},
        {"id": "3", "question": "c?", "golden_answers": ["z"], "data_source": "nq"},
    ]
    sets = load_benchmarks(path=write_jsonl(tmp_path / "mixed.jsonl", rows), limit=1)
    assert {k: [i.id for i in v] for k, v in sets.items()} == {"nq": ["1"], "hotpotqa": ["2"]}
    single = load_benchmarks(path=str(BENCHMARKS / "bamboogle.jsonl"), limit=2)
    assert list(single) == ["bamboogle"] and len(single["bamboogle"]) == 2


def test_missing_field_names_file_and_row(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"id": "1", "question": "ok?", "golden_answers": ["x"]}, {"id": "2", "question": "", "golden_answers": ["b"]}],
    )
    with pytest.raises(QADataError, match=r"bad\.jsonl row 1: missing or empty field 'question'"):
        load_qa(path)
    path = write_jsonl(tmp_path / "empty_golds.jsonl", [{"id": "1", "question": "q", "golden_answers": []}])
    with pytest.raises(QADataError, match=r"empty_golds\.jsonl row 0: field 'golden_answers' has no non-empty"):
        load_qa(path)
    path = write_jsonl(
        tmp_path / "sr1.jsonl", [{"prompt": "Question: q", "reward_model": {"style": "rule"}, "data_source": "nq"}]
    )
    with pytest.raises(QADataError, match=r"sr1\.jsonl row 0: missing field 'reward_model\.ground_truth\.target'"):
        load_qa(path)


def test_unknown_schema_and_bad_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(tmp_path / "odd.jsonl", [{"query": "q", "label": "a"}])
    with pytest.raises(QADataError, match=r"odd\.jsonl: cannot tell the schema from columns \['label', 'query'\]"):
        load_qa(path)
    with pytest.raises(QADataError, match=f"not found: {tmp_path / 'missing.jsonl'}"):
        load_qa(str(tmp_path / "missing.jsonl"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(QADataError, match="unsupported file type '.txt'"):
        load_qa(str(tmp_path / "notes.txt"))
    with pytest.raises(QADataError, match="folder has no test.jsonl"):
        load_qa(str(tmp_path), split="test")
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "golden_answers": ["x"]}\n{not json\n')
    with pytest.raises(QADataError, match=r"broken\.jsonl: could not read as json"):
        load_qa(str(tmp_path / "broken.jsonl"))
    with pytest.raises(QADataError, match="limit must be >= 0"):
        load_qa(str(BENCHMARKS / "nq.jsonl"), limit=-1)
    with pytest.raises(QADataError, match="give `files`"):
        load_benchmarks({})


def test_hub_name_refused_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(QADataError, match="hub dataset, but the machine is offline"):
        load_qa("RUC-NLPIR/FlashRAG_datasets:nq", split="test")


def test_load_benchmarks_root_resolves_relative_names() -> None:
    sets = load_benchmarks({"nq": "nq.jsonl", "musique": "musique.jsonl"}, limit=2, root=str(BENCHMARKS))
    assert {k: len(v) for k, v in sets.items()} == {"nq": 2, "musique": 2}
    absolute = str(BENCHMARKS / "bamboogle.jsonl")  # an absolute entry ignores root
    assert len(load_benchmarks({"bamboogle": absolute}, root="/nonexistent")["bamboogle"]) == 125


def test_golds_that_normalize_to_empty_are_dropped_and_counted(tmp_path: Path, caplog) -> None:
    """Issue 29 (9): `*`, `---` can never be matched (dspo.metrics); they are dropped at load, and a question left
    without a gold is skipped, with a count in the log."""
    rows = [
        {"id": "a", "question": "q1", "golden_answers": ["the symbol ×", "*"]},
        {"id": "b", "question": "q2", "golden_answers": ["---"]},
        {"id": "c", "question": "q3", "golden_answers": ["Paris"]},
    ]
    with caplog.at_level("WARNING", logger="dspo.data.qa"):
        items = load_qa(write_jsonl(tmp_path / "nq.jsonl", rows))
    assert [(i.id, i.golden_answers) for i in items] == [("a", ["the symbol ×"]), ("c", ["Paris"])]
    assert "dropped 2 gold answer(s)" in caplog.text and "skipped 1 question(s)" in caplog.text


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("./raw/nq", True),
        ("/data/raw/nq", True),
        ("~/raw/nq", True),
        ("nq", True),  # no owner: not a hub name
        ("raw/nq/train.jsonl", True),  # more than one '/'
        ("raw/nq.parquet", True),  # a file suffix
        ("raw/nq", False),  # no ./raw here: a hub candidate
        ("RUC-NLPIR/FlashRAG_datasets:nq", False),
        ("owner/squad_v1.1", False),  # dots are allowed in hub names
    ],
)
def test_looks_like_path(source: str, expected: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert looks_like_path(source) is expected
    (tmp_path / "raw").mkdir()  # once ./raw is a folder, raw/... can only be a path
    assert looks_like_path("raw/nq") and looks_like_path("raw/nq:config")


def test_missing_local_path_is_named_with_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DSPO_HUB_MIRROR", raising=False)
    with pytest.raises(QADataError, match=f"not found: {tmp_path / 'raw' / 'nq'} "):
        load_qa("./raw/nq")
    (tmp_path / "raw" / "hotpotqa").mkdir(parents=True)
    start = time.perf_counter()
    with pytest.raises(QADataError, match=rf"not found: {tmp_path / 'raw' / 'nq'} .*raw holds: hotpotqa"):
        load_qa("raw/nq")  # ./raw exists: a path, never sent to the hub
    assert time.perf_counter() - start < 5


def _closed_port_endpoint() -> str:
    with socket.socket() as sock:  # a port that was free a moment ago: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_unreachable_hub_fails_fast_and_names_the_missing_local_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`raw/nq` with no ./raw folder is a hub candidate; the hub does not answer: one quick error, no retry loop."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    for var in ("DSPO_HUB_MIRROR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", _closed_port_endpoint())
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read at import, from conftest's HF_HUB_OFFLINE=1
    start = time.perf_counter()
    with pytest.raises(QADataError) as error:
        load_qa("raw/nq", split="train")
    assert time.perf_counter() - start < 5
    message = str(error.value)
    assert "cannot be reached" in message and f"No local path {tmp_path / 'raw' / 'nq'} exists" in message
    assert "./raw/nq" in message and "ConnectError" in message  # the request was made, and refused


def test_missing_mirror_and_missing_snapshot_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # a mirror is how offline machines read hub names
    monkeypatch.setenv("DSPO_HUB_MIRROR", str(tmp_path / "nonexistent"))
    with pytest.raises(QADataError, match=f"DSPO_HUB_MIRROR={tmp_path / 'nonexistent'} does not exist"):
        load_qa("RUC-NLPIR/FlashRAG_datasets:nq", split="test")
    (tmp_path / "mirror" / "RUC-NLPIR").mkdir(parents=True)
    monkeypatch.setenv("DSPO_HUB_MIRROR", str(tmp_path / "mirror"))
    looked_for = tmp_path / "mirror" / "RUC-NLPIR" / "FlashRAG_datasets"
    with pytest.raises(QADataError, match=f"looked for the folder {looked_for}"):
        check_source("RUC-NLPIR/FlashRAG_datasets:nq")
