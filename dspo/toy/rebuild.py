"""Rebuild the shipped warm start (`data/toy_warmstart/`) from scratch, and measure what a warm start can do.

    python -m dspo.toy.rebuild                       # world + tokenizer + SFT in a temp folder, measure, write to
                                                     # outputs/toy_warmstart (in the working directory)
    python -m dspo.toy.rebuild --output DIR          # write to DIR (the tests rebuild into a temp folder)
    python -m dspo.toy.rebuild --update-shipped      # replace the repository's data/toy_warmstart (what configs adopt)
    python -m dspo.toy.rebuild --report MODEL_DIR    # only measure a model folder (shipped or rebuilt)
    python -m dspo.toy.rebuild -- prepare.toyworld.config.steps=2000   # Hydra overrides of the train config
    python -m dspo.toy.rebuild --update-shipped -- experiment=toy_deep  # the deep warm start, data/toy_deep_warmstart
    python -m dspo.toy.rebuild --update-shipped -- env=goal_reflect     # data/toy_goal_reflect_warmstart

It composes the train config (so the world, vocabulary, warm-start recipe and agent settings are the ones
`dspo-train` uses), builds everything with `shipped=None`, measures the model and writes `tokenizer/`, `model/` and
`report.json` to the output; only `--update-shipped` writes over the tracked `data/toy_warmstart/`. The report holds,
per question type (1-hop, 2-hop):
- `train_sampled`: the share of sampled trajectories that answer *training* questions (entities the warm start never
  saw) at the RL temperature, G per question: the rate at which RL's groups will be mixed;
- `val_greedy`: greedy subEM on the validation questions (what step 0 of a run's validation logs);
- `train_2hop_outcomes`: where the sampled 2-hop rollouts go (`two_hop_outcome`), as shares;
- `train_signals` (environments that pay reward parts, env=goal_reflect): the sampled round's `reward/*` parts and
  searches per trajectory (`calls/*`).
Shares count outcomes (0/1 correctness, what the dynamic filter tests), not rewards: an environment that pays more
than the answer (env=goal_reflect's reflections) scores the same answers the same.

A config whose `prepare.toyworld.shipped_model` names a model folder (experiment=toy_deep: a fine-tune of the shipped
model on 3- and 4-hop demonstrations too, conf/prepare/toyworld_deep.yaml) rebuilds that model only: the tokenizer is
the shipped one (adopted as `dspo-train` adopts it), and `--update-shipped` writes `model/` and `report.json` to the
folder above `shipped_model` (data/toy_deep_warmstart). Its report measures per chain length (1- to 4-hop) what the
run's data config names (train_deep.jsonl, toy_1hop ... toy_4hop): sampled success and mixed groups on train questions,
greedy subEM on validation and test, searches per question and the share of episodes that ran out of turns or tokens.
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

from dspo.cachedir import staged_folder, write_atomically
from dspo.process.resources import data_dir

if TYPE_CHECKING:  # heavy imports stay inside the functions that need them (start-up of --help)
    from dspo.types import Trajectory

SHIPPED = "toy_warmstart"
DEFAULT_OUTPUT = Path("outputs") / SHIPPED  # the user's outputs/, like dspo-train's; never the tracked data/ by default


def compose_train(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from dspo.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=["output_dir=/tmp", *overrides])


def shipped_target(overrides: list[str]) -> tuple[Path, tuple[str, ...]]:
    """(the shipped folder the config adopts, the parts it holds): data/toy_warmstart with tokenizer/ and model/, or
    the folder above `prepare.toyworld.shipped_model` with model/ only (its tokenizer is data/toy_warmstart's)."""
    toyworld = compose_train(overrides).prepare.get("toyworld")
    if toyworld is None:
        raise ValueError(f"python -m dspo.toy.rebuild: the train config with {overrides} has no prepare.toyworld")
    model = toyworld.get("shipped_model")
    if model is None:
        return data_dir() / SHIPPED, ("tokenizer", "model")
    if Path(model).name != "model":
        raise ValueError(f"prepare.toyworld.shipped_model must be a folder named model, got {model}")
    return Path(model).parent, ("model",)


def rebuild(workdir: str, overrides: list[str]) -> tuple[object, str]:
    """Build world, tokenizer and warm start under `workdir` without adopting the model shipped; (world, model dir).
    A config with `shipped_model` adopts the shipped tokenizer (the one its model was fine-tuned with)."""
    from hydra.utils import instantiate

    _, parts = shipped_target(overrides)
    unship = "prepare.toyworld.shipped=null" if "tokenizer" in parts else "prepare.toyworld.shipped_model=null"
    cfg = compose_train([f"paths.toy_root={workdir}", unship, *overrides])
    return instantiate(cfg.prepare.toyworld)


# the sampled round's statistics a report keeps when its environment pays reward parts: searches and the parts
SIGNAL_PREFIXES = ("reward/", "calls/")
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
    return "two_searches_right" if trajectory.outcome > 0 else "two_searches_wrong"


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
    from dspo.env.build import build_environment
    from dspo.toy.tokenizer import load_tokenizer

    cfg = compose_train([f"paths.toy_root={Path(world.root).parent}", *overrides])
    env = build_environment(cfg.env)  # the run's environment over this world (its retriever group's index)
    engine = instantiate(cfg.rollout.engine)(model_path=model_dir)
    agent = build_agent(instantiate(cfg.rollout.agent), engine=engine, tokenizer=load_tokenizer(model_dir), env=env)
    if "toy_3hop" in cfg.data.val_files:
        return measure_deep(agent, cfg.data, questions, group_size)
    if hasattr(agent, "roles"):  # experiment=toy_selfplay: the solver as the default's, and the proposer
        return measure_selfplay(agent, world, cfg.data, questions, group_size)
    return measure_default(agent, world, questions, group_size)


def measure_default(agent, world, questions: int = 200, group_size: int = 5) -> dict:
    """The default's measures (`measure`) of `agent`."""
    from dspo.data.qa import load_qa

    report: dict[str, dict[str, float]] = {"train_sampled": {}, "val_greedy": {}, "train_mixed_groups": {}}
    train = load_qa(world.train, benchmark="toy", limit=questions)
    rewards, mixed, outcomes = defaultdict(list), defaultdict(list), []
    sampled = agent.rollout(train, group_size=group_size, policy_version=0, seed=1234)
    for group in sampled.groups:
        values = [t.outcome for t in group.trajectories]
        rewards[group.item.metadata["hops"]] += values
        mixed[group.item.metadata["hops"]].append(0 < sum(values) < len(values))
        if group.item.metadata["hops"] == 2:
            outcomes += [two_hop_outcome(t, group.item.metadata["chain"][1]) for t in group.trajectories]
    val = load_qa(world.val, benchmark="toy")
    greedy = defaultdict(list)
    for group in agent.rollout(val, group_size=1, policy_version=0, greedy=True).groups:
        greedy[group.item.metadata["hops"]].append(group.trajectories[0].outcome)
    for hops in sorted(rewards):
        report["train_sampled"][f"{hops}hop"] = round(sum(rewards[hops]) / len(rewards[hops]), 4)
        report["train_mixed_groups"][f"{hops}hop"] = round(sum(mixed[hops]) / len(mixed[hops]), 4)
        report["val_greedy"][f"{hops}hop"] = round(sum(greedy[hops]) / len(greedy[hops]), 4)
    signals = {k: round(float(v), 4) for k, v in sorted(sampled.stats.items()) if k.startswith(SIGNAL_PREFIXES)}
    if any(k.startswith("reward/") for k in signals):  # an environment with reward parts (env=goal_reflect's)
        report["train_signals"] = signals
    if outcomes:
        report["train_2hop_outcomes"] = {k: round(outcomes.count(k) / len(outcomes), 4) for k in TWO_HOP_OUTCOMES}
    report["settings"] = {"train_questions": len(train), "group_size": group_size, "val_questions": len(val)}
    return report


def measure_selfplay(agent, world, data, questions: int = 200, group_size: int = 5) -> dict:
    """experiment=toy_selfplay's measures: the solver's as the default's (sampled success on train questions, greedy
    validation), and one self-play call on `questions` topics (G=`group_size`): the proposer's statistics (proposals
    written, refused by reason, kept, the solver's failure rate on the kept ones, searches per proposer episode)."""
    from dspo.data.qa import load_qa

    report: dict = measure_default(agent.answerer, world, questions, group_size)
    topics = load_qa(data.train_files[0], benchmark="selfplay", limit=questions)
    result = agent.rollout(topics, group_size=group_size, policy_version=0, seed=1234)
    report["proposer"] = {
        key.removeprefix("proposer/"): round(float(value), 4)
        for key, value in sorted(result.stats.items())
        if key.startswith("proposer/")
    }
    report["settings"]["topics"] = len(topics)
    return report


def measure_deep(agent, data, questions: int = 200, group_size: int = 5) -> dict:
    """experiment=toy_deep's measures, per chain length: sampled success, mixed groups and searches on up to
    `questions` / 2 train questions of each length (train_deep.jsonl, G=`group_size`, the RL temperature), and greedy
    subEM, searches and the share out of turns or tokens on the validation and test benchmarks (toy_1hop ... toy_4hop,
    `data.val_limit` / `data.test_limit` each: what a run's step-0 validation and a test of the warm start log)."""
    from dspo.data.qa import load_qa

    train = load_qa(data.train_files[0], benchmark="toy")
    per_length = max(1, questions // 2)
    picked = [item for hops in (1, 2, 3, 4) for item in [i for i in train if i.metadata["hops"] == hops][:per_length]]
    report: dict[str, dict] = {key: {} for key in ("train_sampled", "train_mixed_groups", "train_searches")}
    by_hops = defaultdict(list)
    for group in agent.rollout(picked, group_size=group_size, policy_version=0, seed=1234).groups:
        by_hops[group.item.metadata["hops"]].append(group.trajectories)
    for hops, groups in sorted(by_hops.items()):
        flat = [t for group in groups for t in group]
        report["train_sampled"][f"{hops}hop"] = round(sum(t.outcome for t in flat) / len(flat), 4)
        mixed = [0 < sum(t.outcome for t in group) < len(group) for group in groups]
        report["train_mixed_groups"][f"{hops}hop"] = round(sum(mixed) / len(mixed), 4)
        report["train_searches"][f"{hops}hop"] = round(sum(t.num_tool_calls for t in flat) / len(flat), 4)
    for stage, files, limit in (("val", data.val_files, data.val_limit), ("test", data.test_files, data.test_limit)):
        report |= greedy_benchmarks(agent, stage, files, limit)
    report["settings"] = {"train_questions": len(picked), "group_size": group_size}
    return report


def greedy_benchmarks(agent, stage: str, files, limit: int | None) -> dict[str, dict[str, float]]:
    """Greedy subEM, searches per question and the share of episodes that ended for lack of turns or tokens, per
    benchmark of `files` ({name: path}); keys `<stage>_greedy`, `<stage>_searches`, `<stage>_truncated`."""
    from dspo.data.qa import load_qa

    report: dict[str, dict[str, float]] = {f"{stage}_{key}": {} for key in ("greedy", "searches", "truncated")}
    for name, path in files.items():
        items = load_qa(path, benchmark=name, limit=limit)
        runs = [g.trajectories[0] for g in agent.rollout(items, group_size=1, policy_version=0, greedy=True).groups]
        hops = name.removeprefix("toy_")
        report[f"{stage}_greedy"][hops] = round(sum(t.outcome for t in runs) / len(runs), 4)
        report[f"{stage}_searches"][hops] = round(sum(t.num_tool_calls for t in runs) / len(runs), 4)
        report[f"{stage}_truncated"][hops] = round(sum(t.truncated for t in runs) / len(runs), 4)
    return report


def ship(workdir: str, output: Path, report: dict, parts: tuple[str, ...] = ("tokenizer", "model")) -> None:
    """Copy the built `parts` to `output`, each swapped in whole (dspo.cachedir): a run adopting the shipped folders
    meanwhile (dspo.toy.shipped) copies the old ones or the new ones, never a folder that is missing or half copied."""
    output.mkdir(parents=True, exist_ok=True)
    for part in parts:
        with staged_folder(output / part) as staging:
            shutil.copytree(Path(workdir) / part, staging, dirs_exist_ok=True)
    write_atomically(output / "report.json", json.dumps(report, indent=2) + "\n")


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
    shipped, args.parts = shipped_target(args.overrides)
    default = DEFAULT_OUTPUT if shipped.name == SHIPPED else Path("outputs") / shipped.name
    args.output = str(shipped) if args.update_shipped else args.output or str(default)
    if args.report is not None and not (Path(args.report) / "config.json").is_file():
        parser.error(f"--report {args.report}: not a model folder (no config.json)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import dspo  # noqa: F401  registers the config resolvers
    from dspo.process.console import quiet_console

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
    ship(workdir, Path(args.output), report, args.parts)
    print(json.dumps(report, indent=2))
    if args.update_shipped:
        print(f"shipped to {args.output}")
    elif "tokenizer" in args.parts:  # the default config adopts only data/toy_warmstart (prepare.toyworld.shipped)
        print(f"wrote {args.output}; to use it: prepare.toyworld.shipped={Path(args.output).absolute()}")
    else:
        print(f"wrote {args.output}; to use it: prepare.toyworld.shipped_model={Path(args.output).absolute()}/model")


if __name__ == "__main__":
    main()
