"""Issue 73 (4): `dspo-eval --compare A B [--force]` over generated report pairs (dspo.eval.compare)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspo.eval.compare import ALLOW, JUDGE, REFUSE, WARN, compare_pinned, flatten, main, rule_of

REPO = Path(__file__).resolve().parents[2]
ROWS = {
    "nq": {"subem": 0.5, "em": 0.25, "f1": 0.4, "n": 4, "mean_tool_calls": 1.0, "mean_turns": 2.0},
    "hotpotqa": {"subem": 0.25, "em": 0.0, "f1": 0.3, "n": 4, "mean_tool_calls": 2.0, "mean_turns": 3.0},
}
PINNED = {
    "schema": 1,
    "model": {"digest": "sha256:aaa", "tensors": 3, "bytes": 12},
    "chat_template": "sha256:tpl",
    "agent": {"tag_format": "searchr1", "max_turns": 3, "max_obs_tokens": 256, "overflow": "end"},
    "sampling": {"greedy": True, "temperature": 0.0, "top_p": 1.0, "seed": 0},
    "engine": {"class": "VLLMEngine", "dtype": "float32"},
    "retriever": {"backend": "bm25s", "index_digest": "abc", "k1": 1.2, "b": 0.75},
    "env": {"tools": {"search": {"topk": 1}}},
    "normalization": "flashrag-normalize_answer/1",
    "benchmarks": {
        "nq": {"n": 4, "items_digest": "sha256:nq", "file_sha256": "f1"},
        "hotpotqa": {"n": 4, "items_digest": "sha256:hp", "file_sha256": "f2"},
    },
    "judge": None,
    "dspo": {"version": "0.1.0", "commit": "c1", "dirty": False},
}


def with_average(rows: dict) -> dict:
    average = {key: sum(r[key] for r in rows.values()) / len(rows) for key in ("subem", "em", "f1")}
    return {**rows, "average": {**average, "n": 8, "mean_tool_calls": 1.5, "mean_turns": 2.5}}


def write(folder: Path, rows: dict, pinned: dict | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    document = with_average(rows) if pinned is None else {**with_average(rows), "pinned": pinned}
    (folder / "results.json").write_text(json.dumps(document))
    return folder


def changed(key: str, value) -> dict:
    pinned = copy.deepcopy(PINNED)
    *path, last = key.split(".")
    node = pinned
    for part in path:
        node = node[part]
    node[last] = value
    return pinned


def run(tmp_path: Path, pinned_b: dict | None, *flags: str, rows_b: dict | None = None, pinned_a=PINNED):
    a = write(tmp_path / "a", ROWS, pinned_a)
    b = write(tmp_path / "b", rows_b or ROWS, pinned_b)
    return main(["--compare", str(a), str(b / "results.json"), *flags])


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("model.digest", "sha256:bbb", ALLOW),
        ("dspo.commit", "c2", WARN),
        ("dspo.dirty", True, WARN),
        ("sampling.seed", 7, WARN),
        ("retriever.url", ["http://node1:8000/retrieve"], WARN),
        ("benchmarks.nq.file_sha256", "f9", WARN),
        ("judge", {"model": "judge-7b", "prompt_digest": "sha256:p"}, JUDGE),
        ("agent.max_turns", 4, REFUSE),
        ("agent.overflow", "compact", REFUSE),
        ("chat_template", None, REFUSE),
        ("sampling.top_p", 0.9, REFUSE),
        ("engine.dtype", "bfloat16", REFUSE),
        ("retriever.index_digest", "def", REFUSE),
        ("retriever.k1", 0.9, REFUSE),
        ("env.tools.search.topk", 3, REFUSE),
        ("normalization", "other/2", REFUSE),
        ("benchmarks.nq.items_digest", "sha256:other", REFUSE),
        ("benchmarks.nq.n", 2, REFUSE),
        ("a_setting_added_later", 1, REFUSE),  # unknown keys refuse: safe by default
    ],
)
def test_each_pinned_key_has_its_rule(tmp_path, capsys, key, value, rule) -> None:
    verdict = compare_pinned(PINNED, changed(key, value))
    assert [d.rule for d in verdict.differences] == [rule] * len(verdict.differences) and verdict.differences
    status = run(tmp_path, changed(key, value))
    out, err = capsys.readouterr()
    assert status == (2 if rule == REFUSE else 0)
    if rule == REFUSE:
        assert "refused: these differ and change the numbers" in err and key in err and "--force" in err
        assert run(tmp_path, changed(key, value), "--force") == 0
        forced = capsys.readouterr().out
        row = "| nq ! |" if key.startswith("benchmarks.nq") else "| nq |"  # a benchmark's own difference marks it
        assert f"! {key}" in forced and row in forced
    else:
        assert key.split(".")[0] in out and "| nq |" in out


def test_the_table_holds_both_scores_and_the_difference(tmp_path, capsys) -> None:
    better = {name: dict(row, subem=row["subem"] + 0.125) for name, row in ROWS.items()}
    assert run(tmp_path, changed("model.digest", "sha256:bbb"), rows_b=better) == 0
    out = capsys.readouterr().out
    assert "| benchmark | n A | n B | subEM A | subEM B | Δ | EM A | EM B | Δ | F1 A | F1 B | Δ |" in out
    assert "| nq | 4 | 4 | 50.0 | 62.5 | +12.5 | 25.0 | 25.0 | +0.0 | 40.0 | 40.0 | +0.0 |" in out
    assert "| **average** | 8 | 8 | 37.5 | 50.0 | +12.5 |" in out
    assert "model.digest: 'sha256:aaa' (A) vs 'sha256:bbb' (B) (two models: the comparison's point)" in out


def test_judge_columns_are_shown_when_the_same_judge_scored_both(tmp_path, capsys) -> None:
    judge = {"model": "judge-7b", "prompt_digest": "sha256:p"}
    judged = {name: dict(row, judge=0.5, judge_agreement=0.75, judge_errors=0) for name, row in ROWS.items()}
    a = write(tmp_path / "a", judged, changed("judge", judge))
    b = write(tmp_path / "b", judged, changed("judge", judge))
    assert main(["--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert (
        "judge A | judge B | Δ | judge agrees A | judge agrees B | Δ |" in out
        and "| 50.0 | 50.0 | +0.0 | 75.0 |" in out
    )
    other = write(tmp_path / "c", judged, changed("judge", {**judge, "prompt_digest": "sha256:q"}))
    assert main(["--compare", str(a), str(other)]) == 0
    out = capsys.readouterr().out
    assert "judge A" not in out and "the judges differ: their columns are left out" in out
    assert "judge.prompt_digest: 'sha256:p' (A) vs 'sha256:q' (B)" in out
    assert main(["--compare", str(a), str(other), "--force"]) == 0
    assert "judge A" in capsys.readouterr().out


def test_a_benchmark_of_one_report_is_left_out_with_the_average(tmp_path, capsys) -> None:
    only_nq = copy.deepcopy(PINNED)
    del only_nq["benchmarks"]["hotpotqa"]
    a = write(tmp_path / "a", ROWS, PINNED)
    b = tmp_path / "b"
    b.mkdir()
    (b / "results.json").write_text(json.dumps({"nq": ROWS["nq"], "pinned": only_nq}))
    assert main(["--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "note: only in A: hotpotqa (left out, and the average with them)" in out
    assert "| nq |" in out and "hotpotqa |" not in out and "average" not in out.split("note:")[0]


def test_old_reports_are_compared_only_with_force(tmp_path, capsys) -> None:
    assert run(tmp_path, None) == 2
    err = capsys.readouterr().err
    assert "pinned (B: " in err and "written before dspo pinned its reports" in err
    assert run(tmp_path, None, "--force", pinned_a=None) == 0
    out = capsys.readouterr().out
    assert "! pinned (A: " in out and "! pinned (B: " in out and "| nq | 4 | 4 | 50.0 | 50.0 | +0.0 |" in out


def test_unreadable_reports_and_run_folders(tmp_path, capsys) -> None:
    assert main(["--compare", str(tmp_path / "nothing"), str(tmp_path)]) == 2
    assert "no results.json there" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    write(run_dir / "test", ROWS, PINNED)  # a training run folder: its test/results.json
    assert main(["--compare", str(run_dir), str(run_dir / "test")]) == 0
    (tmp_path / "broken.json").write_text("[1]")
    assert main(["--compare", str(tmp_path / "broken.json"), str(run_dir)]) == 2
    assert "not a dspo results.json" in capsys.readouterr().err


def test_rules_match_by_prefix_and_flatten_keeps_lists() -> None:
    assert rule_of("model") == rule_of("model.digest") and rule_of("model.digest")[0] == ALLOW
    assert rule_of("modelx")[0] == REFUSE and rule_of("benchmarks.any.file_sha256")[0] == WARN
    assert rule_of("benchmarks.any.items_digest")[0] == REFUSE
    assert flatten({"a": {"b": [1, 2], "c": {}}, "d": None}) == {"a.b": [1, 2], "a.c": {}, "d": None}


def test_the_documented_command_line(tmp_path) -> None:
    """`dspo-eval --compare A B` as docs/evaluation.md writes it, in a process: Hydra never sees the arguments."""
    a = write(tmp_path / "a", ROWS, PINNED)
    b = write(tmp_path / "b", ROWS, changed("agent.max_turns", 4))
    command = [sys.executable, "-m", "dspo.eval.cli", "--compare", str(a), str(b)]
    refused = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert refused.returncode == 2 and "agent.max_turns: 3 (A) vs 4 (B)" in refused.stderr
    forced = subprocess.run([*command, "--force"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert forced.returncode == 0 and "! agent.max_turns: 3 (A) vs 4 (B)" in forced.stdout
