"""Learning at rollout.max_staleness 0 vs k (issue 28): final validation over seeds with 95 % intervals, curves against
optimizer steps and against wall time.

    dspo-train -m seed=0,1,2,3,4 trainer.max_steps=40 rollout.max_staleness=0     # -> outputs/multirun/<A>
    dspo-train -m seed=0,1,2,3,4 trainer.max_steps=40 rollout.max_staleness=1     # -> outputs/multirun/<B>
    .venv/bin/python bench/async_learning.py outputs/multirun/<A> outputs/multirun/<B> \\
        [--json bench/results/async_learning.json] [--figure docs/async_learning.png]

Per sweep: `dspo.sweeps.report`'s per-run record (step-0 and final validation, test, tokens, collapse) and its summary
(mean ± Student-t 95 % half-width over seeds), labelled by the runs' `rollout.max_staleness`. Wall time of a run =
TensorBoard event time since the run's first event (the step-0 validation), so the curves against wall time include
validation, as a user's run does. Wall times mean something only for runs made one at a time on the same machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _checks import require_measured  # noqa: E402  bench/ is on sys.path when this script runs

from dspo.sweeps.analysis import find_runs, scalar_wall_times  # noqa: E402
from dspo.sweeps.report import ci95, run_record, summary  # noqa: E402


def staleness_of(run) -> int:
    from omegaconf import OmegaConf

    config = OmegaConf.load(run.dir / ".hydra" / "config.yaml")
    return int(OmegaConf.select(config, "rollout.max_staleness", default=0) or 0)


def since_start(scalars: dict[str, list[tuple[int, float, float]]], tag: str) -> list[tuple[int, float, float]]:
    """[(step, seconds since the run's first event, value)] of `tag`."""
    start = min((wall for rows in scalars.values() for _, wall, _ in rows), default=0.0)
    return [(step, wall - start, value) for step, wall, value in scalars.get(tag, [])]


def collect(sweeps: list[Path]) -> tuple[list[dict], dict[str, list]]:
    records, curves = [], {}
    for sweep in sweeps:
        for run in find_runs(sweep):
            label = f"k={staleness_of(run)}"
            record = run_record(run)
            scalars = scalar_wall_times(run.dir)
            series, losses = since_start(scalars, "val/subem_mean"), since_start(scalars, "train/loss")
            record.update(algorithm=label, train_wall_s=losses[-1][1] if losses else math.nan)
            records.append(record)
            curves.setdefault(label, []).append({"seed": run.seed, "val": series})
    return records, curves


def plot(curves: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_wall) = plt.subplots(1, 2, figsize=(11, 4))
    for color, (label, runs) in zip(("tab:blue", "tab:orange", "tab:green"), sorted(curves.items())):
        steps = sorted({s for run in runs for s, _, _ in run["val"]})
        means = [ci95([v for run in runs for s, _, v in run["val"] if s == step]) for step in steps]
        by_step.plot(steps, [m for m, _ in means], color=color, marker="o", label=f"{label} (mean, n={len(runs)})")
        half = [0.0 if math.isnan(h) else h for _, h in means]
        low, high = [m - h for (m, _), h in zip(means, half)], [m + h for (m, _), h in zip(means, half)]
        by_step.fill_between(steps, low, high, color=color, alpha=0.15)
        for index, run in enumerate(runs):
            walls = [w for _, w, _ in run["val"]]
            by_wall.plot(walls, [v for _, _, v in run["val"]], color=color, alpha=0.6, marker=".",
                         label=label if index == 0 else None)  # fmt: skip
    by_step.set(xlabel="optimizer step", ylabel="val/subem_mean", title="validation vs steps (95 % interval)")
    by_wall.set(xlabel="wall time since the step-0 validation (s)", ylabel="val/subem_mean", title="vs wall time")
    for axis in (by_step, by_wall):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweeps", nargs="+", type=Path, help="multirun directories (one per max_staleness)")
    parser.add_argument("--json", type=Path, help="write runs and summary here")
    parser.add_argument("--figure", type=Path, help="write the curves here (png)")
    args = parser.parse_args()
    records, curves = collect(args.sweeps)
    if not records:
        raise SystemExit(f"no dspo runs under {', '.join(map(str, args.sweeps))}")
    table = summary(records).reset_index()
    walls = {label: ci95([r["train_wall_s"] for r in records if r["algorithm"] == label]) for label in curves}
    print("| max_staleness | n | val step 0 -> final | test mean | train wall (s) | collapsed |")
    print("|---|---|---|---|---|---|")
    for row in table.to_dict("records"):
        wall = walls[row["algorithm"]]
        print(
            f"| {row['algorithm']} | {row['n']} | {row['val_start']:.3f} -> {row['val_final']:.3f} ± "
            f"{row['val_final±']:.3f} | {row['test/subem_mean@final']:.3f} ± {row['test/subem_mean@final±']:.3f} | "
            f"{wall[0]:.0f} ± {wall[1]:.0f} | {row['collapsed']} / {row['n']} |"
        )
    figures = {f"{r['algorithm']} seed {r.get('seed')}.{k}": r.get(k) for r in records for k in ("val_final",)}
    figures.update({f"{label}.train_wall_s": wall[0] for label, wall in walls.items()})
    require_measured("async_learning", figures, hint="the sweeps' runs must have finished (validation, TensorBoard)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"runs": records, "summary": table.to_dict("records"), "train_wall_s": walls, "curves": curves}
        args.json.write_text(json.dumps(payload, indent=1, default=float) + "\n")
    if args.figure:
        plot(curves, args.figure)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
