"""Rebuild the shipped warm start (`data/toy_warmstart/`) from scratch, and measure what a warm start can do.

    python -m dspo.toy.rebuild                       # world + tokenizer + SFT in a temp folder, measure, write to
                                                     # outputs/toy_warmstart (in the working directory)
    python -m dspo.toy.rebuild --output DIR          # write to DIR (the tests rebuild into a temp folder)
    python -m dspo.toy.rebuild --update-shipped      # replace the repository's data/toy_warmstart (what configs adopt)
    python -m dspo.toy.rebuild --report MODEL_DIR    # only measure a model folder (shipped or rebuilt)
    python -m dspo.toy.rebuild -- prepare.toyworld.config.steps=2000   # Hydra overrides of the train config

It composes the train config (so the world, vocabulary, warm-start recipe and agent settings are the ones
`dspo-train` uses), builds everything with `shipped=None`, measures the model and writes `tokenizer/`, `model/` and
`report.json` to the output; only `--update-shipped` writes over the tracked `data/toy_warmstart/`. The report holds,
per question type (1-hop, 2-hop):
- `train_sampled`: the share of sampled trajectories that answer *training* questions (entities the warm start never
  saw) at the RL temperature, G per question: the rate at which RL's groups will be mixed;
- `val_greedy`: greedy subEM on the validation questions (what step 0 of a run's validation logs);
- `train_2hop_outcomes`: where the sampled 2-hop rollouts go (`two_hop_outcome`), as shares.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from dspo.resources import data_dir

if TYPE_CHECKING:  # heavy imports stay inside the functions that need them (start-up of --help)
    from dspo.types import Trajectory

SHIPPED = "toy_warmstart"
DEFAULT_OUTPUT = Path("outputs") / SHIPPED  # the user's outputs/, like dspo-train's; never the tracked data/ by default


def compose_train(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from dspo.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=["output_dir=/tmp", *overrides])


def rebuild(workdir: str, overrides: list[str]) -> tuple[object, str]:
    """Build world, tokenizer and warm start under `workdir` without adopting anything shipped; (world, model dir)."""
    from hydra.utils import instantiate

    cfg = compose_train([f"paths.toy_root={workdir}", "prepare.toyworld.shipped=null", *overrides])
    return instantiate(cfg.prepare.toyworld)


TWO_HOP_OUTCOMES = (
    "no_search", "one_search_answered_intermediate", "one_search_other", "two_searches_right", "two_searches_wrong",
)  # fmt: skip


def two_hop_outcome(trajectory: Trajectory, intermediate: str) -> str:
    """Which of TWO_HOP_OUTCOMES a 2-hop rollout is: how many searches it made, and for one search, whether it answered
    the intermediate entity (`intermediate`, the name the first hop leads to: what a model that stops early answers)."""
    if trajectory.num_tool_calls == 0:
        return "no_search"
    if trajectory.num_tool_calls == 1:
        stopped_early = trajectory.answer is not None and trajectory.answer.strip() == intermediate
        return "one_search_answered_intermediate" if stopped_early else "one_search_other"
    return "two_searches_right" if trajectory.reward > 0 else "two_searches_wrong"


def build_world(workdir: str, overrides: list[str]):
    """Only the toy world of the train config, under `workdir/world` (what `--report` needs: no tokenizer, no SFT)."""
    from hydra.utils import instantiate

    from dspo.toy.world import build_toyworld

    cfg = compose_train([f"paths.toy_root={workdir}", *overrides])
    return build_toyworld(str(Path(workdir) / "world"), instantiate(cfg.prepare.toyworld.world_config))


def measure(model_dir: str, world, overrides: list[str], questions: int = 200, group_size: int = 5) -> dict:
    """Per question type: sampled success on `questions` train questions (G=`group_size`, the RL temperature, vLLM)
    and greedy subEM on the validation questions. Deterministic for a given machine (seeded engine)."""
    from hydra.utils import instantiate

    from dspo.agent import build_agent
    from dspo.data.qa import load_qa
    from dspo.toy.tokenizer import load_tokenizer

    cfg = compose_train([f"paths.toy_root={Path(world.root).parent}", *overrides])
    env = instantiate(cfg.env)  # the run's environment over this world (its retriever group's index)
    engine = instantiate(cfg.rollout.engine)(model_path=model_dir)
    agent = build_agent(instantiate(cfg.rollout.agent), engine=engine, tokenizer=load_tokenizer(model_dir), env=env)
    report: dict[str, dict[str, float]] = {"train_sampled": {}, "val_greedy": {}, "train_mixed_groups": {}}
    train = load_qa(world.train, benchmark="toy", limit=questions)
    rewards, mixed, outcomes = defaultdict(list), defaultdict(list), []
    for group in agent.rollout(train, group_size=group_size, policy_version=0, seed=1234).groups:
        values = [t.reward for t in group.trajectories]
        rewards[group.item.metadata["hops"]] += values
        mixed[group.item.metadata["hops"]].append(0 < sum(values) < len(values))
        if group.item.metadata["hops"] == 2:
            outcomes += [two_hop_outcome(t, group.item.metadata["chain"][1]) for t in group.trajectories]
    val = load_qa(world.val, benchmark="toy")
    greedy = defaultdict(list)
    for group in agent.rollout(val, group_size=1, policy_version=0, greedy=True).groups:
        greedy[group.item.metadata["hops"]].append(group.trajectories[0].reward)
    for hops in sorted(rewards):
        report["train_sampled"][f"{hops}hop"] = round(sum(rewards[hops]) / len(rewards[hops]), 4)
        report["train_mixed_groups"][f"{hops}hop"] = round(sum(mixed[hops]) / len(mixed[hops]), 4)
        report["val_greedy"][f"{hops}hop"] = round(sum(greedy[hops]) / len(greedy[hops]), 4)
    if outcomes:
        report["train_2hop_outcomes"] = {k: round(outcomes.count(k) / len(outcomes), 4) for k in TWO_HOP_OUTCOMES}
    report["settings"] = {"train_questions": len(train), "group_size": group_size, "val_questions": len(val)}
    return report


def ship(workdir: str, output: Path, report: dict) -> None:
    output.mkdir(parents=True, exist_ok=True)
    for part in ("tokenizer", "model"):
        if (output / part).exists():
            shutil.rmtree(output / part)
        shutil.copytree(Path(workdir) / part, output / part)
    (output / "report.json").write_text(json.dumps(report, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `output` resolved: `--output`, else data/toy_warmstart for `--update-shipped`, else
    outputs/toy_warmstart."""
    parser = argparse.ArgumentParser(prog="python -m dspo.toy.rebuild", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output", default=None, help=f"where tokenizer/, model/, report.json go (default: {DEFAULT_OUTPUT})"
    )
    parser.add_argument(
        "--update-shipped", action="store_true", help=f"write the repository's {data_dir() / SHIPPED} instead"
    )
    parser.add_argument("--workdir", default=None, help="build folder (default: a temporary one)")
    parser.add_argument("--report", metavar="MODEL_DIR", default=None, help="only measure this model; print JSON")
    parser.add_argument("--questions", type=int, default=200, help="train questions sampled for the report")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the train config (after --)")
    args = parser.parse_args(argv)
    if args.update_shipped and args.output is not None:
        parser.error("--output and --update-shipped both name the output; give one")
    args.output = str(data_dir() / SHIPPED) if args.update_shipped else args.output or str(DEFAULT_OUTPUT)
    if args.report is not None and not (Path(args.report) / "config.json").is_file():
        parser.error(f"--report {args.report}: not a model folder (no config.json)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import dspo  # noqa: F401  registers the config resolvers
    from dspo.console import quiet_console

    quiet_console()

    workdir = args.workdir or tempfile.mkdtemp(prefix="dspo_toy_rebuild_")
    if args.report is not None:
        world = build_world(workdir, args.overrides)
        print(json.dumps(measure(args.report, world, args.overrides, args.questions), indent=2))
        return
    start = time.perf_counter()
    world, model_dir = rebuild(workdir, args.overrides)
    report = measure(model_dir, world, args.overrides, args.questions)
    report["build_seconds"] = round(time.perf_counter() - start, 1)
    ship(workdir, Path(args.output), report)
    print(json.dumps(report, indent=2))
    if args.update_shipped:
        print(f"shipped to {args.output}")
    else:  # the default config adopts only data/toy_warmstart (prepare.toyworld.shipped)
        print(f"wrote {args.output}; to use it: prepare.toyworld.shipped={Path(args.output).absolute()}")


if __name__ == "__main__":
    main()
