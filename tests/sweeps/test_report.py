"""dspo.sweeps.report on fake runs written with SummaryWriter: confidence intervals, collapse, token axis, clip activity
against hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dspo.sweeps import report as ablation
from dspo.sweeps.analysis import find_runs

CONFIG = "algorithm:\n  name: {algorithm}\nseed: {seed}\nrun_name: {algorithm}_seed{seed}\n"


def write_run(run_dir: Path, algorithm: str, seed: int, val: dict[int, float], reward: list[float]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(CONFIG.format(algorithm=algorithm, seed=seed))
    writer = SummaryWriter(log_dir=str(run_dir / "tb"))
    for step, value in val.items():  # validation after `step` updates, logged at x = step
        writer.add_scalar("val/subem_mean", value, step)
        writer.add_scalar("val/toy_2hop/subem", value / 2, step)
    for round_index, value in enumerate(reward):  # rounds of 2 updates start at x = 0, 2, 4, ...
        writer.add_scalar("rollout/sampled_reward_mean", value, 2 * round_index)
        writer.add_scalar("rollout/generated_tokens_total", 100.0 * (round_index + 1), 2 * round_index)
    for step in range(2 * len(reward)):  # train metrics of update k at x = k - 1; odd x = second mini-batch
        off_policy = step % 2 == 1
        writer.add_scalar("loss/clipfrac", 0.4 if off_policy else 0.0, step)
        writer.add_scalar("loss/ratio_min", 0.99 if off_policy else 1.0, step)
        writer.add_scalar("loss/ratio_max", 1.02 if off_policy else 1.0, step)
    writer.add_scalar("test/subem_mean", val[max(val)], max(val))
    writer.close()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    write_run(root / "0_dspo_seed0", "dspo", 0, {0: 0.2, 2: 0.3, 4: 0.5}, [0.3, 0.4])
    write_run(root / "1_dspo_seed1", "dspo", 1, {0: 0.2, 2: 0.4, 4: 0.6}, [0.3, 0.5])
    write_run(root / "2_grpo_seed0", "grpo", 0, {0: 0.2, 2: 0.1, 4: 0.1}, [0.3, 0.1])  # collapses
    actions = ["warn", "rollback", "rollback"]  # the guard's log (dspo.guard): a warning is not a rollback
    (root / "2_grpo_seed0" / "guard.jsonl").write_text("".join(f'{{"action": "{a}"}}\n' for a in actions))
    return root


def test_ci95_hand_values() -> None:
    mean, half = ablation.ci95([0.5, 0.6])
    assert mean == pytest.approx(0.55) and half == pytest.approx(12.706 * math.sqrt(0.005) / math.sqrt(2))
    mean, half = ablation.ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert math.isnan(ablation.ci95([0.4])[1]) and math.isnan(ablation.ci95([])[0])


def test_collapse_definition() -> None:
    import pandas as pd

    assert ablation.collapsed(pd.Series([0.3, 0.2], index=[0, 10]), pd.Series([0.3] * 5))  # ended 0.1 below its start
    assert not ablation.collapsed(pd.Series([0.3, 0.27], index=[0, 10]), pd.Series([0.3] * 5))  # within 0.05
    assert ablation.collapsed(pd.Series([0.3, 0.3], index=[0, 10]), pd.Series([0.4, 0.3, 0.3, 0.3, 0.1]))  # halved
    assert not ablation.collapsed(pd.Series([0.3], index=[0]), pd.Series([0.4, 0.3, 0.3, 0.3, 0.3]))


def test_records_and_summary(sweep) -> None:
    records = [ablation.run_record(r) for r in find_runs(sweep)]
    by_run = {(r["algorithm"], r["seed"]): r for r in records}
    assert by_run[("dspo", 0)]["val_start"] == pytest.approx(0.2) and by_run[("dspo", 0)]["val_final"] == 0.5
    assert by_run[("dspo", 1)]["val/toy_2hop/subem@final"] == pytest.approx(0.3)
    assert by_run[("dspo", 0)]["generated_tokens"] == 200.0
    assert [r["collapsed"] for r in records] == [False, False, True]
    table = ablation.summary(records)
    assert table.loc["dspo", "n"] == 2 and table.loc["dspo", "val_final"] == pytest.approx(0.55)
    assert table.loc["dspo", "val_gain"] == pytest.approx(0.35)
    assert table.loc["dspo", "val_final±"] == pytest.approx(12.706 * math.sqrt(0.005) / math.sqrt(2))
    assert table.loc["grpo", "collapsed"] == 1 and table.loc["dspo", "collapsed"] == 0
    assert [r["rollbacks"] for r in records] == [0, 0, 2]
    assert table.loc["grpo", "rollbacks"] == 2 and table.loc["dspo", "rollbacks"] == 0
    assert list(ablation.format_summary(table)["rollbacks"]) == [0, 2]


def test_curves_against_generated_tokens(sweep) -> None:
    frame = ablation.curves_vs_tokens(find_runs(sweep), points=3)
    dspo = frame[frame.algorithm == "dspo"]
    # val at x=0 used 0 tokens, at x=2 the first round (100), at x=4 two rounds (200): grid 0, 100, 200
    assert dspo.tokens.tolist() == [0.0, 100.0, 200.0]
    assert dspo["mean"].tolist() == pytest.approx([0.2, 0.35, 0.55])
    assert ablation.curves_vs_tokens(find_runs(sweep), tag="not/logged").empty


def test_clip_activity_per_position_in_the_round(sweep) -> None:
    run = next(r for r in find_runs(sweep) if r.algorithm == "dspo")
    table = ablation.clip_activity(run, minibatches=2)
    assert table.loc[0, "clipfrac"] == 0.0 and table.loc[0, "ratio_max"] == 1.0  # first mini-batch: on-policy
    assert table.loc[1, "clipfrac"] == pytest.approx(0.4) and table.loc[1, "ratio_min"] == pytest.approx(0.99)
    assert table.loc[1, "steps"] == 2


def test_report_and_cli(sweep, tmp_path, capsys) -> None:
    out = tmp_path / "ablation.json"
    ablation.main([str(sweep), "--json", str(out), "--figure", str(tmp_path / "a.png")])
    assert "dspo" in capsys.readouterr().out
    import json

    result = json.loads(out.read_text())
    assert set(result) == {"runs", "summary", "clip_activity"} and result["summary"]["grpo"]["collapsed"] == 1
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def short_sweep(tmp_path_factory) -> Path:
    """A sweep shorter than the validation interval: each run validated at step 0 only, then 2 rounds (4 updates)."""
    root = tmp_path_factory.mktemp("short_sweep")
    write_run(root / "0_dspo_seed0", "dspo", 0, {0: 0.2}, [0.3, 0.4])
    write_run(root / "1_dspo_seed1", "dspo", 1, {0: 0.2}, [0.3, 0.5])
    write_run(root / "2_grpo_seed0", "grpo", 0, {0: 0.2}, [0.3, 0.1])
    return root


def test_sweep_shorter_than_the_validation_interval(short_sweep, tmp_path, capsys) -> None:
    """Step 0 is the only validation: no final value and no gain (not a gain of 0), said on the console and in the
    figure's panels; n is an integer and the console has the intervals, tokens and clip activity of the JSON."""
    records = [ablation.run_record(r) for r in find_runs(short_sweep)]
    assert all(math.isnan(r["val_final"]) and r["val_start"] == pytest.approx(0.2) for r in records)
    assert all(r["last_step"] == 3 and r["val_final_step"] is None for r in records)
    table = ablation.summary(records)
    assert math.isnan(table.loc["dspo", "val_gain"]) and table.loc["dspo", "no_final_val"] == 2
    ablation.main([str(short_sweep), "--json", str(tmp_path / "a.json")])
    out = capsys.readouterr().out
    assert "dspo: no final validation yet in 2 of 2 runs" in out and "runs end at step 3" in out
    dspo_row = next(line for line in out.splitlines() if line.startswith("dspo "))
    assert dspo_row.split()[1] == "2"  # n, not 2.0
    assert "0.375 ± 0.318" in dspo_row  # sampled reward: run means 0.35, 0.40; ± 12.706 * 0.0354 / sqrt(2)
    assert "200 ± 0" in dspo_row and "2 / 2" not in dspo_row and "0 / 2" in dspo_row  # tokens, collapsed
    assert "clip activity" in out and "0.4000" in out  # the second mini-batch's clipfrac
    fig = ablation.plot_ablation(find_runs(short_sweep))
    notes = [" ".join(t.get_text() for t in ax.texts) for ax in fig.axes]
    assert sum("step-0 validation only" in note for note in notes) == 3 and notes[3] == ""


def test_console_table_carries_intervals_tokens_and_clip(sweep, capsys) -> None:
    ablation.main([str(sweep)])
    out = capsys.readouterr().out
    dspo_row = next(line for line in out.splitlines() if line.startswith("dspo "))
    half = 12.706 * math.sqrt(0.005) / math.sqrt(2)
    assert dspo_row.split()[1] == "2" and f"0.550 ± {half:.3f}" in dspo_row and f"+0.350 ± {half:.3f}" in dspo_row
    assert "tokens sampled" in out and "no final validation" not in out
    assert "ratio min .. max (mean)" in out and "0.9900 .. 1.0200" in out


def test_a_failed_or_killed_job_is_named_and_the_others_reported(tmp_path, sweep, capsys) -> None:
    """Issue 58: a sweep where one job failed and one was killed mid-run still reports the finished ones, and names
    the two with their state, step and last error line; a sweep without status files reports as before."""
    import json
    import shutil

    from dspo.sweeps.status import write_status

    assert "incomplete_jobs" not in ablation.report(sweep)  # no status.json: every run counts, the report unchanged
    root = tmp_path / "sweep"
    shutil.copytree(sweep, root)
    for name in ("0_dspo_seed0", "1_dspo_seed1"):
        write_status(root / name, "finished", step=4, max_steps=4)
    write_status(root / "2_grpo_seed0", "failed", step=2, error="ConnectionError: retriever unreachable")
    write_run(root / "3_gspo_seed0", "gspo", 0, {0: 0.2}, [0.3])
    write_status(root / "3_gspo_seed0", "running", step=1, max_steps=4)
    cancelled = "slurmstepd: error: *** JOB 42 CANCELLED AT 12:00 ***"
    (root / "3_gspo_seed0" / "train.log").write_text(f"step 1\n{cancelled}\n")
    result = ablation.report(root)
    assert sorted(result["summary"]) == ["dspo"] and len(result["runs"]) == 2
    assert result["incomplete_jobs"] == [
        {"job": "2_grpo_seed0", "state": "failed", "step": 2, "error": "ConnectionError: retriever unreachable"},
        {"job": "3_gspo_seed0", "state": "stopped", "step": 1, "error": cancelled},
    ]  # fmt: skip
    ablation.main([str(root), "--json", str(tmp_path / "report.json"), "--figure", str(tmp_path / "f.png")])
    out = capsys.readouterr().out
    assert "left out: 2_grpo_seed0 failed at step 2: ConnectionError: retriever unreachable" in out
    assert "left out: 3_gspo_seed0 stopped at step 1: slurmstepd: error: *** JOB 42 CANCELLED" in out
    assert json.loads((tmp_path / "report.json").read_text())["incomplete_jobs"][0]["job"] == "2_grpo_seed0"
    for name in ("0_dspo_seed0", "1_dspo_seed1"):
        write_status(root / name, "failed", error="ValueError: x")
    with pytest.raises(FileNotFoundError, match="no job of .* finished"):
        ablation.report(root)


def write_cost_run(run_dir: Path, cost: float, seed: int, test: float, searches: list[float]) -> None:
    """A run of a sweep over env.reward.cost.search (env=planner): its config, validation, test and per-round costs."""
    from torch.utils.tensorboard import SummaryWriter

    (run_dir / ".hydra").mkdir(parents=True)
    config = CONFIG.format(algorithm="dspo", seed=seed) + f"env:\n  reward:\n    cost:\n      search: {cost}\n"
    (run_dir / ".hydra" / "config.yaml").write_text(config)
    writer = SummaryWriter(log_dir=str(run_dir / "tb"))
    for step, value in ((0, 0.4), (2 * len(searches), test)):
        writer.add_scalar("val/subem_mean", value, step)
    for round_index, value in enumerate(searches):
        writer.add_scalar("reward/searches", value, 2 * round_index)
        writer.add_scalar("reward/answerer_calls", 1.0, 2 * round_index)
        writer.add_scalar("rollout/sampled_reward_mean", 0.5, 2 * round_index)
    writer.add_scalar("test/subem_mean", test, 2 * len(searches))
    writer.close()


def test_a_sweep_over_a_weight_is_grouped_by_its_key_and_drawn_as_a_utility_cost_front(tmp_path, capsys) -> None:
    """`--by env.reward.cost.search`: one group per value (all runs are dspo), utility = test subEM, cost = searches
    + answerer calls per episode over the last fifth of the rounds; a row another beats on both is off the front."""
    import json

    late = [3.0, 3.0, 3.0, 3.0, 2.0]  # five rounds: the last fifth is the last round
    write_cost_run(tmp_path / "0_dspo_seed0", 0.0, 0, 0.8, late)
    write_cost_run(tmp_path / "1_dspo_seed1", 0.0, 1, 0.9, late)
    write_cost_run(tmp_path / "2_dspo_seed0", 0.5, 0, 0.6, [1.0] * 5)
    write_cost_run(tmp_path / "3_dspo_seed1", 0.5, 1, 0.6, [1.0] * 5)
    write_cost_run(tmp_path / "4_dspo_seed0", 1.0, 0, 0.5, [1.5] * 5)  # lower utility at more searches than 0.5
    out = tmp_path / "front.json"
    ablation.main([str(tmp_path), "--by", "env.reward.cost.search", "--json", str(out)])
    front = {row["group"]: row for row in json.loads(out.read_text())["front"]}
    assert list(front) == [f"env.reward.cost.search={c}" for c in (0.0, 0.5, 1.0)]  # the swept value's order
    zero = front["env.reward.cost.search=0.0"]
    half = 12.706 * math.sqrt(0.005) / math.sqrt(2)
    assert zero["n"] == 2 and zero["utility"] == pytest.approx(0.85) and zero["utility±"] == pytest.approx(half)
    assert zero["searches"] == 2.0 and zero["calls"] == 3.0 and zero["answerer_calls"] == 1.0
    assert [row["on_front"] for row in front.values()] == [True, True, False]
    assert zero["calls±"] == 0.0  # both seeds made 3 calls an episode late in training
    printed = capsys.readouterr().out
    assert "utility-cost front" in printed and "env.reward.cost.search=0.5" in printed
    assert "dspo" not in json.loads(out.read_text())["summary"]  # grouped by the key, not the algorithm


def test_the_front_figure_joins_the_rows_on_the_front_in_order_of_cost(tmp_path) -> None:
    """`--front-figure`: one point per swept value at (calls, utility), the dashed front through the undominated
    ones sorted by calls, and each value's searches per episode over training beside it."""
    write_cost_run(tmp_path / "0_dspo_seed0", 0.0, 0, 0.8, [3.0] * 5)
    write_cost_run(tmp_path / "1_dspo_seed0", 0.5, 0, 0.6, [1.0] * 5)
    write_cost_run(tmp_path / "2_dspo_seed0", 1.0, 0, 0.5, [1.5] * 5)  # dominated by 0.5
    figure = tmp_path / "front.png"
    ablation.main([str(tmp_path), "--by", "env.reward.cost.search", "--front-figure", str(figure)])
    assert figure.stat().st_size > 10_000
    runs, _ = ablation.complete_runs(tmp_path, "env.reward.cost.search")
    from dspo.sweeps.pareto_front import front, plot_front

    rows = front(runs, [ablation.run_record(run) for run in runs])
    front_ax, searches_ax = plot_front(rows, runs).axes
    (line,) = [line for line in front_ax.get_lines() if line.get_label() == "front"]
    assert list(line.get_xdata()) == [2.0, 4.0] and list(line.get_ydata()) == pytest.approx([0.6, 0.8])
    labels = [text.get_text() for text in front_ax.get_legend().get_texts()]
    assert "cost.search=1.0 (n=1)" in labels
    curves = {line.get_label(): line.get_ydata() for line in searches_ax.get_lines()}
    assert list(curves["cost.search=0.5"]) == pytest.approx([1.0] * 5)


def test_a_front_figure_without_a_swept_key_is_refused(tmp_path, sweep) -> None:
    with pytest.raises(SystemExit):
        ablation.main([str(sweep), "--front-figure", str(tmp_path / "f.png")])
    assert not (tmp_path / "f.png").exists()
