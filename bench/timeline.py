"""What runs when: a timeline of rounds from the `timeline.jsonl` that `dspo-train` writes into each run directory.

    .venv/bin/python bench/timeline.py RUN_DIR [RUN_DIR ...] [--rounds 6] [--skip 2] [--figure docs/timeline.png]

One panel per run, two lanes each: the engine (a bar per round's generation: in the trainer's process at
max_staleness 0, in the engine process at k >= 1) and the trainer (waiting for a round, then training it: old
logprobs, the mini-batches' updates). Times are the run's own `time.time()` stamps (one machine, one clock). Printed:
per round, generation and update seconds, and the shares of the shown window each side was busy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings import by name, also when loaded as a module
from _checks import require_measured  # noqa: E402


def load(run_dir: Path) -> list[dict]:
    path = run_dir / "timeline.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} not found: runs write it from this version of dspo on (one line per round)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def busy(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    covered = sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)
    return covered / max(end - start, 1e-9)


def describe(name: str, rounds: list[dict]) -> None:
    start, end = rounds[0]["taken"], rounds[-1]["trained"]
    generation = [tuple(r["generation"]) for r in rounds]
    updates = [(r["taken"], r["trained"]) for r in rounds]
    per_round = (end - start) / len(rounds)
    print(f"{name}: {len(rounds)} rounds in {end - start:.1f} s ({per_round:.2f} s/round)")
    for r in rounds:
        print(f"  round {r['round']}: generation {r['generation'][1] - r['generation'][0]:.2f} s, "
              f"waited {r['taken'] - r['waiting']:.2f} s, trained {r['trained'] - r['taken']:.2f} s")  # fmt: skip
    print(f"  busy: engine {busy(generation, start, end):.0%}, trainer {busy(updates, start, end):.0%}")


def draw(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.9 * len(runs)), squeeze=False)
    for axis, (name, rounds) in zip(axes[:, 0], runs.items()):
        origin = rounds[0]["waiting"]
        for r in rounds:
            g0, g1 = (t - origin for t in r["generation"])
            axis.broken_barh([(g0, g1 - g0)], (1.1, 0.8), color="tab:orange", alpha=0.8)
            axis.text((g0 + g1) / 2, 1.5, str(r["round"]), ha="center", va="center", fontsize=8)
            wait0, taken, trained = r["waiting"] - origin, r["taken"] - origin, r["trained"] - origin
            axis.broken_barh([(wait0, taken - wait0)], (0.1, 0.8), color="lightgrey")
            axis.broken_barh([(taken, trained - taken)], (0.1, 0.8), color="tab:blue", alpha=0.8)
            axis.text((taken + trained) / 2, 0.5, str(r["round"]), ha="center", va="center", fontsize=8, color="w")
        axis.set_yticks([0.5, 1.5], ["trainer", "engine"])
        axis.set_title(name, fontsize=9, loc="left")
        axis.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds (orange: generation of round n; blue: training on it; grey: trainer waiting)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--skip", type=int, default=2, help="rounds skipped at the start (engine start-up, warm-up)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds shown per run")
    parser.add_argument("--figure", type=Path)
    args = parser.parse_args()
    runs = {}
    for run_dir in args.runs:
        rounds = load(run_dir)[args.skip : args.skip + args.rounds]
        if not rounds:
            raise SystemExit(f"{run_dir}: fewer than {args.skip + 1} rounds in timeline.jsonl")
        runs[f"{run_dir.name}: max_staleness={rounds[0].get('max_staleness', 0)}"] = rounds
    for name, rounds in runs.items():
        describe(name, rounds)
    figures = {}
    for name, rounds in runs.items():
        for r in rounds:
            figures[f"{name} round {r['round']}.generation_s"] = r["generation"][1] - r["generation"][0]
            figures[f"{name} round {r['round']}.update_s"] = r["trained"] - r["taken"]
    require_measured("timeline", figures)
    if args.figure:
        draw(runs, args.figure)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
