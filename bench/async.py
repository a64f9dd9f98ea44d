"""Rollouts ahead of training (issue 28): step time, tokens/s and each side's idle time at rollout.max_staleness
0, 1 and 2, with the overlap bound measured in the same run.

    .venv/bin/python bench/async.py                        # toy default and the 151k-vocabulary model, k = 0, 1, 2
    .venv/bin/python bench/async.py --workloads toy --rounds 4 --warmup-rounds 1   # shorter
    .venv/bin/python bench/async.py --workloads toy --staleness 0 --rounds 3 --warmup-rounds 1 \
        --override rollout=hf algorithm.group_size=2 algorithm.batch_groups=2      # smoke (the suite's, ~1 min)
    .venv/bin/python bench/async.py --staleness 1 --engine-cores split --transfers shared_memory gloo \
        --out outputs/bench/transfer.json                  # weights over shared memory vs a gloo group
    .venv/bin/python bench/async.py --update-shipped       # rewrite bench/results/async.json (the README's numbers)

Each configuration is one `dspo-train` process (validation, checkpoints and the test pass off), one after the other,
never two at once (two CPU-heavy processes slow each other several-fold here). Times come from the TensorBoard event
wall times of `train/loss`: step time = (wall time of the last step - that of the last warm-up step) / timed steps;
tokens/s = tokens sampled in the timed rounds (filtered groups included) / that time.

Idle time per timed round: k >= 1 logs it (`rollout/trainer_wait_s`: the trainer waiting for a round;
`rollout/producer_idle_s`: the engine process waiting for weights). At k = 0 the two sides take turns: the trainer idles
for the generation (`rollout/time_s`), the engine for the rest of the round.

Bound: the best overlap can do with the cores split as k >= 1 splits them (`dspo.rollout.placement.split_cores`) is
max(generation alone on the engine's cores, the rest of the round alone on the trainer's cores). Both are measured by
k = 0 runs pinned (taskset + DSPO_NUM_THREADS) to each share: generation = median `rollout/time_s`, the rest = median
round time - generation. With equal shares one pinned run gives both. Where the engine has its own device (a GPU box)
the bound is max(generation, update) without the split; bench/README.md writes that case down from these phases.

Workloads: `toy` = the default (`dspo-train` with no arguments: toy world, tiny model, warm start, G=5, B=8, M=2);
`qwen` = bench/vs_trl.py's scripted model (2 layers, hidden 128, Qwen2.5's 151k vocabulary) on its yes/no questions,
single-turn, B=4 x G=5, 96 new tokens, M=1: a round of that size with a 151k-row head on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance

ROOT = Path(__file__).resolve().parents[1]
QUIET = [
    "run_test=false", "trainer.limit_val_batches=0", "~callbacks.validate_at_start", "~callbacks.checkpoint",
    "~callbacks.best", "~callbacks.progress", "callbacks.rollout.sample_every_n_rounds=0",
]  # fmt: skip


def toy_overrides(rounds: int) -> tuple[list[str], int]:
    return [*QUIET, f"trainer.max_steps={2 * rounds}"], 2  # the default's M = 2 steps per round


def qwen_overrides(rounds: int, work: Path) -> tuple[list[str], int]:
    sys.path.insert(0, str(ROOT / "bench"))
    import vs_trl

    args = vs_trl.parse_args(["--warmup", "1", "--steps", str(rounds - 1)])
    model, rows, _ = vs_trl.resolve_workload(args, work)
    vs_trl.prepare_work(work, rows)
    drop = ("logger=", "output_dir=", "+callbacks.rollout.export_dir", "trainer.enable_progress_bar")
    overrides = [o for o in vs_trl.dspo_spec(args, work, model, True, 0)["overrides"] if not o.startswith(drop)]
    return [*overrides, "~callbacks.validate_at_start"], 1


def run(overrides: list[str], out: Path, cores: list[int] | None, threads: int | None, timeout: float) -> Path:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [str(Path(sys.executable).parent / "dspo-train"), *overrides, f"hydra.run.dir={out}"]
    if cores is not None:
        command = ["taskset", "-c", ",".join(map(str, cores)), *command]
        env["DSPO_NUM_THREADS"] = str(threads or len(cores))
    started = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False)
    if done.returncode:
        tail = out.with_suffix(".log").read_text()[-3000:]
        require_measured("async", {}, {f"{' '.join(command)} (exit {done.returncode})": tail})
    print(f"  {out.name}: {time.perf_counter() - started:.0f} s", flush=True)
    return out


def per_round(series: list[tuple[int, float, float]], steps_per_round: int) -> dict[int, float]:
    """Round statistics are logged at every step of their round (steps count from 0): one value per round."""
    values: dict[int, float] = {}
    for step, _, value in sorted(series):
        values.setdefault(step // steps_per_round, value)
    return values


def summarize(run_dir: Path, steps_per_round: int, warmup_rounds: int, k: int) -> dict[str, float]:
    from dspo.sweeps.analysis import scalar_wall_times

    data = scalar_wall_times(run_dir)
    walls = {step: wall for step, wall, _ in data["train/loss"]}
    first, last = warmup_rounds * steps_per_round - 1, max(walls)  # the last warm-up step; logged as it ends
    seconds = walls[last] - walls[first]
    timed = range(warmup_rounds, last // steps_per_round + 1)  # rounds whose steps all lie in the timed window
    pick = lambda tag: [v for r, v in per_round(data.get(tag, []), steps_per_round).items() if r in timed]  # noqa: E731
    generation, tokens = pick("rollout/time_s"), pick("rollout/generated_tokens")
    step_s = seconds / (last - first)
    round_s = step_s * steps_per_round
    if k:
        trainer_idle, engine_idle = (
            statistics.mean(pick("rollout/trainer_wait_s")),
            statistics.mean(pick("rollout/producer_idle_s")),
        )
    else:
        trainer_idle, engine_idle = statistics.mean(generation), round_s - statistics.mean(generation)
    return {
        "step_s": step_s,
        "round_s": round_s,
        "tokens_per_s": statistics.mean(tokens) / round_s,
        "generation_s": statistics.median(generation),
        "trainer_idle_s_per_round": trainer_idle,
        "engine_idle_s_per_round": engine_idle,
        "staleness_mean": statistics.mean(pick("rollout/staleness_mean") or [0.0]),
        "timed_steps": last - first,
    }


def measure(name: str, overrides: list[str], spr: int, args: argparse.Namespace, work: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from dspo.rollout.placement import split_cores

    available = sorted(os.sched_getaffinity(0))
    trainer_cores, engine_cores = split_cores(None, available)
    result: dict = {"steps_per_round": spr, "cores": available, "trainer_cores": trainer_cores}
    result["engine_cores"] = engine_cores
    for k in args.staleness:
        for mode in args.engine_cores if k else ["split"]:
            for transfer in args.transfers if k else ["shared_memory"]:
                key = (
                    f"k{k}"
                    + (f"_{mode}" if mode != "split" else "")
                    + (f"_{transfer}" if transfer != "shared_memory" else "")
                )
                settings = [f"rollout.max_staleness={k}", f"rollout.engine_cores={mode}"]
                settings.append(f"rollout.weight_transfer={transfer}")
                out = run([*overrides, *settings], work / f"{name}_{key}", None, None, args.timeout_s)
                result[key] = summarize(out, spr, args.warmup_rounds, k)
    pinned = {"engine": engine_cores, "trainer": trainer_cores}
    shares = {"engine": None, "trainer": None}
    for side, cores in pinned.items():
        if side == "trainer" and len(trainer_cores) == len(engine_cores):  # equal shares: one pinned run gives both
            shares["trainer"] = shares["engine"]
            continue
        out = run([*overrides, "rollout.max_staleness=0"], work / f"{name}_alone_{side}", cores, None, args.timeout_s)
        shares[side] = summarize(out, spr, args.warmup_rounds, 0)
    generation = shares["engine"]["generation_s"]
    update = shares["trainer"]["round_s"] - shares["trainer"]["generation_s"]
    result["alone"] = {"generation_s": generation, "update_s": update, "bound_round_s": max(generation, update)}
    result["alone"]["bound_step_s"] = result["alone"]["bound_round_s"] / spr
    return result


def report(results: dict) -> dict:
    toy = results["workloads"].get("toy")
    if toy and "k0" in toy and "k1" in toy:
        sync, fast, bound = toy["k0"]["step_s"], toy["k1"]["step_s"], toy["alone"]["bound_step_s"]
        results.update({"sync_step_s": sync, "async_step_s": fast, "bound_step_s": bound, "ratio": fast / sync})
        results["vs_bound"] = fast / bound
    return results


def print_table(results: dict) -> None:
    header = "| workload | k (engine cores) | step (s) | round (s) | tokens/s | trainer idle / round (s) |"
    print(f"\n{header} engine idle / round (s) |")
    print("|---|---|---|---|---|---|---|")
    for name, result in results["workloads"].items():
        for key in sorted(k for k in result if k.startswith("k") and k[1].isdigit()):
            r = result[key]
            print(
                f"| {name} | {key[1:].replace('_', ' ')} | {r['step_s']:.2f} | {r['round_s']:.2f} | "
                f"{r['tokens_per_s']:.0f} | {r['trainer_idle_s_per_round']:.2f} | {r['engine_idle_s_per_round']:.2f} |"
            )
        alone = result["alone"]
        print(
            f"| {name} | bound | {alone['bound_step_s']:.2f} | {alone['bound_round_s']:.2f} | | generation alone "
            f"{alone['generation_s']:.2f} s on cores {result['engine_cores']} | update alone {alone['update_s']:.2f} "
            f"s on cores {result['trainer_cores']} |"
        )
    if "ratio" in results:
        print(f"\ntoy k=1 / k=0 = {results['ratio']:.3f}; k=1 / bound = {results['vs_bound']:.3f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["toy", "qwen"], choices=["toy", "qwen"])
    parser.add_argument("--staleness", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--engine-cores", nargs="+", default=["split", "shared"], choices=["split", "shared"],
        help="rollout.engine_cores of the k >= 1 runs (each is one run)",
    )  # fmt: skip
    parser.add_argument(
        "--transfers", nargs="+", default=["shared_memory"], choices=["shared_memory", "gloo"],
        help="rollout.weight_transfer of the k >= 1 runs (each is one run; keys k1_gloo, ...)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=10, help="rounds per run, warm-up included")
    parser.add_argument("--warmup-rounds", type=int, default=2, help="untimed rounds at the start of each run")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per dspo-train process")
    parser.add_argument("--keep-work", action="store_true", help="keep the run directories (logs, TensorBoard)")
    parser.add_argument("--override", nargs="+", default=[], help="more dspo-train overrides for every run (smoke)")
    add_output_arguments(parser, "async.json")
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "async.json")
    if args.rounds <= args.warmup_rounds + 1:
        parser.error("--rounds must exceed --warmup-rounds + 1 (at least two timed rounds)")
    return args


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="dspo-async-"))
    results: dict = {"measured": provenance(), "args": {k: str(v) for k, v in vars(args).items()}, "workloads": {}}
    for name in args.workloads:
        print(f"{name}:", flush=True)
        overrides, spr = toy_overrides(args.rounds) if name == "toy" else qwen_overrides(args.rounds, work)
        overrides = [*overrides, *args.override]
        results["workloads"][name] = measure(name, overrides, spr, args, work)
    report(results)
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {args.out}" + (f"; runs kept in {work}" if args.keep_work else ""))
    if not args.keep_work:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    keys = ("step_s", "round_s", "tokens_per_s", "generation_s", "bound_step_s", "timed_steps")
    figures = {
        f"{name}.{key}.{k}": value
        for name, result in results["workloads"].items()
        for key, run in result.items()
        if isinstance(run, dict)
        for k, value in run.items()
        if k in keys
    }
    require_measured("async", {**figures, **{k: results[k] for k in ("ratio", "vs_bound") if k in results}})


if __name__ == "__main__":
    main()
