"""The ablation report: algorithms compared over seeds, with confidence intervals, compute-matched curves, collapses
and what the sequence clip did. Reads runs with `dspo.sweeps.analysis`.

    dspo-report outputs/multirun/<timestamp> [--json outputs/ablation.json] [--figure outputs/ablation.png]
    dspo-report outputs/multirun/<timestamp> --by env.reward.cost.search [--front-figure front.png]

`--by KEY` groups the runs by that config key's value instead of their algorithm, and adds the utility-cost table
of `dspo.sweeps.pareto_front` (env=planner's front: the answerer's accuracy against searches and answerer calls per
episode); `--front-figure` draws it.

It writes nothing unless `--json` / `--figure` are given (the README's report is `--json bench/results/ablation.json`).

Definitions (stated in the README next to the numbers):
- final value: a run's last logged `val/...` after step 0 (the step-`max_steps` validation) or its `test/...` value; a
  run shorter than `trainer.val_check_interval` has only its step-0 validation, so no final value and no gain (NaN,
  reported as "no final validation yet"), never a gain of 0;
- 95 % confidence interval: mean ± t(0.975, n-1) · s / sqrt(n) over seeds (Student t, s with ddof=1);
- collapsed run: its final `val/subem_mean` is more than `COLLAPSE_DROP` below its own step-0 value (training made the
  warm start worse), or its sampled reward over the last fifth of the rounds is under half that of the first fifth;
- compute-matched curves: validation scores against `rollout/generated_tokens_total`, every token sampled so far
  (groups the filter dropped included), linearly interpolated onto a common token grid per algorithm;
- rollbacks: the collapse guard's rollbacks in a run (`guard.jsonl`, dspo.guard), summed per algorithm;
- clip activity: `loss/clipfrac` and the spread `loss/ratio_min`..`loss/ratio_max` per position of the optimizer step
  in its round (0 = first mini-batch, on-policy, ratio exactly 1; later ones are off-policy).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from dspo.sweeps.analysis import RunInfo, available_tags, ci95, find_runs, last_step, run_series

COLLAPSE_DROP = 0.05
TOKEN_CURVE_COLUMNS = ["algorithm", "tokens", "mean", "std", "n"]


def run_record(run: RunInfo) -> dict[str, float | str | int | bool | None]:
    """One run's numbers: step-0 and final validation, test, sampled reward, tokens, collapse, last logged step."""
    val = run_series(run, "val/subem_mean")
    reward = run_series(run, "rollout/sampled_reward_mean")
    tokens = run_series(run, "rollout/generated_tokens_total")
    record: dict[str, float | str | int | bool | None] = {"algorithm": run.algorithm, "seed": run.seed}
    record["val_start"] = float(val.loc[0]) if 0 in val.index else math.nan
    record["val_final"] = _final(val)
    record["val_final_step"] = int(val.index[-1]) if len(val) and val.index[-1] > 0 else None
    record["last_step"] = last_step(run)
    for tag in available_tags([run]):
        if tag.startswith(("val/", "test/")) and tag.endswith("subem") or tag == "test/subem_mean":
            series = run_series(run, tag)
            record[f"{tag}@final"] = _final(series) if tag.startswith("val/") else float(series.iloc[-1])
            if tag.startswith("val/") and 0 in series.index:
                record[f"{tag}@0"] = float(series.loc[0])
    record["sampled_reward_mean"] = float(reward.mean()) if len(reward) else math.nan
    record["generated_tokens"] = float(tokens.iloc[-1]) if len(tokens) else math.nan
    record["collapsed"] = collapsed(val, reward)
    record["rollbacks"] = rollbacks(run.dir)
    return record


def rollbacks(run_dir: Path) -> int:
    """The guard's rollbacks in a run: its `guard.jsonl` lines whose action is `rollback` (0 without the file)."""
    path = Path(run_dir) / "guard.jsonl"
    if not path.is_file():
        return 0
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(event.get("action") == "rollback" for event in events)


def _final(val: pd.Series) -> float:
    """The last validation after step 0; NaN when step 0 is the only one (the step-0 value is the start, not an end)."""
    after_start = val[val.index > 0]
    return float(after_start.iloc[-1]) if len(after_start) else math.nan


def collapsed(val: pd.Series, reward: pd.Series) -> bool:
    """See the module docstring: ended below its own start, or the sampled reward halved."""
    if 0 in val.index and len(val) > 1 and val.iloc[-1] < val.loc[0] - COLLAPSE_DROP:
        return True
    fifth = len(reward) // 5
    if fifth >= 1:
        first, last = reward.iloc[:fifth].mean(), reward.iloc[-fifth:].mean()
        return bool(first > 0 and last < 0.5 * first)
    return False


def summary(records: Sequence[dict]) -> pd.DataFrame:
    """One row per algorithm: n, and mean / 95 % half-width of each final metric, gains, collapses."""
    frame = pd.DataFrame.from_records(records)
    metrics = [c for c in frame.columns if c.endswith("@final") or c.endswith("@0")]
    metrics += ["val_start", "val_final", "sampled_reward_mean", "generated_tokens"]
    frame["val_gain"] = frame["val_final"] - frame["val_start"]
    rows = []
    for algorithm, group in frame.groupby("algorithm", sort=True):
        row: dict[str, float | int | str] = {"algorithm": algorithm, "n": len(group)}
        for metric in [*metrics, "val_gain"]:
            mean, half = ci95(group[metric].tolist())
            row[metric], row[f"{metric}±"] = mean, half
        row["collapsed"] = int(group["collapsed"].sum())
        row["rollbacks"] = int(group["rollbacks"].sum()) if "rollbacks" in group else 0
        row["no_final_val"] = int(group["val_final"].isna().sum())
        rows.append(row)
    return pd.DataFrame(rows).set_index("algorithm")


def curves_vs_tokens(runs: Sequence[RunInfo], tag: str = "val/subem_mean", points: int = 20) -> pd.DataFrame:
    """Per algorithm: mean and std of `tag` against generated tokens, each run interpolated onto a shared grid (up to
    the smallest final token count among the algorithm's runs, so every point averages all runs)."""
    frames = []
    for algorithm in sorted({r.algorithm for r in runs}):
        pairs = []
        for run in (r for r in runs if r.algorithm == algorithm):
            values, tokens = run_series(run, tag), run_series(run, "rollout/generated_tokens_total")
            if values.empty or tokens.empty:
                continue
            # tokens sampled before the validation after `step` updates: rounds start at x = updates so far, so the
            # rounds that fed those updates are the ones logged at x < step
            x = np.array([_last_before(tokens, step) for step in values.index])
            pairs.append((x, values.to_numpy()))
        if not pairs:
            continue
        grid = np.linspace(0.0, min(x[-1] for x, _ in pairs), points)
        table = np.stack([np.interp(grid, x, y) for x, y in pairs])
        std = table.std(0, ddof=1) if len(pairs) > 1 else 0.0
        frame = {"algorithm": algorithm, "tokens": grid, "mean": table.mean(0), "std": std, "n": len(pairs)}
        frames.append(pd.DataFrame(frame))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TOKEN_CURVE_COLUMNS)


def _last_before(series: pd.Series, step: int) -> float:
    earlier = series[series.index < step]
    return float(earlier.iloc[-1]) if len(earlier) else 0.0


def clip_activity(run: RunInfo, minibatches: int) -> pd.DataFrame:
    """Per position of the step in its round: mean clipfrac, mean ratio_min / ratio_max, steps counted."""
    rows = []
    clip = run_series(run, "loss/clipfrac")
    low, high = run_series(run, "loss/ratio_min"), run_series(run, "loss/ratio_max")
    for position in range(minibatches):
        steps = [s for s in clip.index if s % minibatches == position]  # train metrics of update k are logged at k-1
        lows, highs = low.reindex(steps), high.reindex(steps)
        rows.append(
            {
                "position": position,
                "steps": len(steps),
                "clipfrac": clip.loc[steps].mean(),
                "ratio_min": lows.mean(),
                "ratio_max": highs.mean(),
                "ratio_min_lowest": lows.min(),
                "ratio_max_highest": highs.max(),
            }
        )
    return pd.DataFrame(rows).set_index("position")


def plot_ablation(runs: Sequence[RunInfo], path: str | Path | None = None):
    """Four panels: validation subEM (mean of benchmarks) vs steps and vs generated tokens, 2-hop validation vs steps,
    sampled reward vs steps. Mean ± std over seeds. Returns the Figure; saves a PNG to `path` when given."""
    from matplotlib.figure import Figure

    from dspo.sweeps.analysis import curves

    fig = Figure(figsize=(13, 8), layout="constrained")
    axes = fig.subplots(2, 2).reshape(-1)
    algorithms = sorted({r.algorithm for r in runs})
    colors = {a: f"C{i}" for i, a in enumerate(algorithms)}
    panels = [
        ("val/subem_mean", "step"),
        ("val/subem_mean", "tokens"),
        ("val/toy_2hop/subem", "step"),
        ("rollout/sampled_reward_mean", "step"),
    ]
    for ax, (tag, axis) in zip(axes, panels, strict=True):
        smoothing = 0.6 if tag.startswith("rollout") else 0.0
        frame = curves_vs_tokens(runs, tag) if axis == "tokens" else curves(runs, tag, smoothing=smoothing)
        x = "tokens" if axis == "tokens" else "step"
        # a curve needs two x values: a lone point (step 0 only) is drawn as a marker, and the panel says why
        single = not frame.empty and frame.groupby("algorithm")[x].nunique().max() < 2
        for algorithm, group in frame.groupby("algorithm", sort=True):
            label = f"{algorithm} (n={int(group['n'].max())})"
            ax.plot(group[x], group["mean"], color=colors[algorithm], label=label, marker="o" if single else None)
            low, high = group["mean"] - group["std"], group["mean"] + group["std"]
            ax.fill_between(group[x], low, high, color=colors[algorithm], alpha=0.15)
        ax.set_title(f"{tag} vs {'generated tokens' if axis == 'tokens' else 'optimizer steps'}", fontsize=10)
        ax.set_xlabel("generated tokens (all sampled)" if axis == "tokens" else "step")
        ax.grid(alpha=0.3)
        if frame.empty:
            _panel_note(ax, f"no data: no run logged {tag}")
        else:
            ax.legend(fontsize=8)
        if single:
            _panel_note(ax, _SINGLE_POINT_VAL if tag.startswith("val/") else "one point only: a single round logged")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


_SINGLE_POINT_VAL = "step-0 validation only: the runs stopped before\nthe next one (trainer.val_check_interval)"


def _panel_note(ax, text: str) -> None:
    ax.text(
        0.5, 0.75, text, ha="center", va="center", transform=ax.transAxes, color="gray", fontsize=9
    )  # above a lone point


def report(sweep: str | Path, minibatches: int = 2, by: str | None = None) -> dict:
    """Everything the README's ablation section shows, as plain JSON-able data. Jobs that failed, were preempted or
    were killed (their `status.json`, dspo.sweeps.status) are left out of the numbers and listed under `incomplete_jobs`
    with their last error line (the key is absent when every job finished, so a complete sweep's report is as
    before)."""
    runs, incomplete = complete_runs(sweep, by)
    if not runs:
        names = ", ".join(job["job"] for job in incomplete)
        raise FileNotFoundError(f"no job of {sweep} finished ({names}): `dspo-sweep {sweep}` says why")
    result = _report(runs, minibatches)
    if by:
        from dspo.sweeps.pareto_front import front

        result["front"] = front(runs, result["runs"])
    if incomplete:
        result["incomplete_jobs"] = incomplete
    return result


def complete_runs(sweep: str | Path, by: str | None = None) -> tuple[list[RunInfo], list[dict]]:
    """(the runs to report, the jobs left out: job, state, step, error), by each run's `status.json`; a run without
    one (written before status files existed) is reported as it is. `by`: grouped by a config key (`find_runs`)."""
    from dspo.sweeps.status import INCOMPLETE_STATES, job_state

    runs, incomplete = [], []
    for run in find_runs(sweep, by):
        job = job_state(run.dir)
        if job.state in INCOMPLETE_STATES:
            incomplete.append({"job": job.name, "state": job.state, "step": job.step, "error": job.error})
        else:
            runs.append(run)
    return runs, incomplete


def _report(runs: list[RunInfo], minibatches: int) -> dict:
    records = [run_record(run) for run in runs]
    table = summary(records)
    clip = {
        algorithm: clip_activity(next(r for r in runs if r.algorithm == algorithm), minibatches).to_dict("index")
        for algorithm in sorted({r.algorithm for r in runs})
    }
    return {"runs": records, "summary": json.loads(table.to_json(orient="index")), "clip_activity": clip}


# (column of `summary`, heading, format of one number): what the console shows, each as mean ± 95 % half-width
CONSOLE_COLUMNS = [
    ("val_start", "val step 0", "{:.3f}"),
    ("val_final", "val final", "{:.3f}"),
    ("val_gain", "gain", "{:+.3f}"),
    ("val/toy_2hop/subem@final", "val 2-hop final", "{:.3f}"),
    ("test/subem_mean@final", "test mean", "{:.3f}"),
    ("sampled_reward_mean", "sampled reward", "{:.3f}"),
    ("generated_tokens", "tokens sampled", "{:,.0f}"),
]


def format_summary(table: pd.DataFrame) -> pd.DataFrame:
    """`summary` as text: `n` an integer, each metric `mean ± half-width` (the mean alone for one run, "-" when no run
    has a value), collapsed as `k / n`."""
    out = pd.DataFrame(index=table.index)
    out["n"] = table["n"].astype(int)
    for column, heading, fmt in CONSOLE_COLUMNS:
        if column in table.columns:
            out[heading] = [_plus_minus(m, h, fmt) for m, h in zip(table[column], table[f"{column}±"], strict=True)]
    out["collapsed"] = [f"{int(c)} / {int(n)}" for c, n in zip(table["collapsed"], table["n"], strict=True)]
    if "rollbacks" in table.columns:  # reports written before issue 55 have none
        out["rollbacks"] = table["rollbacks"].fillna(0).astype(int)
    return out


def _plus_minus(mean: float, half: float, fmt: str) -> str:
    if pd.isna(mean):
        return "-"
    return fmt.format(mean) if pd.isna(half) else f"{fmt.format(mean)} ± {fmt.format(half).lstrip('+')}"


def format_clip(clip: dict[str, dict]) -> pd.DataFrame:
    """`report()["clip_activity"]` as text rows (algorithm, position): steps, clipfrac, mean ratio range, extremes."""
    rows = {}
    for algorithm, positions in clip.items():
        for position, c in positions.items():
            logged = not pd.isna(c["clipfrac"])
            rows[(algorithm, int(position))] = {
                "steps": int(c["steps"]),
                "clipfrac": f"{c['clipfrac']:.4f}" if logged else "not logged",
                "ratio min .. max (mean)": f"{c['ratio_min']:.4f} .. {c['ratio_max']:.4f}" if logged else "-",
                "extremes": f"{c['ratio_min_lowest']:.4f} .. {c['ratio_max_highest']:.4f}" if logged else "-",
            }
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis(["algorithm", "position"])


def report_text(result: dict) -> str:
    """What `dspo-report` prints: the summary with intervals, why a value is missing, the clip activity."""
    table = pd.DataFrame.from_dict(result["summary"], orient="index")
    lines = [
        f"{len(result['runs'])} runs; mean ± 95 % half-width over seeds (Student t; the mean alone for a single run)",
        format_summary(table).to_string(),
    ]
    for algorithm, row in table.iterrows():
        if row.get("no_final_val", 0):
            steps = [
                r["last_step"] for r in result["runs"] if r["algorithm"] == algorithm and r["last_step"] is not None
            ]
            lines.append(
                f"{algorithm}: no final validation yet in {int(row['no_final_val'])} of {int(row['n'])} runs: only the "
                f"step-0 validation was logged (runs end at step {max(steps, default=0)}, before the next validation: "
                "trainer.val_check_interval), so 'val final' and 'gain' are blank, not 0"
            )
    for job in result.get("incomplete_jobs", []):
        step = f" at step {job['step']}" if job.get("step") is not None else ""
        lines.append(f"left out: {job['job']} {job['state']}{step}: {job.get('error') or 'no error line found'}")
    if result.get("front"):
        from dspo.sweeps.pareto_front import format_front

        lines += ["", format_front(result["front"])]
    if result["clip_activity"]:
        lines += ["", "clip activity per position of the optimizer step in its round (0 = first mini-batch, on-policy;"]
        lines += ["one run per algorithm):", format_clip(result["clip_activity"]).to_string()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dspo-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="a multirun folder (or any folder holding dspo runs)")
    parser.add_argument("--json", default=None, help="write the report here (default: none)")
    parser.add_argument("--figure", default=None, help="write the four-panel figure here (PNG; default: none)")
    parser.add_argument("--minibatches", type=int, default=2, help="algorithm.num_minibatches of the runs")
    parser.add_argument("--by", default=None, help="group by this config key's value (e.g. env.reward.cost.search)")
    parser.add_argument("--front-figure", default=None, help="with --by: write the utility-cost front here (PNG)")
    args = parser.parse_args(argv)
    if args.front_figure and not args.by:
        parser.error("--front-figure needs --by KEY: the front is drawn over the values of a swept key")
    result = report(args.sweep, args.minibatches, args.by)
    print(report_text(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=float) + "\n")
    if args.figure:
        plot_ablation(complete_runs(args.sweep, args.by)[0], args.figure)
    if args.front_figure:
        from dspo.sweeps.pareto_front import plot_front

        plot_front(result["front"], complete_runs(args.sweep, args.by)[0], args.front_figure)


if __name__ == "__main__":
    main()
