"""The OpenAI-compatible endpoint's cost per round against the built-in agent, on the same workload and engine.

    python bench/endpoint.py                       # toy default: 32 questions x G=5, shipped warm start, vLLM
    python bench/endpoint.py --model random        # random Qwen2 with the 151k vocabulary (bench/rollout.py's)
    python bench/endpoint.py --questions 2 --group-size 2 --repeats 1    # smoke

Both agents roll out the same questions with the same vLLM engine, the same environment (the toy's search tool over
its BM25 index) and the same budgets; the endpoint side runs `docs/examples/openai_agent.py` through
`EndpointAgent` (HTTP over loopback with the `openai` client, a batch per blocked set of episodes). Each side gets one
warm-up rollout, then `--repeats` alternating timed rollouts; the figure is the median round time's ratio, endpoint /
built-in (goal: <= 1.15, issue 42). The sampled texts differ between the sides after the first turn (their observation
tokens can split differently), so the table also shows tokens and turns. JSON: `outputs/bench/endpoint.json` (or
`--out`); `--update-shipped` writes `bench/results/endpoint.json` (`endpoint_random_vocab151k.json` with
`--model random`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1.15  # issue 42: the endpoint's round within 15 % of the built-in agent's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["toy", "random"], default="toy")
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--p-close", type=float, default=0.03, help="--model random: P(close a tool call)")
    parser.add_argument("--p-eos", type=float, default=0.005, help="--model random: P(end the turn)")
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    add_output_arguments(parser, "endpoint.json")  # --model random: endpoint_random_vocab151k.json
    args = parser.parse_args(argv)
    if args.questions < 1 or args.group_size < 1 or args.repeats < 1:
        parser.error("--questions, --group-size and --repeats must be >= 1")
    name = "endpoint.json" if args.model == "toy" else "endpoint_random_vocab151k.json"
    args.out = output_path(parser, args, name)
    return args


def main() -> None:
    args = parse_args()
    measured = provenance()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(ROOT / "docs" / "examples"))
    import openai_agent
    from rollout import random_workload, toy_workload  # the rollout benchmark's workloads

    from dspo.agent import build_agent
    from dspo.engines import VLLMEngine
    from dspo.env import Environment
    from dspo.toy.tokenizer import load_tokenizer

    work = tempfile.mkdtemp(prefix="dspo_bench_endpoint_")
    if args.model == "toy":
        path, items, env, agent_config, temperature = toy_workload(work, args.questions)
    else:
        path, items, retriever, agent_config, temperature = random_workload(work, args.questions, args)
        env = Environment.search(retriever)
    agent_config.temperature = temperature
    tokenizer = load_tokenizer(path)
    engine = VLLMEngine(path, dtype="float32", max_model_len=4096, kv_cache_space_gb=1)
    print(f"model {args.model} ({path}); {len(items)} questions x G={args.group_size}; agent: {agent_config}")
    builtin = build_agent(agent_config, engine=engine, tokenizer=tokenizer, env=env)
    env_with_agent = type(env)(
        env.tools,
        env.reward,
        max_tool_error_share=env.max_tool_error_share,
        instruction=env.instruction,
        agent=openai_agent.agent,
    )
    endpoint = build_agent(agent_config, engine=engine, tokenizer=tokenizer, env=env_with_agent)
    sides = {"builtin": builtin, "endpoint": endpoint}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for agent in sides.values():
        agent.rollout(items[:2], group_size=2, policy_version=0, seed=123)  # warm-up: compilation, server start
    for rep in range(args.repeats):
        for name, agent in sides.items():
            tic = time.perf_counter()
            stats = agent.rollout(items, group_size=args.group_size, policy_version=0, seed=rep).stats
            runs[name].append(dict(stats, round_s=time.perf_counter() - tic))
            print(f"[{name} {rep}] round {runs[name][-1]['round_s']:.2f} s, " + _brief(stats), flush=True)
    endpoint.close()
    summary = {name: _median(rounds) for name, rounds in runs.items()}
    ratio = summary["endpoint"]["round_s"] / summary["builtin"]["round_s"]
    per_token = (summary["endpoint"]["round_s"] / summary["endpoint"]["generated_tokens"]) / (
        summary["builtin"]["round_s"] / summary["builtin"]["generated_tokens"]
    )
    print(
        f"\nround: built-in {summary['builtin']['round_s']:.2f} s, endpoint {summary['endpoint']['round_s']:.2f} s "
        f"-> {ratio:.3f}x (goal <= {GOAL}); per generated token {per_token:.3f}x"
    )
    record = {
        "measured": measured,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": runs,
        "median": summary,
        "endpoint_over_builtin_round": ratio,
        "endpoint_over_builtin_per_token": per_token,
        "goal_met": ratio <= GOAL,
        "machine": {"cpus": os.cpu_count(), "load_after": os.getloadavg()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    require_measured(
        "endpoint",
        {
            "builtin.round_s": summary["builtin"]["round_s"],
            "endpoint.round_s": summary["endpoint"]["round_s"],
            "builtin.generated_tokens": summary["builtin"]["generated_tokens"] or None,
            "endpoint.generated_tokens": summary["endpoint"]["generated_tokens"] or None,
            "endpoint_over_builtin_round": ratio,
        },
    )


def _median(rounds: list[dict]) -> dict:
    keys = ("round_s", "generation_s", "tool_s", "other_s", "generated_tokens", "turns_mean", "reward_mean")
    return {key: statistics.median(r.get(key, 0.0) for r in rounds) for key in keys}


def _brief(stats: dict) -> str:
    keys = ("generation_s", "tool_s", "other_s", "generated_tokens", "turns_mean", "reward_mean", "prefix_breaks")
    return ", ".join(f"{k}={stats[k]:.3g}" for k in keys if k in stats)


if __name__ == "__main__":
    main()
