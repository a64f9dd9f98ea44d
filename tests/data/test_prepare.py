"""dspo-prepare-data on local fixtures: FlashRAG split folders, a Search-R1 merged test parquet, the dev fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspo.data.prepare import load_with_splits, prepare, summary
from dspo.data.qa import QADataError, load_qa

ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def flashrag_rows(prefix: str, n: int) -> list[dict]:
    return [
        {"id": f"train_{i}", "question": f"{prefix} question {i}", "golden_answers": [f"{prefix}{i}"]} for i in range(n)
    ]


@pytest.fixture()
def sources(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    write_jsonl(raw / "nq" / "train.jsonl", flashrag_rows("nq", 6))
    write_jsonl(raw / "nq" / "test.jsonl", flashrag_rows("nqtest", 3))
    write_jsonl(raw / "hotpotqa" / "train.jsonl", flashrag_rows("hp", 4))
    write_jsonl(raw / "hotpotqa" / "dev.jsonl", flashrag_rows("hpdev", 2))  # no test split: falls back to dev
    import datasets

    datasets.Dataset.from_dict(
        {
            "data_source": ["bamboogle", "popqa", "bamboogle"],
            "prompt": [[{"role": "user", "content": f"Answer it. Question: q{i}?\n"}] for i in range(3)],
            "reward_model": [{"style": "rule", "ground_truth": {"target": [f"a{i}"]}} for i in range(3)],
            "extra_info": [{"split": "test", "index": i} for i in range(3)],
        }
    ).to_parquet(str(raw / "search_r1_test.parquet"))
    return raw


def test_prepare_train_and_test(sources: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    counts = prepare(
        str(out),
        train_sources=[str(sources / "nq"), str(sources / "hotpotqa")],
        test_sources=[str(sources / "nq"), str(sources / "hotpotqa"), str(sources / "search_r1_test.parquet")],
        seed=3,
    )
    assert counts == {
        "train.jsonl": 10,
        "test/nq.jsonl": 3,
        "test/hotpotqa.jsonl": 2,
        "test/bamboogle.jsonl": 2,
        "test/popqa.jsonl": 1,
    }
    train = load_qa(str(out / "train.jsonl"))
    assert sorted(i.benchmark for i in train) == ["hotpotqa"] * 4 + ["nq"] * 6
    assert len({i.id for i in train}) == 10 and "nq_train_0" in {i.id for i in train}  # shared ids prefixed
    assert all(i.question.endswith("?") for i in train)
    # Shuffled with the seed: deterministic, and not the concatenation order.
    again = prepare(str(tmp_path / "again"), [str(sources / "nq"), str(sources / "hotpotqa")], [], seed=3)
    assert again == {"train.jsonl": 10}
    assert [i.id for i in load_qa(str(tmp_path / "again" / "train.jsonl"))] == [i.id for i in train]
    assert [i.benchmark for i in train] != ["nq"] * 6 + ["hotpotqa"] * 4
    hotpot_test = load_qa(str(out / "test" / "hotpotqa.jsonl"))
    assert [i.golden_answers for i in hotpot_test] == [["hpdev0"], ["hpdev1"]]
    bamboogle = load_qa(str(out / "test" / "bamboogle.jsonl"))
    assert [i.question for i in bamboogle] == ["q0?", "q2?"] and {i.benchmark for i in bamboogle} == {"bamboogle"}
    assert "test/popqa.jsonl" in summary(str(out), counts)


def test_prepare_limits_and_refuses_non_empty_dir(sources: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    counts = prepare(
        str(out), [str(sources / "nq")], [str(sources / "nq")], train_limit=2, test_limit=1, add_question_mark=False
    )
    assert counts == {"train.jsonl": 2, "test/nq.jsonl": 1}
    assert not load_qa(str(out / "train.jsonl"))[0].question.endswith("?")
    with pytest.raises(FileExistsError, match="not empty"):
        prepare(str(out), [str(sources / "nq")], [])
    assert prepare(str(out), [str(sources / "nq")], [], overwrite=True) == {"train.jsonl": 6}


def test_load_with_splits_errors(sources: Path) -> None:
    with pytest.raises(QADataError, match=r"none of the splits \['test', 'validation'\]"):
        load_with_splits(str(sources / "hotpotqa"), ["test", "validation"])
    write_jsonl(sources / "bad" / "test.jsonl", [{"question": "q", "golden_answers": []}])
    with pytest.raises(QADataError, match="row 0"):  # a bad row is not retried as a missing split
        load_with_splits(str(sources / "bad"), ["test", "dev"])


def test_prepare_checks_every_source_before_writing(sources: Path, tmp_path: Path) -> None:
    """A missing test source stops the run before the (long) training sources are read or anything is written."""
    out = tmp_path / "out"
    missing = tmp_path / "raw" / "triviaqa"
    with pytest.raises(QADataError, match=f"not found: {missing} "):
        prepare(str(out), [str(sources / "nq")], [str(sources / "nq"), str(missing)])
    assert not out.exists()


def test_cli_names_a_missing_local_folder(sources: Path, tmp_path: Path) -> None:
    """The docs' offline form with a folder that is not there: exit 1, the absolute path, no traceback, no hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("DSPO_HUB_MIRROR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # never asked: raw/ exists here, so raw/triviaqa is a path
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspo.data.prepare",
            "output_dir=out",
            "train_sources=[raw/nq]",
            "test_sources=[raw/triviaqa]",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"dspo-prepare-data: error: not found: {tmp_path / 'raw' / 'triviaqa'} ")
    assert "Traceback" not in result.stderr and "Hub" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_writes_files(sources: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli_out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspo.data.prepare",
            f"output_dir={out}",
            f"train_sources=[{sources / 'nq'}]",
            f"test_sources=[{sources / 'search_r1_test.parquet'}]",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "train.jsonl" in result.stdout and "test/bamboogle.jsonl" in result.stdout
    assert sorted(p.name for p in (out / "test").iterdir()) == ["bamboogle.jsonl", "popqa.jsonl"]
    assert not (tmp_path / "outputs").exists() and not (tmp_path / ".hydra").exists()


# The hub repositories' own layouts, as `hf download --repo-type dataset` writes them: FlashRAG_datasets declares one
# config per benchmark in its README (`configs:` with `data_files` per split); Search-R1's train/test repository holds
# bare parquet files whose names are the splits.
FLASHRAG_SPLITS = {
    "nq": ("train", "test"),
    "hotpotqa": ("train", "dev"),
    "triviaqa": ("test",),
    "popqa": ("test",),
    "2wikimultihopqa": ("dev",),
    "musique": ("dev",),
    "bamboogle": ("test",),
}


def flashrag_hub_snapshot(root: Path) -> Path:
    repo = root / "RUC-NLPIR" / "FlashRAG_datasets"
    configs = []
    for name, splits in FLASHRAG_SPLITS.items():
        files = "".join(f"  - split: {split}\n    path: {name}/{split}.jsonl\n" for split in splits)
        configs.append(f"- config_name: {name}\n  data_files:\n{files}")
        for split in splits:
            write_jsonl(repo / name / f"{split}.jsonl", flashrag_rows(f"{name}-{split}-", 3))
    (repo / "README.md").write_text("---\nconfigs:\n" + "".join(configs) + "---\n# FlashRAG datasets (test copy)\n")
    return repo


def test_hub_names_read_from_a_local_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flashrag_hub_snapshot(tmp_path / "mirror")
    monkeypatch.setenv("DSPO_HUB_MIRROR", str(tmp_path / "mirror"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    items = load_with_splits("RUC-NLPIR/FlashRAG_datasets:hotpotqa", ["test", "dev"])
    assert [i.golden_answers for i in items] == [["hotpotqa-dev-0"], ["hotpotqa-dev-1"], ["hotpotqa-dev-2"]]
    assert {i.benchmark for i in items} == {"hotpotqa"}  # the config names the benchmark
    search_r1 = tmp_path / "mirror" / "PeterJinGo" / "nq_hotpotqa_train"
    search_r1.mkdir(parents=True)
    import datasets

    datasets.Dataset.from_dict(
        {
            "data_source": ["nq", "hotpotqa"],
            "prompt": [[{"role": "user", "content": f"Answer. Question: q{i}?\n"}] for i in range(2)],
            "reward_model": [{"style": "rule", "ground_truth": {"target": [f"a{i}"]}} for i in range(2)],
        }
    ).to_parquet(str(search_r1 / "test.parquet"))
    rows = load_qa("PeterJinGo/nq_hotpotqa_train", split="test")
    assert [(i.benchmark, i.question, i.golden_answers) for i in rows] == [
        ("nq", "q0?", ["a0"]),
        ("hotpotqa", "q1?", ["a1"]),
    ]
    with pytest.raises(QADataError, match="split='train'"):  # the snapshot has no train split: a clear error
        load_qa("PeterJinGo/nq_hotpotqa_train", split="train")


@pytest.mark.slow
def test_cli_default_hub_sources_from_a_local_snapshot(tmp_path: Path) -> None:
    """`dspo-prepare-data` with its default (hub) sources, unchanged, read from a snapshot in the hub's layout."""
    flashrag_hub_snapshot(tmp_path / "mirror")
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DSPO_HUB_MIRROR": str(tmp_path / "mirror")}
    result = subprocess.run(
        [sys.executable, "-m", "dspo.data.prepare", f"output_dir={out}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.stem for p in (out / "test").iterdir()) == sorted(FLASHRAG_SPLITS)
    train = load_qa(str(out / "train.jsonl"))
    assert sorted(i.benchmark for i in train) == ["hotpotqa"] * 3 + ["nq"] * 3
    musique = load_qa(str(out / "test" / "musique.jsonl"))  # no test split: Search-R1's fallback to dev
    assert [i.golden_answers for i in musique] == [["musique-dev-0"], ["musique-dev-1"], ["musique-dev-2"]]
