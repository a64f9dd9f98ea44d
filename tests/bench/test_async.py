"""bench/async.py and bench/timeline.py arithmetic on hand-made runs: step and round times from event wall times,
one value per round, idle time at k = 0 and k >= 1, the busy share of a timeline (the benchmarks themselves take
minutes and are not run here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _write_run(directory: Path, rounds: int, steps_per_round: int, step_s: float, values: dict[str, list[float]]):
    """Events at step s with wall time 100 + (s + 1) * step_s (a step is logged as it ends); a round's statistics at
    each of its steps, as Lightning logs them."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(directory / "tb"))
    for step in range(rounds * steps_per_round):
        wall = 100.0 + (step + 1) * step_s
        writer.add_scalar("train/loss", 0.0, step, walltime=wall)
        for tag, per_round in values.items():
            writer.add_scalar(tag, per_round[step // steps_per_round], step, walltime=wall)
    writer.close()


def test_synchronous_run_times_and_idle_shares(bench, tmp_path: Path) -> None:
    module = bench("async")
    generation = [9.0, 1.0, 2.0, 3.0, 4.0]  # round 0 is warm-up: its slow generation must not count
    tokens = [50.0, 100.0, 200.0, 300.0, 400.0]
    _write_run(tmp_path, 5, 2, 1.5, {"rollout/time_s": generation, "rollout/generated_tokens": tokens})
    result = module.summarize(tmp_path, steps_per_round=2, warmup_rounds=1, k=0)
    assert result["step_s"] == pytest.approx(1.5) and result["round_s"] == pytest.approx(3.0)
    assert result["timed_steps"] == 8  # steps 2..9, after the last warm-up step (1)
    assert result["generation_s"] == pytest.approx(2.5)  # median of rounds 1-4
    assert result["tokens_per_s"] == pytest.approx(250.0 / 3.0)
    assert result["trainer_idle_s_per_round"] == pytest.approx(2.5)  # k = 0: the trainer waits out the generation
    assert result["engine_idle_s_per_round"] == pytest.approx(0.5)
    assert result["staleness_mean"] == 0.0


def test_run_ahead_idle_times_come_from_the_logged_waits(bench, tmp_path: Path) -> None:
    module = bench("async")
    values = {
        "rollout/time_s": [1.0] * 4,
        "rollout/generated_tokens": [10.0] * 4,
        "rollout/trainer_wait_s": [5.0, 0.2, 0.0, 0.1],
        "rollout/producer_idle_s": [0.0, 0.5, 0.7, 0.9],
        "rollout/staleness_mean": [0.0, 1.0, 1.0, 1.0],
    }
    _write_run(tmp_path, 4, 1, 2.0, values)
    result = module.summarize(tmp_path, steps_per_round=1, warmup_rounds=1, k=1)
    assert result["round_s"] == pytest.approx(2.0)
    assert result["trainer_idle_s_per_round"] == pytest.approx(0.1)
    assert result["engine_idle_s_per_round"] == pytest.approx(0.7)
    assert result["staleness_mean"] == pytest.approx(1.0)


def test_report_compares_one_round_ahead_with_sync_and_the_bound(bench) -> None:
    module = bench("async")
    results = {"workloads": {"toy": {"k0": {"step_s": 2.0}, "k1": {"step_s": 1.8}, "alone": {"bound_step_s": 1.5}}}}
    module.report(results)
    assert results["ratio"] == pytest.approx(0.9) and results["vs_bound"] == pytest.approx(1.2)
    assert (results["sync_step_s"], results["async_step_s"], results["bound_step_s"]) == (2.0, 1.8, 1.5)


def test_timeline_busy_share_counts_only_the_window(bench, tmp_path: Path) -> None:
    module = bench("timeline")
    assert module.busy([(0.0, 1.0), (2.0, 4.0)], 0.0, 4.0) == pytest.approx(0.75)
    assert module.busy([(-1.0, 1.0)], 0.0, 2.0) == pytest.approx(0.5)
    rounds = [{"round": 0, "waiting": 0.0, "generation": [0.0, 1.0], "taken": 1.0, "trained": 3.0}]
    (tmp_path / "timeline.jsonl").write_text(json.dumps(rounds[0]) + "\n")
    assert module.load(tmp_path) == rounds
    with pytest.raises(SystemExit, match="timeline.jsonl not found"):
        module.load(tmp_path / "missing")
