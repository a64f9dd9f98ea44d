"""The environments of issue 27 on the toy miniature: each `env=` example against `env=search`, over seeds.

    python bench/environments.py --run                # train every setup below (3 seeds x 7, ~3.3 min a run on 2 cores)
    python bench/environments.py --run --setups ikea  # one setup (its runs, then the report of what is there)
    python bench/environments.py --run --setups search agent --out bench/results/agent_learning.json \
        --figure docs/agents.png                      # the example OpenAI-API agent against the built-in (issue 42)
    python bench/environments.py --run --setups deep --out bench/results/toy_deep_warm.json \
        --figure docs/toy_deep_warm.png               # experiment=toy_deep from its own warm start (issue 43)
    python bench/environments.py --run --setups deep_shipped_warmstart --out bench/results/toy_deep.json \
        --figure docs/toy_deep.png                    # the same from the default's shipped warm start (the "before")
    python bench/environments.py --run --setups tight_end tight_compact --seeds 0 \
        --out bench/results/compaction_learning.json --figure docs/compaction.png  # overflow end vs compact (issue 43)
    python bench/environments.py --run --setups deep_k1 deep_k1_partial --out bench/results/partial_rollouts.json \
        --figure docs/partial_rollouts.png            # one round ahead, with and without partial rollouts (issue 43)
    python bench/environments.py --run --setups selfplay selfplay_qa selfplay_loose --out bench/results/selfplay.json \
        --figure docs/selfplay.png                    # search self-play against supervised RL (issue 57)
    python bench/environments.py --run --setups goal_reflect_noisy simulated_noisy --noise-eval 0 0.3 0.5 0.7 \
        --out bench/results/goal_reflect.json --figure docs/goal_reflect.png  # the perturbation study (issue 57)
    python bench/environments.py                      # report on the runs already in outputs/environments

A setup is a `dspo-train -m seed=...` multirun of the toy default with the setup's overrides, into
`outputs/environments/<setup>/` (`--root`); each run is the default 100 steps with its test at the end. The report
prints, per setup, mean ± 95 % half-width over seeds (Student t, as `dspo-report`):
- validation subEM per question type at step 0 and at the last step, test subEM per type;
- searches per trajectory (`rollout/calls/<tool>` summed over the tools) over the first and the last 10 rounds;
- each setup's own signal over the first and the last 10 rounds: StepSearch's `reward/info_gain` and
  `reward/redundancy`, IKEA's shaping (`reward/knowledge_boundary`), two sources' `reward/right_tool` (the share of
  searches sent to the source that holds the hop's page), the simulator's `rollout/tool/search/noise_probability`.
JSON: `outputs/bench/environments.json` (or `--out`; `--update-shipped`: the tracked `bench/results/environments.json`
and the README's figure `docs/environments.png`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _noise_eval import has_noise, noise_eval, plot_noise, print_noise, save_figure
from _outputs import add_output_arguments, output_path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_WARMSTART_DEEP = [  # experiment=toy_deep from the default's shipped warm start: its recipe, toy root and limits
    "experiment=toy_deep",
    "prepare=toyworld",
    "paths.toy_root=${paths.cache}/toyworld/default",
    "prepare.toyworld.config.agent.max_turns=3",
    "prepare.toyworld.config.agent.max_total_tokens=1024",
]
TIGHT = [*SHIPPED_WARMSTART_DEEP, "rollout.agent.max_total_tokens=340"]  # as measured (commit 7a14c6a)
SETUPS: dict[str, list[str]] = {  # name -> dspo-train overrides (the toy default + these)
    "search": [],
    "stepsearch": ["env=stepsearch"],
    "dapo_search": ["algorithm=dapo"],
    "dapo_stepsearch_turn": ["algorithm=dapo", "env=stepsearch", "env.reward.credit=turn"],
    "ikea": ["env=ikea"],
    "two_sources": ["env=two_sources"],
    "simulated": ["env=simulated"],
    "agent": ["env=agent"],  # docs/examples/openai_agent.py through the OpenAI-compatible endpoint (docs/agents.md)
    "deep": ["experiment=toy_deep"],  # 1-4 hops, max_turns 8, 200 steps, its warm start (issue 43; docs/toy-deep.md)
    # experiment=toy_deep from the default's shipped warm start, as bench/results/toy_deep.json measured it (commit
    # c4ee793, when it was the setup `deep`): the default's warm-start recipe, toy root and demonstration limits
    "deep_shipped_warmstart": SHIPPED_WARMSTART_DEEP,
    # a tight context budget (a 2-hop episode takes ~344 tokens with its prompt): the episode ends, or the oldest tool
    # responses are compacted into one-line notes (rollout.agent.overflow; docs/long-episodes.md)
    "tight_end": [*TIGHT, "rollout.agent.overflow=end"],
    "tight_compact": [*TIGHT, "rollout.agent.overflow=compact"],
    # experiment=toy_deep one round ahead (the engine in its own process), with and without partial rollouts: rounds
    # that stop once enough groups finished and carry the rest (docs/async.md#partial-rollouts)
    "deep_k1": ["experiment=toy_deep", "rollout.max_staleness=1"],
    "deep_k1_partial": ["experiment=toy_deep", "rollout.max_staleness=1", "rollout.partial_rollouts=true"],
    # search self-play from the corpus alone (issue 57): proposer and solver roles of one policy, no QA training split,
    # against `search` (supervised RL on the toy's QA split) at the same steps
    "selfplay": ["experiment=toy_selfplay"],
    # the same without the on-topic rule (a question must name its topic and hold no markup): what the proposer learned
    # then (docs/selfplay.md); measured before the rule existed (commit 254f71d), seeds 0 and 1
    "selfplay_loose": ["experiment=toy_selfplay", "rollout.agent.roles.1.derive.on_topic=false"],
    # the control: supervised RL on the QA split from self-play's own warm start (one role, the default agent)
    "selfplay_qa": [
        "experiment=toy_selfplay",
        "rollout/agent=default",
        "data.train_files=[${paths.toy_root}/world/train.jsonl]",
    ],
    # the perturbation study (issue 57; RE-Searcher): every search result misleading with probability 0.3, with goal
    # and reflection (its own warm start, reflections paid) and without (env=simulated, the shipped warm start);
    # --noise-eval then scores each trained model and its warm start at other noise levels
    "goal_reflect_noisy": ["env=goal_reflect", "env.tools.search.noise=0.3"],
    "simulated_noisy": ["env=simulated", "env.tools.search.noise=0.3"],
}
NOISE_SETUPS = ["goal_reflect_noisy", "simulated_noisy"]
DEEP_SETUPS = ["deep", "deep_shipped_warmstart"]
EXAMPLES = ROOT / "docs" / "examples"  # on PYTHONPATH for every run: env=agent's function lives there
TYPES = ("toy_1hop", "toy_2hop", "toy_3hop", "toy_4hop")  # the last two only in experiment=toy_deep's runs
SIGNALS = (
    "reward/info_gain",
    "reward/redundancy",
    "reward/knowledge_boundary",
    "reward/right_tool",
    "rollout/tool/search/noise_probability",
    "rollout/truncated_share",
    "rollout/compactions",
    "rollout/time_s",
    "rollout/trainer_wait_s",
    "rollout/partial_share",
    "rollout/carried_groups",
    "rollout/token_staleness_mean",
    "rollout/proposer/valid_share",  # experiment=toy_selfplay: proposals kept by the check, of all proposer episodes
    "rollout/proposer/difficulty",  # ... the solver's failure rate on the kept ones
    "rollout/proposer/invalid/check_failed",
    "rollout/proposer/invalid/no_question",
    "rollout/proposer/invalid/off_topic",
    "rollout/proposer/invalid/malformed_question",
    "rollout/solver/outcome_mean",
    "reward/goal_share",  # env=goal_reflect: searches with a goal, ...
    "reward/reflect_right",  # ... reflected on rightly, ...
    "reward/held_share",  # ... whose results held the goal's page (what noise takes away)
)
WINDOW = 10  # rounds averaged at the start and at the end of a run
PANELS = [  # (title, tag, setups): the environments' figure, docs/environments.png
    ("StepSearch: 2-hop validation", "val/toy_2hop/subem", [*SETUPS][:4]),  # dspo, dapo: with and without
    ("IKEA: searches per trajectory", "rollout/calls/search", ["search", "ikea"]),
    ("two sources: share of searches to the right source", "reward/right_tool", ["two_sources"]),
    ("simulated search: validation subEM", "val/subem_mean", ["search", "simulated"]),
]
DEEP_PANELS = [  # experiment=toy_deep, docs/toy_deep.png and docs/toy_deep_warm.png
    ("3-hop validation subEM", "val/toy_3hop/subem", DEEP_SETUPS),
    ("4-hop validation subEM", "val/toy_4hop/subem", DEEP_SETUPS),
    ("searches per trajectory", "rollout/calls/search", DEEP_SETUPS),
    ("sampled episodes out of turns or tokens", "rollout/truncated_share", DEEP_SETUPS),
]
TIGHT_PANELS = [  # end against compact at a tight budget, docs/compaction.png
    ("2-hop validation subEM", "val/toy_2hop/subem", ["tight_end", "tight_compact"]),
    ("reward of the sampled rollouts", "rollout/sampled_reward_mean", ["tight_end", "tight_compact"]),
    ("compactions per round", "rollout/compactions", ["tight_compact"]),
]
PARTIAL_SETUPS = ["deep_k1", "deep_k1_partial"]
PARTIAL_PANELS = [  # rollout.max_staleness=1 with and without partial rollouts, docs/partial_rollouts.png
    ("3-hop validation subEM", "val/toy_3hop/subem", PARTIAL_SETUPS),
    ("engine time per round (s)", "rollout/time_s", PARTIAL_SETUPS),
    ("trainer wait per round (s)", "rollout/trainer_wait_s", PARTIAL_SETUPS),
    ("trajectories finished on newer weights", "rollout/partial_share", ["deep_k1_partial"]),
]
# each study's two arms apart (the cycle's tenth and eleventh look alike)
COLORS = {"tight_end": "C3", "tight_compact": "C0", "deep_k1": "C3", "deep_k1_partial": "C0"}
SELFPLAY_PANELS = [  # search self-play against supervised RL, docs/selfplay.png
    ("1-hop validation subEM", "val/toy_1hop/subem", ["search", "selfplay_qa", "selfplay", "selfplay_loose"]),
    ("2-hop validation subEM", "val/toy_2hop/subem", ["search", "selfplay_qa", "selfplay", "selfplay_loose"]),
    ("proposals kept by the check", "rollout/proposer/valid_share", ["selfplay", "selfplay_loose"]),
    ("solver failure rate on kept proposals", "rollout/proposer/difficulty", ["selfplay", "selfplay_loose"]),
]
NOISE_PANELS = [  # the perturbation study's training curves, docs/goal_reflect.png
    ("validation subEM (noise 0.3)", "val/subem_mean", NOISE_SETUPS),
    ("searches per trajectory", "rollout/calls/search", NOISE_SETUPS),
    ("reflections right (of searches)", "reward/reflect_right", NOISE_SETUPS),
]
AGENT_PANELS = [  # the OpenAI-API agent against the built-in one, docs/agents.png
    ("1-hop validation subEM", "val/toy_1hop/subem", ["search", "agent"]),
    ("2-hop validation subEM", "val/toy_2hop/subem", ["search", "agent"]),
    ("searches per trajectory", "rollout/calls/search", ["search", "agent"]),
]


def train(setups: list[str], root: Path, seeds: str, extra: list[str]) -> None:
    for name in setups:
        out = root / name
        if out.exists() and any(out.glob("*/metrics.yaml")):
            print(f"[{name}] runs already in {out}: skipped (delete the folder to train again)", flush=True)
            continue
        beside = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # this venv's, not activated
        executable = shutil.which("dspo-train", path=beside) or "dspo-train"
        cmd = [executable, "-m", f"seed={seeds}", *SETUPS[name], *extra, f"hydra.sweep.dir={out}"]
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))}
        subprocess.run(cmd, check=True, env=env)


def window_means(series, rounds: int = WINDOW) -> tuple[float, float]:
    values = series.dropna().tolist()
    if not values:
        return math.nan, math.nan
    return sum(values[:rounds]) / len(values[:rounds]), sum(values[-rounds:]) / len(values[-rounds:])


def run_numbers(run) -> dict[str, float]:
    from dspo.sweeps.analysis import load_scalars

    scalars = load_scalars(run.dir)
    by_tag = {tag: frame.sort_values("step").set_index("step")["value"] for tag, frame in scalars.groupby("tag")}
    numbers: dict[str, float] = {}
    for kind in TYPES:
        val = by_tag.get(f"val/{kind}/subem")
        if val is not None and len(val):
            numbers[f"val_{kind}_start"], numbers[f"val_{kind}_end"] = float(val.iloc[0]), float(val.iloc[-1])
        test = by_tag.get(f"test/{kind}/subem")
        if test is not None and len(test):
            numbers[f"test_{kind}"] = float(test.iloc[-1])
    numbers.update(test_episodes(run.dir))
    numbers.update(timeline_numbers(run.dir))
    for tag, series in by_tag.items():  # partial rollouts: each token age's share, over the run
        if tag.startswith("rollout/token_staleness/"):
            numbers[f"token_age_{tag.rsplit('/', 1)[1]}_share"] = float(series.mean())
    if "rollout/carried_dropped" in by_tag:
        numbers["carried_dropped_total"] = float(by_tag["rollout/carried_dropped"].sum())
    if "rollout/truncated_share" in by_tag:  # logged since the deep warm start's study
        numbers["truncated_start"], numbers["truncated_end"] = window_means(by_tag["rollout/truncated_share"])
    calls = [series for tag, series in by_tag.items() if tag.startswith("rollout/calls/")]
    if calls:
        numbers["searches_start"], numbers["searches_end"] = window_means(sum(calls))
    for tag in SIGNALS:
        if tag in by_tag:
            start, end = window_means(by_tag[tag])
            numbers[f"{tag}@start"], numbers[f"{tag}@end"] = start, end
    return numbers


def timeline_numbers(run_dir: Path) -> dict[str, float]:
    """From the run's timeline.jsonl (rollout.max_staleness >= 1): wall seconds from the first round's wait to the
    last round's end, and the trainer's total wait for rounds."""
    path = run_dir / "timeline.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return {}
    return {
        "train_wall_s": rows[-1]["trained"] - rows[0]["waiting"],
        "trainer_wait_total_s": sum(max(row["taken"] - row["waiting"], 0.0) for row in rows),
    }


def test_episodes(run_dir: Path) -> dict[str, float]:
    """Per test benchmark, from the run's greedy test predictions: searches per question and the share of episodes
    that ended for lack of turns or tokens (`truncated`)."""
    path = run_dir / "test" / "predictions.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    numbers = {}
    for kind in sorted({row["benchmark"] for row in rows}):
        mine = [row for row in rows if row["benchmark"] == kind]
        numbers[f"test_{kind}_searches"] = sum(row["num_tool_calls"] for row in mine) / len(mine)
        numbers[f"test_{kind}_truncated"] = sum(bool(row["truncated"]) for row in mine) / len(mine)
    return numbers


def report(root: Path, setups: list[str]) -> dict:
    from dspo.sweeps.analysis import find_runs
    from dspo.sweeps.report import ci95

    result: dict[str, dict] = {}
    for name in setups:
        try:
            runs = [r for r in find_runs(root / name) if (r.dir / "metrics.yaml").exists()]
        except FileNotFoundError:
            continue
        per_run = [run_numbers(r) for r in runs]
        keys = sorted({k for numbers in per_run for k in numbers})
        summary = {k: ci95([n.get(k, math.nan) for n in per_run]) for k in keys}
        seeds = [r.seed for r in runs]
        result[name] = {"overrides": SETUPS[name], "seeds": seeds, "runs": per_run, "mean_ci95": summary}
    return result


def print_report(result: dict) -> None:
    columns = [
        ("val 1-hop 0 -> end", "val_toy_1hop_start", "val_toy_1hop_end"),
        ("val 2-hop 0 -> end", "val_toy_2hop_start", "val_toy_2hop_end"),
        ("searches/traj first -> last 10 rounds", "searches_start", "searches_end"),
    ]
    if any("val_toy_3hop_end" in entry["mean_ci95"] for entry in result.values()):
        columns += [
            ("val 3-hop 0 -> end", "val_toy_3hop_start", "val_toy_3hop_end"),
            ("val 4-hop 0 -> end", "val_toy_4hop_start", "val_toy_4hop_end"),
        ]
    if any("truncated_end" in entry["mean_ci95"] for entry in result.values()):
        columns += [("out of turns/tokens first -> last 10 rounds", "truncated_start", "truncated_end")]
    print(f"{'setup':<22} {'n':>2}  " + "  ".join(f"{c[0]:<36}" for c in columns) + "  test 1-hop / 2-hop")
    for name, entry in result.items():
        s = entry["mean_ci95"]
        cells = []
        for _, a, b in columns:
            cells.append(f"{_pm(s.get(a))} -> {_pm(s.get(b))}".ljust(36))
        test = f"{_pm(s.get('test_toy_1hop'))} / {_pm(s.get('test_toy_2hop'))}"
        print(f"{name:<22} {len(entry['runs']):>2}  " + "  ".join(cells) + f"  {test}")
    for name, entry in result.items():
        s = entry["mean_ci95"]
        signals = [t for t in SIGNALS if f"{t}@start" in s]
        for tag in signals:
            print(f"{name:<22} {tag:<40} first 10 rounds {_pm(s[f'{tag}@start'])} -> last 10 {_pm(s[f'{tag}@end'])}")


def _pm(pair) -> str:
    if pair is None or math.isnan(pair[0]):
        return "-"
    mean, half = pair
    return f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}"


def plot(root: Path, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dspo.sweeps.analysis import curves, find_runs

    if set(result) <= set(DEEP_SETUPS):
        panels = DEEP_PANELS
    elif set(result) <= {"tight_end", "tight_compact"}:
        panels = TIGHT_PANELS
    elif set(result) <= set(PARTIAL_SETUPS):
        panels = PARTIAL_PANELS
    elif "selfplay" in result:
        panels = SELFPLAY_PANELS
    elif set(result) <= set(NOISE_SETUPS):
        panels = NOISE_PANELS
    else:
        panels = PANELS if set(result) - {"search", "agent"} else AGENT_PANELS
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (title, tag, names) in zip(axes, panels):
        for name in (n for n in names if n in result):
            frame = curves([r for r in find_runs(root / name)], tag)
            if frame.empty:
                continue
            n = int(frame["n"].max())
            color = COLORS.get(name, f"C{list(SETUPS).index(name) % 10}")  # one color per setup in every panel
            ax.plot(frame["step"], frame["mean"], color=color, label=f"{name} (n={n})")
            ax.fill_between(frame["step"], frame["min"], frame["max"], color=color, alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="store_true", help="train the setups first (skips a setup whose runs exist)")
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--seeds", default="0,1,2", help="the multirun's seed list (default 0,1,2)")
    parser.add_argument("--root", type=Path, default=Path("outputs") / "environments")
    parser.add_argument("--override", nargs="+", default=[], help="more dspo-train overrides for every run (smoke)")
    parser.add_argument("--figure", type=Path, default=None, help="the curves' figure (default: beside the JSON)")
    parser.add_argument(
        "--noise-eval",
        nargs="+",
        type=float,
        default=None,
        metavar="P",
        help="also score each run's model and its warm start greedily on the test split at these search noise levels "
        "(bench/_noise_eval.py; its figure beside the curves' figure, *_noise.png)",
    )
    add_output_arguments(parser, "environments.json")
    args = parser.parse_args(argv)
    out = output_path(parser, args, "environments.json")
    root = args.root.resolve()
    if args.run:
        train(args.setups, root, args.seeds, args.override)
    result = report(root, args.setups)
    if not result:
        sys.exit(f"no finished runs under {root}: train them with --run (see --help)")
    print_report(result)
    noise = {}
    if args.noise_eval:
        noisy = {name: SETUPS[name] for name in result if has_noise([*SETUPS[name], *args.override])}
        if not noisy:
            sys.exit(
                "--noise-eval: none of these setups has a noisy search tool (env.tools.search.noise: "
                f"env=simulated, env=goal_reflect), e.g. --setups {' '.join(NOISE_SETUPS)}"
            )
        noise = noise_eval(root, noisy, args.noise_eval, args.override)
        print_noise(noise)
        for name, entry in noise.items():
            result[name]["noise"] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"JSON: {out}")
    figure = args.figure or (ROOT / "docs" / "environments.png" if args.update_shipped else out.with_suffix(".png"))
    plot(root, result, figure)
    if noise:
        plot_noise(noise, figure.with_name(f"{figure.stem}_noise.png"))
    figures = {f"{name}.runs": entry["runs"] for name, entry in result.items()}
    if args.noise_eval:  # every setup with runs scored at every level, warm start and trained
        for name in noisy:
            means = noise.get(name, {}).get("mean_ci95") or {"-": {"subem": (None,)}}
            figures.update({f"{name}.noise.{p}.{k}": v[0] for p, row in means.items() for k, v in row.items()})
    for name, entry in result.items():  # 1- and 2-hop in every setup; 3- and 4-hop where the setup has them
        kinds = [k for k in TYPES if k in TYPES[:2] or "experiment=toy_deep" in SETUPS[name]]
        keys = [f"{stage}_{kind}{end}" for kind in kinds for stage, end in (("val", "_end"), ("test", ""))]
        figures.update({f"{name}.{k}": entry["mean_ci95"].get(k, (None,))[0] for k in keys})
    require_measured("environments", figures, hint="each setup's runs must have finished (validation and test)")


if __name__ == "__main__":
    main()
