"""Rollout throughput at a training round's size: VLLMEngine vs HFEngine on the same model and the same episodes.

    python bench/rollout.py                              # toy default: 32 questions x G=5, shipped warm start
    python bench/rollout.py --questions 8 --group-size 4 --skip-hf    # quicker, vLLM only
    python bench/rollout.py --model random               # random Qwen2 with the 151k Qwen2.5 vocabulary, HotpotQA

`--model toy` (default): the shipped warm-started toy model (`data/toy_warmstart`, adopted into a temporary toy world
exactly as `dspo-train` adopts it), the toy world's training questions, its BM25 index, and the agent settings of
`conf/rollout/agent/default.yaml` + `conf/experiment/toy.yaml` (tags, top-k, turns, lengths) at the RL temperature.
The model really searches: it writes queries, BM25 answers them, passages are spliced in, and it answers, so the three
phases of a rollout are all exercised.
`--model random`: a tiny random Qwen2 with Qwen2.5's 151k vocabulary, steered to close tool calls (malformed, so
every tool turn is an error observation) on HotpotQA questions: the cost of a large vocabulary per token.

Phases (the agent's own timers, `AgentRollout.stats`): generation = engine calls; search = retriever calls;
other = everything else (tokenising observations, splicing, parsing, rewards). Each engine gets one warm-up call,
then `--repeats` timed rollouts of the whole batch; the table shows the median repeat. HF runs first because
vLLM's CPU backend pins torch's threads in its process. JSON: `outputs/bench/rollout.json` in the working directory
(or `--out`); `--update-shipped` writes the tracked `bench/results/rollout.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"  # carried by the repository (data/README.md)
GOAL = 10.0  # issue 17: vLLM's generated tokens/s at least 10x the HF engine's


def toy_workload(work: str, questions: int):
    """(model dir, items, environment, agent constructor, temperature) of the toy default (its `env` group, as
    `dspo-train` builds it), shipped warm start adopted."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import dspo  # noqa: F401  registers the config resolvers
    from dspo.data.qa import load_qa
    from dspo.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["output_dir=/tmp", f"paths.toy_root={work}/toy"])
    world, model_dir = instantiate(cfg.prepare.toyworld)
    items = load_qa(world.train, benchmark="toy", limit=questions)
    env = instantiate(cfg.env)  # the search tool over the world's BM25 index + subEM
    return model_dir, items, env, instantiate(cfg.rollout.agent), float(cfg.algorithm.temperature)


def random_workload(work: str, questions: int, args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspo.agent import AgentConfig
    from dspo.data.qa import load_qa
    from dspo.search.bm25 import build_or_load_index
    from dspo.toy.model import build_tiny_model, steer_tiny_model

    path = build_tiny_model(str(DATA / "tokenizers" / "qwen2.5"), f"{work}/model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    close = tokenizer.convert_tokens_to_ids("</tool_call>")
    steer_tiny_model(model, {close: args.p_close, tokenizer.eos_token_id: args.p_eos})
    model.save_pretrained(path)
    data = DATA / "hotpotqa_dev500"
    items = load_qa(str(data / "questions.jsonl"), limit=questions)
    retriever = build_or_load_index(str(data / "corpus.jsonl.gz"), f"{work}/index", show_progress=False)
    agent = AgentConfig(max_turns=4, max_new_tokens_per_turn=64, max_total_tokens=2048)
    return path, items, retriever, agent, 1.0


def run(engine, tokenizer, retriever, items, agent_config, args, label: str) -> dict:
    from dspo.agent import build_agent

    agent = build_agent(agent_config, engine=engine, tokenizer=tokenizer, env=retriever)
    agent.rollout(items[:2], group_size=2, policy_version=0, seed=123)  # warm-up (compilation, caches)
    repeats = []
    for rep in range(args.repeats):
        tic = time.perf_counter()
        stats = agent.rollout(items, group_size=args.group_size, policy_version=0, seed=rep).stats
        repeats.append(dict(stats, total_s=time.perf_counter() - tic))
        print(f"[{label} {rep}] " + ", ".join(f"{k}={v:.3g}" for k, v in repeats[-1].items()), flush=True)
    median = sorted(repeats, key=lambda s: s["tokens_per_s"])[len(repeats) // 2]
    return {**median, "tokens_per_s_repeats": [s["tokens_per_s"] for s in repeats]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["toy", "random"], default="toy")
    parser.add_argument("--questions", type=int, default=32, help="questions per round (B / initial keep-rate ~ 13)")
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-batch-size", type=int, default=64, help="HFEngine sequences per generate call")
    parser.add_argument("--p-close", type=float, default=0.03, help="--model random: P(close a tool call)")
    parser.add_argument("--p-eos", type=float, default=0.005, help="--model random: P(end the turn)")
    parser.add_argument("--skip-hf", action="store_true")
    add_output_arguments(parser, "rollout.json")
    args = parser.parse_args(argv)
    if args.questions < 2 or args.group_size < 2 or args.repeats < 1:
        parser.error("--questions and --group-size must be >= 2, --repeats >= 1")
    args.out = output_path(parser, args, "rollout.json")
    return args


def main() -> None:
    args = parse_args()
    measured = provenance()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    from dspo.engines import HFEngine, VLLMEngine
    from dspo.toy.tokenizer import load_tokenizer  # any local tokenizer.json folder (no remote code)

    work = tempfile.mkdtemp(prefix="dspo_bench_rollout_")
    if args.model == "toy":
        path, items, retriever, agent, temperature = toy_workload(work, args.questions)
    else:
        path, items, retriever, agent, temperature = random_workload(work, args.questions, args)
    agent.temperature = temperature
    tokenizer = load_tokenizer(path)
    print(
        f"model {args.model} ({path}); {len(items)} questions x G={args.group_size}; torch threads "
        f"{torch.get_num_threads()}; agent: {agent}",
        flush=True,
    )
    results: dict[str, dict] = {}
    if not args.skip_hf:
        engine = HFEngine(model_path=path, batch_size=args.hf_batch_size)
        results["hf"] = run(engine, tokenizer, retriever, items, agent, args, "hf")
    engine = VLLMEngine(path, dtype="float32", max_model_len=4096, kv_cache_space_gb=1)
    results["vllm"] = run(engine, tokenizer, retriever, items, agent, args, "vllm")
    print_table(results)
    record = {
        "measured": measured,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **results,
    }
    if "hf" in results:
        record["vllm_over_hf_tokens_per_s"] = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        record["goal_met"] = record["vllm_over_hf_tokens_per_s"] >= GOAL
        print(f"\nvLLM / HF generated tokens/s: {record['vllm_over_hf_tokens_per_s']:.1f}x (goal >= {GOAL:.0f}x)")
    record["machine"] = {"cpus": os.cpu_count(), "load_after": os.getloadavg(), "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    figures = {f"{name}.{k}": s.get(k) for name, s in results.items() for k in ("tokens_per_s", "generation_s")}
    figures.update({f"{name}.generated_tokens": s.get("generated_tokens") or None for name, s in results.items()})
    if "hf" in results:
        figures["vllm_over_hf_tokens_per_s"] = record["vllm_over_hf_tokens_per_s"]
    require_measured("rollout", figures)


def print_table(results: dict[str, dict]) -> None:
    head = ("engine", "tokens", "tok/s", "total s", "gen %", "search %", "other %", "searches", "turns", "reward")
    print("\n{:6} {:>7} {:>8} {:>8} {:>6} {:>8} {:>7} {:>8} {:>5} {:>6}".format(*head))
    for name, s in results.items():
        total = s["generation_s"] + s["tool_s"] + s["other_s"]
        print(
            f"{name:6} {s['generated_tokens']:7.0f} {s['tokens_per_s']:8.1f} {total:8.2f} "
            f"{100 * s['generation_s'] / total:6.1f} {100 * s['tool_s'] / total:8.1f} "
            f"{100 * s['other_s'] / total:7.1f} {s['tool_calls_mean']:8.2f} {s['turns_mean']:5.2f} "
            f"{s['reward_mean']:6.3f}"
        )
    spread = {k: statistics.median(v["tokens_per_s_repeats"]) for k, v in results.items()}
    print("median tokens/s per engine: " + ", ".join(f"{k} {v:.0f}" for k, v in spread.items()))


if __name__ == "__main__":
    main()
