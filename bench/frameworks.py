"""What each agent framework costs per call through the endpoint, against the plain `openai` client example, and what
it sends: the five agents of docs/examples on one scripted workload.

    python bench/frameworks.py                                   # 16 questions x G=4, 5 repeats
    python bench/frameworks.py --questions 2 --group-size 2 --repeats 1 --agents openai_agent langgraph_agent  # smoke

The engine is scripted (`dspo.engines.scripted.ScriptedEngine` on the Qwen2.5 tokenizer: a search, then an answer
once a result is in the prompt), so generation costs nothing and a round's time is what the agents, their HTTP clients
and the endpoint spend. Every episode makes the same calls under every framework (the scripted turns read only the
prompt), so `ms_per_call` compares like with like; `overhead_ms_per_call` is a framework's minus the `openai` client
example's. The request shapes each framework sent (top-level keys, message roles, content kinds) are recorded with
its prefix breaks and samples per episode. Needs the `agents` extra (`pip install -e ".[agents]"`). JSON:
`outputs/bench/frameworks.json` (or `--out`); `--update-shipped` writes `bench/results/frameworks.json`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance

ROOT = Path(__file__).resolve().parents[1]
AGENTS = ("openai_agent", "langgraph_agent", "openai_agents_sdk_agent", "smolagents_agent", "pydantic_ai_agent")
BASELINE = "openai_agent"
CALL = "<think>I should search.</think>\n<search> {entity} </search>"
ANSWER = "<think>Found it.</think>\n<answer> {answer} </answer>"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--agents", nargs="+", choices=AGENTS, default=list(AGENTS))
    add_output_arguments(parser, "frameworks.json")
    args = parser.parse_args(argv)
    if args.questions < 1 or args.group_size < 1 or args.repeats < 1:
        parser.error("--questions, --group-size and --repeats must be >= 1")
    if BASELINE not in args.agents:
        parser.error(f"--agents must include {BASELINE} (the baseline the overhead is measured against)")
    args.out = output_path(parser, args, "frameworks.json")
    return args


class OnePassage:
    """A retriever that answers every query with the passage of the entity it names."""

    def search(self, queries: list[str], k: int) -> list[list]:
        from dspo.types import Passage

        return [[Passage(id=q, title=q, text=f"{q} was born in City{q[-1]}.")] for q in queries]


def script(prompt: str, turn: int, index: int) -> str:
    entity = prompt.split("Question: Where was ")[-1].split(" born?")[0]
    return ANSWER.format(answer=f"City{entity[-1]}") if "(Title: " in prompt else CALL.format(entity=entity)


class RequestLog:
    """The shapes of the requests the endpoint parsed: top-level keys, message roles, content kinds."""

    def __init__(self) -> None:
        self.keys: Counter = Counter()
        self.roles: Counter = Counter()
        self.content: Counter = Counter()
        self.requests = 0

    def record(self, body: dict) -> None:
        self.requests += 1
        self.keys.update(body)
        for message in body.get("messages") or []:
            self.roles[message.get("role")] += 1
            content = message.get("content")
            self.content["parts" if isinstance(content, list) else type(content).__name__] += 1

    def summary(self) -> dict:
        per = max(self.requests, 1)
        return {
            "keys": sorted(self.keys),
            "roles_per_request": {role: round(n / per, 2) for role, n in sorted(self.roles.items())},
            "content_kinds": dict(sorted(self.content.items())),
        }


def measure(name: str, args: argparse.Namespace, tokenizer, items: list) -> dict:
    import dspo.agent.endpoint.server as server
    from dspo.agent import AgentConfig
    from dspo.agent.endpoint import EndpointAgent
    from dspo.engines.scripted import ScriptedEngine
    from dspo.env import Environment, SearchTool, SubEMReward

    log, parse = RequestLog(), server.parse_request

    def recorded(body):
        log.record(body)
        return parse(body)

    function = importlib.import_module(name).agent
    env = Environment({"search": SearchTool(OnePassage(), topk=1)}, SubEMReward(), agent=function)
    config = AgentConfig(max_turns=4, tag_format="searchr1", max_total_tokens=2048)
    agent = EndpointAgent(ScriptedEngine(tokenizer, script), tokenizer, env, config)
    server.parse_request, rounds = recorded, []
    try:
        agent.rollout(items[:2], group_size=2, policy_version=0, seed=0)  # warm-up: imports, server start
        for rep in range(args.repeats):
            tic = time.perf_counter()
            stats = agent.rollout(items, group_size=args.group_size, policy_version=0, seed=rep).stats
            calls = stats["turns_mean"] * len(items) * args.group_size
            rounds.append(dict(stats, round_s=time.perf_counter() - tic, calls=calls))
    finally:
        server.parse_request = parse
        agent.close()
    median = {k: statistics.median(r[k] for r in rounds) for k in ("round_s", "calls", "turns_mean", "reward_mean")}
    episodes = len(items) * args.group_size
    return {
        **median,
        "ms_per_call": 1000 * median["round_s"] / max(median["calls"], 1),
        "prefix_breaks_per_episode": statistics.median(r["prefix_breaks"] for r in rounds) / episodes,
        "samples_per_episode": statistics.median(r["samples_per_episode"] for r in rounds),
        "agent_errors": sum(r["agent_errors"] for r in rounds),
        "sends": log.summary(),
    }


def main() -> None:
    args = parse_args()
    measured = provenance()
    sys.path.insert(0, str(ROOT / "docs" / "examples"))
    from transformers import AutoTokenizer

    from dspo.process.resources import QWEN_TOKENIZER, data_dir
    from dspo.types import QAItem

    tokenizer = AutoTokenizer.from_pretrained(str(data_dir().joinpath(*QWEN_TOKENIZER)))
    items = [
        QAItem(id=str(i), question=f"Where was Person{i} born?", golden_answers=[f"City{i % 10}"])
        for i in range(args.questions)
    ]
    results = {}
    for name in args.agents:
        results[name] = measure(name, args, tokenizer, items)
        r = results[name]
        print(
            f"{name:24s} round {r['round_s']:.3f} s, {r['calls']:.0f} calls, {r['ms_per_call']:.2f} ms/call, "
            f"prefix breaks/episode {r['prefix_breaks_per_episode']:.2f}, samples/episode "
            f"{r['samples_per_episode']:.2f}, reward {r['reward_mean']:.2f}, agent errors {r['agent_errors']:.0f}",
            flush=True,
        )
    base = results[BASELINE]["ms_per_call"]
    for r in results.values():
        r["overhead_ms_per_call"] = r["ms_per_call"] - base
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
    figures |= {f"{name}.calls": r["calls"] or None for name, r in results.items()}
    errors = {name: f"{r['agent_errors']:.0f} agent errors" for name, r in results.items() if r["agent_errors"]}
    require_measured("frameworks", figures, errors=errors)


if __name__ == "__main__":
    main()
