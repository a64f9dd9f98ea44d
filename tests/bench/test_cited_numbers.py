"""Each number the README's benchmark table and bench/README.md cite is in a results file of the current format under
bench/results/, to the cited rounding. A figure measured by code that no longer runs (vs_trl before the
objective-records refactor: its phases were timed at seams that moved) is an expected failure until re-measured on HEAD
(issue 40)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
REMEASURE = pytest.mark.xfail(strict=True, reason="re-measure on HEAD: issue 40")


def qps(data: dict, corpus: str, backend: str) -> float:
    return next(r["qps"] for r in data["index"] if r["corpus"] == corpus and r["backend"] == backend)


def step(layout: str, key: str, scale: float = 1.0) -> Callable[[dict], float]:
    return lambda d: scale * d["summary"][layout][key]


def current_vs_trl(data: dict) -> bool:
    """Measured by today's bench/_dspo_side.py: the JSON names the seams its phases were timed at."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from _dspo_side import PHASES
    finally:
        sys.path.remove(str(REPO / "bench"))
    return data.get("phase_seams") == PHASES


# (document, the cited text, the number in it, results file, the figure in the cited unit, is the file current?)
Cited = tuple[str, str, str, str, Callable[[dict], float], Callable[[dict], bool] | None]
CITED: list[Cited | pytest.param] = [
    ("README.md", "185x queries/s", "185", "retrieval.json",
     lambda d: qps(d, "shared", "bm25s") / qps(d, "shared", "rank_bm25"), None),
    ("README.md", "0 errors in 21,803 requests", "21803", "retrieval.json", lambda d: d["server"]["requests"], None),
    ("README.md", "0 errors in 21,803", "0", "retrieval.json", lambda d: d["server"]["errors"], None),
    ("README.md", "p50 354 ms", "354", "retrieval.json", lambda d: d["server"]["p50_ms"], None),
    ("README.md", "p99 3.5 s", "3.5", "retrieval.json", lambda d: d["server"]["p99_ms"] / 1000, None),
    ("bench/README.md", "| 9,357 | 0.736 |", "9357", "retrieval.json", lambda d: qps(d, "shared", "bm25s"), None),
    ("bench/README.md", "| 50.5 | 0.736 |", "50.5", "retrieval.json", lambda d: qps(d, "shared", "rank_bm25"), None),
    ("README.md", "2.8x tokens/s on the toy model", "2.8", "rollout.json",
     lambda d: d["vllm_over_hf_tokens_per_s"], None),
    ("bench/README.md", "| HF | 6,141 | 1,694 |", "1694", "rollout.json", lambda d: d["hf"]["tokens_per_s"], None),
    ("bench/README.md", "| vLLM | 6,306 | 4,808", "4808", "rollout.json", lambda d: d["vllm"]["tokens_per_s"], None),
    ("README.md", "10.3x with Qwen2.5's 151k vocabulary", "10.3", "rollout_random_vocab151k.json",
     lambda d: d["vllm_over_hf_tokens_per_s"], None),
    ("README.md", "0.40 (toy)", "0.40", "train_step.json", lambda d: d["efficiency"], None),
    ("README.md", "0.70 (hidden 512)", "0.70", "train_step_h512.json", lambda d: d["efficiency"], None),
    ("README.md", "8.1 % padding", "8.1", "train_step.json", step("bucketed", "padding_share", 100), None),
    ("README.md", "(20 % shuffled)", "20", "train_step.json", step("random", "padding_share", 100), None),
    ("bench/README.md", "| 1.75 s | 8,982 |", "1.75", "train_step.json", step("bucketed", "seconds"), None),
    ("README.md", "1.22x the synchronous round", "1.22", "async.json", lambda d: d["ratio"], None),
    ("bench/README.md", "`sync_step_s` 1.20", "1.20", "async.json", lambda d: d["sync_step_s"], None),
    ("bench/README.md", "`async_step_s` 1.46", "1.46", "async.json", lambda d: d["async_step_s"], None),
    ("bench/README.md", "`bound_step_s` 1.55", "1.55", "async.json", lambda d: d["bound_step_s"], None),
    *(
        pytest.param(*entry, marks=REMEASURE, id=f"vs_trl: {entry[1]}")
        for entry in [
            ("README.md", "0.083x TRL's step time", "0.083", "vs_trl.json", lambda d: d["ratio"], current_vs_trl),
            ("README.md", "2.38 s vs 28.63 s", "2.38", "vs_trl.json", lambda d: d["dspo_step_s"], current_vs_trl),
            ("README.md", "2.38 s vs 28.63 s", "28.63", "vs_trl.json", lambda d: d["trl_step_s"], current_vs_trl),
            ("bench/README.md", "**Filter cost: 1.65x**", "1.65", "vs_trl.json", lambda d: d["filter_cost"],
             current_vs_trl),
            ("bench/README.md", "| 1.050 | 0.891 |", "0.891", "profile_dspo_step.json",
             lambda d: d["phases"]["forward_s"], current_vs_trl),
            ("bench/README.md", "| 1.045 | 0.576 |", "0.576", "profile_dspo_step.json",
             lambda d: d["phases"]["backward_s"], current_vs_trl),
        ]
    ),
]  # fmt: skip


def _id(entry) -> str:
    return entry.id if hasattr(entry, "id") and isinstance(entry.id, str) else f"{entry[3]}: {entry[1]}"


@pytest.mark.parametrize(("doc", "text", "number", "results", "figure", "current"), CITED, ids=map(_id, CITED))
def test_cited_number_is_in_a_current_results_file(doc, text, number, results, figure, current) -> None:
    flat = lambda s: re.sub(r"\s+", " ", s)  # noqa: E731  the docs wrap lines
    assert flat(text) in flat((REPO / doc).read_text()), f"{doc} no longer cites {text!r}: update this test"
    data = json.loads((RESULTS / results).read_text())
    assert current is None or current(data), f"bench/results/{results} was not measured by today's script"
    decimals = len(number.partition(".")[2])
    value = figure(data)
    assert abs(value - float(number)) <= 0.5 * 10**-decimals + 1e-9, f"{doc} cites {number}, {results} has {value}"
