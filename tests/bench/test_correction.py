"""bench/correction.py on a hand-made JSON: the grid, the per-(mode, k) aggregation (Student-t interval over seeds,
step-means of the weight statistics averaged over seeds), the table, and the problems that make it exit non-zero (the
sweep itself takes hours and is not run here)."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def correction(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    sys.modules.pop("correction", None)
    return importlib.import_module("correction")


def _run(mode: str, k: int, seed: int, val: float, ess: float, returncode: int = 0) -> dict:
    figures = {
        "val_final": val,
        "mismatch/weight_mean": 1.0 - 0.1 * k,
        "mismatch/weight_min": 0.5,
        "mismatch/ess": ess,
        "rollout/staleness_mean": 0.5 * k,
    }
    return {"mode": mode, "k": k, "seed": seed, "returncode": returncode, **(figures if returncode == 0 else {})}


def test_grid_has_k0_with_the_default_mode_only(correction) -> None:
    assert correction.grid([0, 1, 2]) == [
        ("seq_tis", 0),
        ("seq_tis", 1),
        ("seq_prod_tis", 1),
        ("none", 1),
        ("seq_tis", 2),
        ("seq_prod_tis", 2),
        ("none", 2),
    ]
    assert correction.overrides("none", 2, 7, 100) == [
        "rollout.max_staleness=2",
        "algorithm.rollout_correction.mode=none",
        "seed=7",
        "trainer.max_steps=100",
        "run_test=false",
    ]


def test_summary_table_and_report_from_a_json(correction, tmp_path, capsys) -> None:
    """seq_tis k=0: val 0.2, 0.3, 0.4 -> mean 0.3, half-width t(0.975, 2) · 0.1 / √3 = 4.303 · 0.0577350 = 0.2484;
    seq_prod_tis k=1: one seed failed, the two others give val 0.5, 0.7 (mean 0.6, half 12.706 · 0.1414214 / √2 =
    1.2706) and ess 0.8, 0.6 (mean 0.7)."""
    runs = [_run("seq_tis", 0, s, v, 1.0) for s, v in enumerate((0.2, 0.3, 0.4))]
    runs += [_run("seq_prod_tis", 1, 0, 0.5, 0.8), _run("seq_prod_tis", 1, 1, 0.7, 0.6)]
    runs += [_run("seq_prod_tis", 1, 2, math.nan, 0.0, returncode=1)]
    rows = correction.summarize(runs)
    assert [(r["mode"], r["k"], r["n"], r["failed"]) for r in rows] == [("seq_tis", 0, 3, 0), ("seq_prod_tis", 1, 2, 1)]
    assert (rows[0]["val_final"], rows[0]["val_final±"]) == pytest.approx((0.3, 4.303 * 0.1 / math.sqrt(3)))
    assert (rows[1]["val_final"], rows[1]["val_final±"]) == pytest.approx((0.6, 12.706 * 0.1))
    assert rows[1]["mismatch/ess"] == pytest.approx(0.7) and rows[1]["rollout/staleness_mean"] == 0.5
    assert rows[1]["mismatch/weight_mean"] == pytest.approx(0.9)
    table = correction.table(rows)
    assert "| seq_tis | 0 | 3 | 0.300 ± 0.248 | 1.000 | 0.500 | 1.000 | 0.000 |" in table
    assert "| seq_prod_tis | 1 | 2 (1 failed) | 0.600 ± 1.271 | 0.900 | 0.500 | 0.700 | 0.500 |" in table
    path = tmp_path / "correction.json"
    path.write_text(json.dumps({"runs": runs, "summary": rows}))
    assert correction.main(["--report", str(path)]) == 1  # the failed run
    out = capsys.readouterr().out
    assert table in out and "problem: seq_prod_tis k=1 seed=2: exit 1" in out
    good = {"runs": runs[:3], "summary": correction.summarize(runs[:3])}
    path.write_text(json.dumps(good))
    assert correction.main(["--report", str(path)]) == 0


def test_nan_or_missing_figures_are_problems(correction) -> None:
    """One seed, so the half-width is NaN (fine); a run without a validation after step 0 (val_final NaN) or a stat
    never logged is a problem."""
    rows = correction.summarize([_run("none", 1, 0, math.nan, 1.0)])
    assert correction.problems({"runs": [], "summary": rows}) == ["none k=1: val_final is NaN or missing"]
    del rows[0]["mismatch/ess"]
    assert "none k=1: mismatch/ess is NaN or missing" in correction.problems({"runs": [], "summary": rows})
    assert "0.500 | 0.500 |" in correction.table(correction.summarize([_run("none", 1, 0, 0.5, 0.5)]))
