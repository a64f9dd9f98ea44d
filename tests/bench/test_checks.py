"""bench/_checks.py: a benchmark exits non-zero naming what it did not measure and quoting the failed side's error;
bench/vs_trl.py's check on hand-made results (a dspo side that crashed, a TRL side that was skipped)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_measured_figures_pass_and_missing_ones_are_named(bench) -> None:
    checks = bench("_checks")
    checks.require_measured("x", {"a": 1.0, "b": {"c": 0, "d": [1]}, "ok": True})
    with pytest.raises(SystemExit) as failed:
        checks.require_measured("x", {"a": math.nan, "b": {"c": None, "d": []}, "e": math.inf, "f": 2.0})
    message = str(failed.value.code)
    assert "bench/x.py FAILED" in message
    assert all(f"{name} = " in message for name in ("a", "b.c", "b.d", "e")) and "f = " not in message


def test_a_sides_error_fails_the_run_with_its_tail(bench) -> None:
    checks = bench("_checks")
    tail = "Traceback ...\nAttributeError: module 'dspo.training.module' has no attribute 'policy_loss'"
    with pytest.raises(SystemExit, match="dspo side failed:(.|\n)*no attribute 'policy_loss'"):
        checks.require_measured("x", {"a": 1.0}, {"dspo side": tail, "other side": None})


def test_vs_trl_fails_when_the_dspo_side_measured_nothing(bench) -> None:
    vs_trl = bench("vs_trl")
    crashed = {"error": "exit 1", "log_tail": "AttributeError: no attribute 'policy_loss'", "steps": []}
    runs = {"dspo_nofilter": [{**crashed, "variant": "dspo_nofilter", "repeat": 0, "wall_s": 1.0}]}
    summary = {"dspo_nofilter": vs_trl.summarize([], 1, 2)}
    report = vs_trl.build_report(summary, runs)
    with pytest.raises(SystemExit) as failed:
        vs_trl.check(report, summary, runs)
    message = str(failed.value.code)
    assert "dspo_nofilter.measured_steps = None" in message and "dspo_step_s = nan" in message
    assert "no attribute 'policy_loss'" in message and "trl_step_s" not in message  # TRL skipped: not required


def test_profile_rows_by_shape_tell_calls_of_one_operator_apart(bench) -> None:
    """`--profile`'s operator table by input shapes: two sizes of one matmul are two rows, each with its shapes."""
    import torch

    side = bench("_dspo_side")
    small, large = torch.ones(8, 8), torch.ones(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        for _ in range(3):
            torch.mm(small, small)
        torch.mm(large, large)
    plain = [row for row in side.top_ops(profiler, 50) if row["op"] == "aten::mm"]
    shaped = [row for row in side.top_ops(profiler, 50, by_shape=True) if row["op"] == "aten::mm"]
    assert len(plain) == 1 and plain[0]["calls"] == 4 and "shapes" not in plain[0]
    assert sorted(row["calls"] for row in shaped) == [1, 3]
    assert {row["shapes"] for row in shaped} == {"[[8, 8], [8, 8]]", "[[64, 64], [64, 64]]"}
