"""Rollout throughput: VLLMEngine vs HFEngine on the same tiny model and the same batch of multi-turn search episodes.

    python bench/rollout.py [--questions 8] [--group-size 4] [--max-turns 4] [--max-new-tokens 64]

The model is a tiny random Qwen2 with the Qwen2.5 vocabulary, steered (dspo.toy.model.steer_tiny_model) to close
a tool call (`</tool_call>`) about every 1/p_close tokens and to end its turn with EOS about every 1/p_eos tokens, so
episodes run several turns. Its calls are malformed JSON (a random model cannot write a query), so every tool turn
is an error observation: the time share of search is that of the agent's bookkeeping of observations, while the
BM25 retrieval cost itself is measured separately on the same number of queries. HF runs first because vLLM's CPU
backend pins torch to one thread in its process.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"  # carried by the repository (data/README.md)


def build_model(directory: str, p_close: float, p_eos: float) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspo.toy.model import build_tiny_model, steer_tiny_model

    path = build_tiny_model(str(DATA / "tokenizers" / "qwen2.5"), directory)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    close = tokenizer.convert_tokens_to_ids("</tool_call>")
    steer_tiny_model(model, {close: p_close, tokenizer.eos_token_id: p_eos})
    model.save_pretrained(path)
    return path


def run(engine, tokenizer, retriever, items, args, label: str) -> dict:
    from dspo.rollout.agent import AgentConfig, SearchAgent

    config = AgentConfig(max_turns=args.max_turns, max_new_tokens_per_turn=args.max_new_tokens, max_total_tokens=2048)
    agent = SearchAgent(engine, tokenizer, retriever, config)
    agent.rollout(items[:2], group_size=1, policy_version=0, seed=123)  # warm-up
    tic = time.perf_counter()
    agent.rollout(items, group_size=args.group_size, policy_version=0, seed=0)
    stats = dict(agent.last_stats, total_s=time.perf_counter() - tic)
    print(f"[{label}] " + ", ".join(f"{k}={v:.3g}" for k, v in stats.items()), flush=True)
    return stats


def search_cost(retriever, items, n_queries: int, k: int) -> float:
    queries = [items[i % len(items)].question for i in range(n_queries)]
    tic = time.perf_counter()
    retriever.search(queries, k)
    return time.perf_counter() - tic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--p-close", type=float, default=0.03)
    parser.add_argument("--p-eos", type=float, default=0.005)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoTokenizer

    from dspo.data.qa import load_qa
    from dspo.rollout.engine import HFEngine, VLLMEngine
    from dspo.search.bm25 import build_or_load_index

    work = tempfile.mkdtemp(prefix="dspo_bench_rollout_")
    data = DATA / "hotpotqa_dev500"
    items = load_qa(str(data / "questions.jsonl"), limit=args.questions)
    retriever = build_or_load_index(str(data / "corpus.jsonl.gz"), f"{work}/index", show_progress=False)
    path = build_model(f"{work}/model", args.p_close, args.p_eos)
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(f"torch threads={torch.get_num_threads()}, {len(items)} questions x {args.group_size}", flush=True)
    results = {}
    if not args.skip_hf:
        results["hf"] = run(HFEngine(model_path=path, batch_size=64), tokenizer, retriever, items, args, "hf")
    engine = VLLMEngine(path, dtype="float32", max_model_len=2048, kv_cache_space_gb=1)
    results["vllm"] = run(engine, tokenizer, retriever, items, args, "vllm")
    calls = int(results["vllm"]["turns_mean"] * len(items) * args.group_size)
    bm25_s = search_cost(retriever, items, calls, k=3)
    print(f"\nBM25 (bm25s) on {calls} queries, top-3: {bm25_s:.3f} s")
    print(f"{'engine':6} {'tokens':>7} {'tok/s':>9} {'gen %':>6} {'search %':>8} {'other %':>7} {'turns':>5}")
    for name, s in results.items():
        total = s["generation_s"] + s["search_s"] + s["other_s"]
        print(
            f"{name:6} {s['generated_tokens']:7.0f} {s['tokens_per_s']:9.1f} {100 * s['generation_s'] / total:6.1f} "
            f"{100 * s['search_s'] / total:8.1f} {100 * s['other_s'] / total:7.1f} {s['turns_mean']:5.2f}"
        )
    if "hf" in results:
        print(f"vLLM / HF generated tokens/s: {results['vllm']['tokens_per_s'] / results['hf']['tokens_per_s']:.1f}x")


if __name__ == "__main__":
    main()
