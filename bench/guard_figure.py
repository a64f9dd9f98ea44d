"""docs/guard.png: one collapsing toy run with the guard off and on (issue 55): sampled reward, entropy and validation,
the rollbacks of the guarded run marked.

    python bench/guard_figure.py OFF_RUN_DIR ON_RUN_DIR docs/guard.png [--last-step 20] [--title TEXT]
        [--final-tag test/subem_mean]   # also mark each run's score of the weights it ended on (issue 55's study ran
                                        # its test stage on the validation questions: after a rollback at the last
                                        # validation, those are not the weights validated at the last step)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TAGS = (
    ("rollout/sampled_reward_mean", "sampled reward"),
    ("train/entropy", "entropy"),
    ("val/subem_mean", "val subEM"),
)


def scalars(run: Path, extra: tuple[str, ...] = ()) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of the figure's tags and `extra` (dspo.sweeps.analysis.load_scalars reads the event
    files)."""
    from dspo.sweeps.analysis import load_scalars

    frame = load_scalars(run)
    frame = frame[frame.tag.isin([tag for tag, _ in TAGS] + list(extra))]
    found = {tag: dict(zip(rows.step, rows.value, strict=True)) for tag, rows in frame.groupby("tag")}
    if not found:
        raise SystemExit(f"bench/guard_figure.py: {run} has none of {[tag for tag, _ in TAGS]}: nothing to draw")
    return found


def rollbacks(run: Path) -> list[int]:
    """Steps where the guard changed the run (a rollback, a backoff without a healthy checkpoint, a stop)."""
    path = run / "guard.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [event["step"] for event in map(json.loads, lines) if event["action"] in ("rollback", "backoff", "stop")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("off", type=Path)
    parser.add_argument("on", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--last-step", type=int, default=20)
    parser.add_argument("--title", default="")
    parser.add_argument("--final-tag", default=None, help="a tag scoring the weights a run ended on, drawn as a star")
    args = parser.parse_args()
    extra = (args.final_tag,) if args.final_tag else ()
    runs = {"guard off": (scalars(args.off, extra), "tab:red"), "guard on": (scalars(args.on, extra), "tab:blue")}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for ax, (tag, title) in zip(axes, TAGS, strict=True):
        for label, (values, color) in runs.items():
            series = values.get(tag, {})
            xs = sorted(x for x in series if x <= args.last_step)
            ax.plot(xs, [series[x] for x in xs], label=label, color=color, marker="o" if "val" in tag else None, ms=4)
        for label, (values, color) in runs.items():
            final = values.get(args.final_tag, {}) if "val" in tag and args.final_tag else {}
            for value in final.values():
                ax.plot([args.last_step], [value], marker="*", ms=12, color=color, ls="none", label=f"{label}: ends on")
        for i, step in enumerate(rollbacks(args.on)):
            ax.axvline(step, color="tab:blue", ls="--", lw=0.8, label="rollback (guard on)" if i == 0 else None)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
    axes[0].legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
