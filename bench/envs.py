"""What each adapter of another standard's environment costs per call, against the built-in loop and the plain
`openai` client agent of docs/examples (env=agent), on one scripted workload
(docs/environments.md#environments-from-elsewhere).

    python bench/envs.py                                   # 4 questions x G=4, 3 repeats
    python bench/envs.py --questions 2 --group-size 2 --repeats 1   # smoke

The engine is scripted (a search, then the answer once a result is in the prompt, as bench/frameworks.py), so a
round's time is the loop, the endpoint, the adapter and the foreign environment's own machinery: the OpenEnv adapter
opens a WebSocket session per episode on a locally served OpenEnv environment (tests/env/openenv_toy.py); the
verifiers adapter runs the episode through verifiers' interception server and serves the task's toolset as an MCP
server in its own process per episode (tests/env/verifiers_envs/vf_toy_search.py; `verifiers_single` is
vf_toy_single.py, without a tool, so its episodes end after 1 call; `verifiers_shared` serves the toolset once for the
taskset instead of once per episode). The others make 2 calls an episode.
Needs the `envs` extra. JSON: `outputs/bench/envs.json` (or `--out`); `--update-shipped` writes bench/results/envs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance
from frameworks import OnePassage  # the same one-passage retriever as the frameworks table

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ("builtin", "openai_agent", "openenv", "verifiers_single", "verifiers", "verifiers_shared")
CALL = "<think>I should search.</think>\n<search> {entity} </search>"
ANSWER = "<think>Found it.</think>\n<answer> {answer} </answer>"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapters", nargs="+", choices=ADAPTERS, default=list(ADAPTERS))
    add_output_arguments(parser, "envs.json")
    args = parser.parse_args(argv)
    if args.questions < 1 or args.group_size < 1 or args.repeats < 1:
        parser.error("--questions, --group-size and --repeats must be >= 1")
    args.out = output_path(parser, args, "envs.json")
    return args


def script(prompt: str, turn: int, index: int) -> str:
    entity = prompt.split("Where was ")[-1].split(" born?")[0]
    searched = "(Title: " in prompt or "Doc 1" in prompt
    return ANSWER.format(answer=f"City{entity[-1]}") if searched else CALL.format(entity=entity)


def questions(n: int) -> list[dict]:
    return [{"question": f"Where was Person{i} born?", "golden_answers": [f"City{i % 10}"]} for i in range(n)]


def build(name: str, n: int, stack) -> tuple:
    """(the environment, the items) of one adapter on the workload."""
    from dspo.env import Environment, SearchTool, SubEMReward
    from dspo.types import QAItem

    items = [
        QAItem(id=str(i), question=q["question"], golden_answers=q["golden_answers"])
        for i, q in enumerate(questions(n))
    ]
    tool = SearchTool(OnePassage(), topk=1)
    if name == "builtin":
        return Environment({"search": tool}, SubEMReward()), items
    if name == "openai_agent":
        import openai_agent

        return Environment({"search": tool}, SubEMReward(), agent=openai_agent.agent), items
    if name == "openenv":
        from dspo.env.openenv import openenv_environment
        from tests.env.openenv_toy import serve

        url, _ = stack.enter_context(serve(tool))
        return openenv_environment(url), items
    from dspo.env.verifiers_env import load, task_items, verifiers_environment

    if name == "verifiers_single":  # no tool: the search is not a call, and the episode ends on it (1 call)
        args = {"questions": questions(n)}
        return verifiers_environment("vf_toy_single", args), task_items(load("vf_toy_single", args), "vf_toy_single")
    pages = [{"title": f"Person{i}", "text": f"Person{i} was born in City{i % 10}."} for i in range(n)]
    args = {"questions": questions(n), "task": {"tools": {"pages": pages}, "shared": name == "verifiers_shared"}}
    env = verifiers_environment("vf_toy_search", args)
    return env, task_items(load("vf_toy_search", args), "vf_toy_search")


def measure(name: str, args: argparse.Namespace, tokenizer) -> dict:
    import contextlib

    from dspo.agent import AgentConfig
    from dspo.agent.build import build_agent
    from dspo.engines.scripted import ScriptedEngine

    config = AgentConfig(max_turns=4, tag_format="searchr1", max_total_tokens=2048)
    rounds = []
    with contextlib.ExitStack() as stack:
        env, items = build(name, args.questions, stack)
        agent = build_agent(config, engine=ScriptedEngine(tokenizer, script), tokenizer=tokenizer, env=env)
        try:
            agent.rollout(items[:1], group_size=1, policy_version=0, seed=0)  # warm-up: imports, server start
            for rep in range(args.repeats):
                tic = time.perf_counter()
                stats = agent.rollout(items, group_size=args.group_size, policy_version=0, seed=rep).stats
                calls = stats["turns_mean"] * len(items) * args.group_size
                rounds.append(dict(stats, round_s=time.perf_counter() - tic, calls=calls))
        finally:
            getattr(agent, "close", lambda: None)()
    median = {k: statistics.median(r[k] for r in rounds) for k in ("round_s", "calls", "reward_mean")}
    return {
        **median,
        "ms_per_call": 1000 * median["round_s"] / max(median["calls"], 1),
        "prefix_breaks": sum(r.get("prefix_breaks", 0) for r in rounds),
        "agent_errors": sum(r.get("agent_errors", 0) for r in rounds),
    }


def main() -> None:
    args = parse_args()
    measured = provenance()
    for path in (ROOT, ROOT / "docs" / "examples", ROOT / "tests" / "env" / "verifiers_envs"):
        sys.path.insert(0, str(path))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT / "tests" / "env" / "verifiers_envs"), str(ROOT), os.environ.get("PYTHONPATH")])
    )
    from transformers import AutoTokenizer

    from dspo.process.resources import QWEN_TOKENIZER, data_dir

    tokenizer = AutoTokenizer.from_pretrained(str(data_dir().joinpath(*QWEN_TOKENIZER)))
    results = {}
    for name in args.adapters:
        results[name] = r = measure(name, args, tokenizer)
        print(
            f"{name:14s} round {r['round_s']:.3f} s, {r['calls']:.0f} calls, {r['ms_per_call']:.2f} ms/call, reward "
            f"{r['reward_mean']:.2f}, prefix breaks {r['prefix_breaks']:.0f}, agent errors {r['agent_errors']:.0f}",
            flush=True,
        )
    if "builtin" in results:
        for r in results.values():
            r["overhead_ms_per_call"] = r["ms_per_call"] - results["builtin"]["ms_per_call"]
    record = {
        "measured": measured,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": results,
        "machine": {"cpus": os.cpu_count(), "load_after": os.getloadavg()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    figures = {f"{name}.ms_per_call": r["ms_per_call"] for name, r in results.items()}
    errors = {name: f"{r['agent_errors']:.0f} agent errors" for name, r in results.items() if r["agent_errors"]}
    require_measured("envs", figures, errors=errors)


if __name__ == "__main__":
    main()
