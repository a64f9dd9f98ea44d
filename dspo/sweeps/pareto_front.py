"""The utility-cost front of a sweep over a cost weight (env=planner; AI-SearchPlanner's Pareto front of planning
utility against planning cost), part of the ablation report:

    dspo-train -m env=planner env.reward.cost.search=0,0.1,0.3,0.6,1.0 seed=0,1,2
    dspo-report outputs/multirun/<timestamp> --by env.reward.cost.search

One row per value of the swept key (its runs are the seeds), each figure a mean with its 95 % half-width over them
(`dspo.sweeps.analysis.ci95`):
- utility: `test/subem_mean`, the system's accuracy on the test questions (under env=planner, the answerer's answers
  from what the trained planner found), and the final validation beside it;
- cost: queries sent to the search engine and answerer calls per sampled episode (`reward/searches`,
  `reward/answerer_calls`), each run's mean over the last fifth of its rounds (at least its last round): what the
  policy does at the end of training, not what it did on the way;
- on the front: no other row reaches at least its utility with at most its calls (searches + answerer calls), better
  in one of the two. Rows missing either figure are not placed.

`--front-figure PATH` draws it (`plot_front`): utility against calls per episode, one point per row with both
half-widths, the front joined; beside it, each row's searches per sampled episode over training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from dspo.sweeps.analysis import RunInfo, ci95, run_series

# (row key, logged tag): what each episode cost and earned, averaged over a run's last rounds
LATE_TAGS = {
    "searches": "reward/searches",
    "answerer_calls": "reward/answerer_calls",
    "sampled_answerer_subem": "reward/answerer_subem",
    "plan_quality": "reward/plan_quality",
    "unfinished": "reward/unfinished",  # episodes the budget ended (cost.unfinished)
}
COLUMNS = [  # (row key, heading, format)
    ("utility", "test subEM", "{:.3f}"),
    ("val_final", "val final", "{:.3f}"),
    ("searches", "searches/episode", "{:.2f}"),
    ("answerer_calls", "answerer calls/episode", "{:.2f}"),
    ("sampled_answerer_subem", "sampled answerer subEM", "{:.3f}"),
    ("plan_quality", "plan quality", "{:.3f}"),
    ("unfinished", "unfinished/episode", "{:.2f}"),
]


def late_mean(run: RunInfo, tag: str) -> float:
    """The run's mean of `tag` over the last fifth of its logged rounds (at least one); NaN when never logged."""
    series = run_series(run, tag)
    if not len(series):
        return math.nan
    return float(series.iloc[-max(1, len(series) // 5) :].mean())


def _order(label: str) -> tuple:
    """Groups in the swept value's order (numbers numerically: 0.05 before 0.1 before 1.0)."""
    value = label.rpartition("=")[2]
    try:
        return (0, float(value), label)
    except ValueError:
        return (1, 0.0, label)


def front(runs: Sequence[RunInfo], records: Sequence[dict]) -> list[dict]:
    """One row per group of `runs` (`RunInfo.algorithm`: `<key>=<value>` under `--by`); `records` are
    `dspo.sweeps.report.run_record`'s for the same runs."""
    rows = []
    for label in sorted({r.algorithm for r in runs}, key=_order):
        group = [r for r in runs if r.algorithm == label]
        mine = [rec for rec in records if rec["algorithm"] == label]
        row: dict = {"group": label, "n": len(group)}
        row["utility"], row["utility±"] = ci95([rec.get("test/subem_mean@final", math.nan) for rec in mine])
        row["val_final"], row["val_final±"] = ci95([rec["val_final"] for rec in mine])
        for key, tag in LATE_TAGS.items():
            row[key], row[f"{key}±"] = ci95([late_mean(r, tag) for r in group])
        row["calls"], row["calls±"] = ci95([_calls(r) for r in group])
        rows.append(row)
    for row in rows:
        placed = not (math.isnan(row["utility"]) or math.isnan(row["calls"]))
        row["on_front"] = placed and not any(_dominates(other, row) for other in rows if other is not row)
    return rows


def _calls(run: RunInfo) -> float:
    """Searches + answerer calls per episode late in `run` (a run that never logged answerer calls made none)."""
    answerer = late_mean(run, LATE_TAGS["answerer_calls"])
    return late_mean(run, LATE_TAGS["searches"]) + (0.0 if math.isnan(answerer) else answerer)


def _dominates(a: dict, b: dict) -> bool:
    if math.isnan(a["utility"]) or math.isnan(a["calls"]):
        return False
    at_least = a["utility"] >= b["utility"] and a["calls"] <= b["calls"]
    return at_least and (a["utility"] > b["utility"] or a["calls"] < b["calls"])


def format_front(rows: Sequence[dict]) -> str:
    """The front as the console shows it: `mean ± half-width` per figure, `*` on the front."""
    table = pd.DataFrame(index=[row["group"] for row in rows])
    table["n"] = [row["n"] for row in rows]
    for key, heading, fmt in COLUMNS:
        table[heading] = [_plus_minus(row[key], row[f"{key}±"], fmt) for row in rows]
    table["front"] = ["*" if row["on_front"] else "" for row in rows]
    head = "utility-cost front (utility: test subEM; cost: per sampled episode over the last fifth of the rounds):"
    return head + "\n" + table.to_string()


def _plus_minus(mean: float, half: float, fmt: str) -> str:
    if math.isnan(mean):
        return "-"
    return fmt.format(mean) if math.isnan(half) else f"{fmt.format(mean)} ± {fmt.format(half)}"


def plot_front(rows: Sequence[dict], runs: Sequence[RunInfo], path: str | Path | None = None):
    """Two panels: the front (test subEM against searches + answerer calls per episode, mean ± 95 % half-width over
    seeds, the rows on the front joined in order of cost) and `reward/searches` per step for each row (mean ± std over
    its runs, smoothed). Returns the Figure; saves a PNG to `path` when given."""
    from matplotlib.figure import Figure

    from dspo.sweeps.analysis import curves

    fig = Figure(figsize=(12, 4.6), layout="constrained")
    front_ax, searches_ax = fig.subplots(1, 2)
    colors = {row["group"]: f"C{i}" for i, row in enumerate(rows)}
    placed = [row for row in rows if not (math.isnan(row["utility"]) or math.isnan(row["calls"]))]
    for row in placed:
        front_ax.errorbar(
            row["calls"],
            row["utility"],
            xerr=_zero_if_nan(row.get("calls±", math.nan)),
            yerr=_zero_if_nan(row["utility±"]),
            fmt="o",
            color=colors[row["group"]],
            capsize=3,
            label=f"{_value(row['group'])} (n={row['n']})",
        )
    on_front = sorted((row for row in placed if row["on_front"]), key=lambda row: row["calls"])
    front_ax.plot([r["calls"] for r in on_front], [r["utility"] for r in on_front], "k--", lw=1, label="front")
    key = rows[0]["group"].rpartition("=")[0] if rows else ""
    front_ax.set_title(f"utility against cost, by {key}", fontsize=10)
    front_ax.set_xlabel("searches + answerer calls per sampled episode (last fifth of the rounds)")
    front_ax.set_ylabel("test subEM (the system's answers)")
    front_ax.grid(alpha=0.3)
    front_ax.legend(fontsize=8)
    frame = curves(runs, "reward/searches", smoothing=0.6)
    for group, part in frame.groupby("algorithm", sort=False):
        color = colors.get(group, "gray")
        searches_ax.plot(part["step"], part["mean"], color=color, label=_value(group))
        searches_ax.fill_between(
            part["step"], part["mean"] - part["std"], part["mean"] + part["std"], color=color, alpha=0.15
        )
    searches_ax.set_title("searches per sampled episode over training (smoothed 0.6)", fontsize=10)
    searches_ax.set_xlabel("step")
    searches_ax.grid(alpha=0.3)
    if not frame.empty:
        searches_ax.legend(fontsize=8)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def _value(group: str) -> str:
    """`env.reward.cost.search=0.3` -> `cost.search=0.3`: the last two parts of the key, and its value."""
    key, _, value = group.rpartition("=")
    return f"{'.'.join(key.split('.')[-2:])}={value}" if key else group


def _zero_if_nan(value: float) -> float:
    return 0.0 if math.isnan(value) else value
