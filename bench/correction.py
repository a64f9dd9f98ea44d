"""Which rollout correction for stale rounds (issue 38): `algorithm.rollout_correction.mode` x `rollout.max_staleness`
on the toy default, over seeds, to choose the default for k >= 1 by measurement.

    python bench/correction.py --seeds 0 1 2 --steps 100 --out outputs/bench/correction.json   # the sweep (21 runs)
    python bench/correction.py --smoke                     # 4 tiny runs (1 seed, k in {0, 1}, 2 steps): end to end
    python bench/correction.py --report outputs/bench/correction.json                          # the table only

The grid: k = 0 with the default mode (`seq_tis`) only; k in {1, 2} x {seq_tis (geometric mean), seq_prod_tis (the
truncated sequence importance weight), none}. Each run is one `dspo-train` subprocess, one at a time, with
`rollout.max_staleness=K algorithm.rollout_correction.mode=M seed=S trainer.max_steps=N run_test=false`, in
`<root>/<mode>_k<K>_seed<S>/` (`--root`, default outputs/correction; a run whose directory holds `metrics.yaml` is
finished and reused, delete it to train it again). The table, per (mode, k): the final validation `val/subem_mean`
(the last one after step 0, as `dspo.sweeps.report`), mean ± 95 % half-width over seeds (Student t,
`dspo.sweeps.report.ci95`),
and the per-run means over training steps of `mismatch/weight_mean`, `mismatch/weight_min`, `mismatch/ess` and
`rollout/staleness_mean`, averaged over seeds. Exit status 1 when a run failed (or ran past `--timeout`) or a figure is
NaN or missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _outputs import provenance  # bench/ is on sys.path when this script runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspo.sweeps.report import ci95  # noqa: E402

DEFAULT_MODE = "seq_tis"  # conf/algorithm/dspo.yaml
MODES = ("seq_tis", "seq_prod_tis", "none")
STATS = ("mismatch/weight_mean", "mismatch/weight_min", "mismatch/ess", "rollout/staleness_mean")
VAL = "val/subem_mean"
# --smoke: the shortened default of the test suite (tests/conftest.py), validated after its 2 steps
SMOKE_OVERRIDES = [
    "algorithm.group_size=4",
    "algorithm.batch_groups=2",
    "algorithm.micro_batch_size=4",
    "data.val_limit=16",
    "trainer.val_check_interval=2",
]


def grid(staleness: list[int], modes: tuple[str, ...] = MODES) -> list[tuple[str, int]]:
    """(mode, k) pairs: k = 0 with the default mode only, every mode at each k >= 1."""
    pairs = [(DEFAULT_MODE, 0)] if 0 in staleness else []
    return pairs + [(mode, k) for k in sorted(set(staleness)) if k >= 1 for mode in modes]


def overrides(mode: str, k: int, seed: int, steps: int) -> list[str]:
    return [
        f"rollout.max_staleness={k}",
        f"algorithm.rollout_correction.mode={mode}",
        f"seed={seed}",
        f"trainer.max_steps={steps}",
        "run_test=false",
    ]


def run_figures(run_dir: Path) -> dict[str, float]:
    """A finished run's final validation and the means over training steps of STATS (NaN when never logged)."""
    from dspo.sweeps.analysis import load_scalars, run_info
    from dspo.sweeps.report import run_record

    figures: dict[str, float] = {"val_final": float(run_record(run_info(run_dir))["val_final"])}
    scalars = load_scalars(run_dir)
    for tag in STATS:
        values = scalars[scalars.tag == tag].value
        figures[tag] = float(values.mean()) if len(values) else math.nan
    return figures


def train(mode: str, k: int, seed: int, steps: int, root: Path, extra: list[str], timeout: float | None = None) -> dict:
    """One `dspo-train` run (reused when already finished); its record: mode, k, seed, exit status, seconds, figures.
    A run past `timeout` seconds is killed and counts as failed (exit status "timeout")."""
    run_dir = root / f"{mode}_k{k}_seed{seed}"
    record: dict = {"mode": mode, "k": k, "seed": seed, "dir": str(run_dir)}
    if not (run_dir / "metrics.yaml").is_file():
        executable = shutil.which("dspo-train", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        cmd = [executable or "dspo-train", *overrides(mode, k, seed, steps), *extra, f"hydra.run.dir={run_dir}"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        print(f"[{mode} k={k} seed={seed}] {' '.join(cmd)}", flush=True)
        start = time.monotonic()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as late:
            done = subprocess.CompletedProcess(cmd, "timeout", _text(late.stdout), _text(late.stderr))
        record.update(returncode=done.returncode, seconds=round(time.monotonic() - start, 1))
        if done.returncode:
            record["error"] = (done.stderr or done.stdout)[-2000:]
            print(f"  failed (exit {done.returncode}):\n{record['error']}", flush=True)
            return record
    else:
        record["returncode"] = 0
    record.update(run_figures(run_dir))
    return record


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (mode, k), in the grid's order: n, failed runs, val_final mean and 95 % half-width, STATS means."""
    rows = []
    for mode, k in dict.fromkeys((r["mode"], r["k"]) for r in runs):
        group = [r for r in runs if (r["mode"], r["k"]) == (mode, k)]
        done = [r for r in group if r.get("returncode") == 0]
        row: dict = {"mode": mode, "k": k, "n": len(done), "failed": len(group) - len(done)}
        row["val_final"], row["val_final±"] = ci95([r.get("val_final", math.nan) for r in done])
        for tag in STATS:
            row[tag] = ci95([r.get(tag, math.nan) for r in done])[0]
        rows.append(row)
    return rows


def problems(payload: dict) -> list[str]:
    """Failed runs, and figures that are NaN or missing (a run without a validation after step 0, a stat not logged)."""
    found = [f"{r['mode']} k={r['k']} seed={r['seed']}: exit {r.get('returncode')}" for r in payload["runs"]
             if r.get("returncode") != 0]  # fmt: skip
    for row in payload["summary"]:
        for key in ("val_final", *STATS):
            value = row.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                found.append(f"{row['mode']} k={row['k']}: {key} is NaN or missing")
    return found


def table(rows: list[dict]) -> str:
    def cell(value: float, digits: int = 3) -> str:
        return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"

    lines = [
        "| mode | k | n | val/subem_mean final | weight_mean | weight_min | ess | staleness_mean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        half = row["val_final±"]
        val = cell(row["val_final"]) + ("" if half is None or math.isnan(half) else f" ± {half:.3f}")
        failed = f" ({row['failed']} failed)" if row["failed"] else ""
        stats = " | ".join(cell(row[tag]) for tag in STATS)
        lines.append(f"| {row['mode']} | {row['k']} | {row['n']}{failed} | {val} | {stats} |")
    return "\n".join(lines)


def report(payload: dict) -> int:
    print(table(payload["summary"]))
    found = problems(payload)
    for line in found:
        print(f"problem: {line}")
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100, help="trainer.max_steps of each run (toy default 100)")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="rollout.max_staleness values")
    parser.add_argument("--out", type=Path, default=Path("outputs") / "bench" / "correction.json")
    parser.add_argument("--root", type=Path, default=Path("outputs") / "correction", help="where the runs go")
    parser.add_argument("--smoke", action="store_true", help="1 seed, k in {0, 1}, 2 steps, shortened batches")
    parser.add_argument("--report", type=Path, metavar="FILE", help="only print the table of an existing JSON")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a run is killed (failed)")
    args = parser.parse_args(argv)
    if args.report:
        return report(json.loads(args.report.read_text()))
    extra: list[str] = []
    if args.smoke:
        args.seeds, args.steps, args.staleness, extra = [0], 2, [0, 1], SMOKE_OVERRIDES
        args.timeout = min(args.timeout, 300.0)
        args.root = args.root.with_name(f"{args.root.name}_smoke") / time.strftime("%Y%m%d-%H%M%S")
        args.out = args.out.with_name("correction_smoke.json")
    root = args.root.resolve()
    runs: list[dict] = []
    payload: dict = {
        "measured": provenance(),
        "steps": args.steps,
        "seeds": args.seeds,
        "extra_overrides": extra,
        "root": str(root),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for mode, k in grid(args.staleness):
        for seed in args.seeds:
            runs.append(train(mode, k, seed, args.steps, root, extra, args.timeout))
            payload.update(runs=runs, summary=summarize(runs))
            args.out.write_text(json.dumps(payload, indent=1) + "\n")  # after every run: a long sweep keeps its part
    print(f"JSON: {args.out}")
    return report(payload)


if __name__ == "__main__":
    sys.exit(main())
