"""Each number the README, bench/README.md and the docs cite from a benchmark is in a results file under bench/results/,
to the cited rounding, and every performance results file says what it was measured on (`bench/_outputs.py`
`provenance`: a commit of this history, the source unchanged from it); issue 40. Learning results (environments,
ablation, correction, async_learning, agent_learning, toy_deep, toy_deep_warm, compaction_learning, partial_rollouts)
come from long training sweeps and are checked for the numbers only."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"

# results file -> where its provenance stamps are (a retrieval file keeps one per mode)
STAMPS: dict[str, Callable[[dict], list[dict]]] = {
    "retrieval.json": lambda d: [
        d.get("index_measured"),
        d.get("server", {}).get("measured"),
        d.get("soak_21m_bm25s_uncached", {}).get("measured"),
        d.get("soak_21m_bm25s_uncached_walk_only", {}).get("measured"),
    ],
    **{
        name: lambda d: [d.get("measured")]
        for name in (
            "rollout.json",
            "rollout_random_vocab151k.json",
            "train_step.json",
            "train_step_h512.json",
            "train_step_qwen.json",
            "async.json",
            "async_transfer.json",
            "vs_trl.json",
            "profile_dspo_step.json",
            "endpoint.json",
            "endpoint_random_vocab151k.json",
            "frameworks.json",
            "envs.json",
            "lora.json",
            "lora_push.json",
            "lucene_agreement.json",
        )
    },
}


def data(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def qps(d: dict, corpus: str, backend: str) -> float:
    return next(r["qps"] for r in d["index"] if r["corpus"] == corpus and r["backend"] == backend)


def agreement(corpus: str, backend: str, k1: float, key: str) -> Callable[[dict], float]:
    def figure(d: dict) -> float:
        row = next(r for r in d["rows"] if (r["corpus"], r["backend"], r["k1"]) == (corpus, backend, k1))
        return row[key]

    return figure


def step(layout: str, key: str, scale: float = 1.0) -> Callable[[dict], float]:
    return lambda d: scale * d["summary"][layout][key]


def run(workload: str, run_key: str, key: str = "round_s") -> Callable[[dict], float]:
    return lambda d: d["workloads"][workload][run_key][key]


def correction(mode: str, k: int, key: str) -> Callable[[dict], float]:
    return lambda d: next(r[key] for r in d["summary"] if r["mode"] == mode and r["k"] == k)


def framework(name: str, key: str = "ms_per_call") -> Callable[[dict], float]:
    return lambda d: d["results"][name][key]


# (document, the cited text, the number in it, results file, the figure in the cited unit)
Cited = tuple[str, str, str, str, Callable[[dict], float]]
CITED: list[Cited] = [
    ("docs/sweeps.md", "| 0 | 2.59e-04 | 2.69e-03 | 4 | 0.719 / 0.781 | **0.750** |", "0.750", "search_toy.json",
     lambda d: d["best"]["value"]),
    ("docs/sweeps.md", "| 0 | 2.59e-04 | 2.69e-03 | 4 | 0.719 / 0.781 | **0.750** |", "0.719", "search_toy.json",
     lambda d: d["trials"][0]["seed_values"]["0"]),
    ("docs/sweeps.md", "| 7 | 9.82e-04 | 2.17e-03 | 4 | 0.406 / 0.359 | 0.383 |", "0.383", "search_toy.json",
     lambda d: d["trials"][7]["value"]),
    ("docs/results.md", "202x queries/s", "202", "retrieval.json",
     lambda d: qps(d, "shared", "bm25s") / qps(d, "shared", "rank_bm25")),
    ("docs/results.md", "0 errors in 28,987 requests", "28987", "retrieval.json", lambda d: d["server"]["requests"]),
    ("docs/results.md", "0 errors in 28,987", "0", "retrieval.json", lambda d: d["server"]["errors"]),
    ("docs/results.md", "p50 173 ms", "173", "retrieval.json", lambda d: d["server"]["p50_ms"]),
    ("docs/results.md", "p99 8.6 s", "8.6", "retrieval.json", lambda d: d["server"]["p99_ms"] / 1000),
    ("bench/README.md", "| 27,634 | 0.736 |", "27634", "retrieval.json", lambda d: qps(d, "shared", "bm25s")),
    ("bench/README.md", "| 136.6 | 0.736 |", "136.6", "retrieval.json", lambda d: qps(d, "shared", "rank_bm25")),
    ("bench/README.md", "| 38.9 s | 2.6 GiB | 595 |", "595", "retrieval.json", lambda d: qps(d, "synthetic", "bm25s")),
    ("docs/search.md", "| 0.2 s | 77 MiB | 27,634 |", "27634", "retrieval.json", lambda d: qps(d, "shared", "bm25s")),
    ("docs/results.md", "4.0x tokens/s on the toy model", "4.0", "rollout.json",
     lambda d: d["vllm_over_hf_tokens_per_s"]),
    ("bench/README.md", "| HF | 6,291 | 2,023 |", "2023", "rollout.json", lambda d: d["hf"]["tokens_per_s"]),
    ("bench/README.md", "| vLLM | 6,015 | 8,046", "8046", "rollout.json", lambda d: d["vllm"]["tokens_per_s"]),
    ("docs/results.md", "11.2x with Qwen2.5's 151k vocabulary", "11.2", "rollout_random_vocab151k.json",
     lambda d: d["vllm_over_hf_tokens_per_s"]),
    ("bench/README.md", "| HF | 11,489 | 103.5 |", "103.5", "rollout_random_vocab151k.json",
     lambda d: d["hf"]["tokens_per_s"]),
    ("docs/results.md", "0.57 (toy)", "0.57", "train_step.json", lambda d: d["efficiency"]),
    ("docs/results.md", "0.73 (hidden 512)", "0.73", "train_step_h512.json", lambda d: d["efficiency"]),
    ("docs/results.md", "(0.47 / 0.68 without)", "0.47", "train_step.json",
     step("bucketed", "efficiency_matmuls_only")),
    ("docs/results.md", "(0.47 / 0.68 without)", "0.68", "train_step_h512.json",
     step("bucketed", "efficiency_matmuls_only")),
    ("docs/results.md", "9.8 % padding", "9.8", "train_step.json", step("bucketed", "padding_share", 100)),
    ("docs/results.md", "(21 % shuffled)", "21", "train_step.json", step("random", "padding_share", 100)),
    ("bench/README.md", "| 1.25 s | 12,507 |", "1.25", "train_step.json", step("bucketed", "seconds")),
    ("bench/README.md", "| 7.67 s | 2,036 |", "7.67", "train_step_h512.json", step("bucketed", "seconds")),
    ("bench/README.md", "| 3.91 s | 3,992 |", "3.91", "train_step_qwen.json", step("bucketed", "seconds")),
    ("docs/results.md", "0.078x TRL's step time", "0.078", "vs_trl.json", lambda d: d["ratio"]),
    ("docs/results.md", "2.00 s vs 25.63 s", "2.00", "vs_trl.json", lambda d: d["dspo_step_s"]),
    ("docs/results.md", "2.00 s vs 25.63 s", "25.63", "vs_trl.json", lambda d: d["trl_step_s"]),
    ("bench/README.md", "**Filter cost: 1.46x**", "1.46", "vs_trl.json", lambda d: d["filter_cost"]),
    ("bench/README.md", "| 0.990 | 0.331 |", "0.331", "profile_dspo_step.json", lambda d: d["phases"]["forward_s"]),
    ("bench/README.md", "| 0.425 | 0.817 |", "0.817", "profile_dspo_step.json", lambda d: d["phases"]["backward_s"]),
    ("docs/results.md", "1.27x the synchronous round", "1.27", "async.json", lambda d: d["ratio"]),
    ("docs/results.md", "0.98 of its bound on the toy", "0.98", "async.json", lambda d: d["vs_bound"]),
    ("docs/results.md", "(1.21 on the 151k model)", "1.21", "async.json",
     lambda d: run("qwen", "k1")(d) / d["workloads"]["qwen"]["alone"]["bound_round_s"]),
    ("bench/README.md", "`sync_step_s` 0.97", "0.97", "async.json", lambda d: d["sync_step_s"]),
    ("bench/README.md", "`async_step_s` 1.24", "1.24", "async.json", lambda d: d["async_step_s"]),
    ("bench/README.md", "`bound_step_s` 1.26", "1.26", "async.json", lambda d: d["bound_step_s"]),
    ("docs/async.md", "| 1.95 s | 2.48 / 2.02 s |", "1.95", "async.json", run("toy", "k0")),
    ("docs/async.md", "| 1.95 s | 2.48 / 2.02 s |", "2.48", "async.json", run("toy", "k1")),
    ("docs/async.md", "| 2.39 s | 2.56 / 3.04 s |", "2.56", "async.json", run("qwen", "k1")),
    ("docs/scaling.md", "0.54 s of generation and 1.41 s of the rest", "0.54", "async.json",
     run("toy", "k0", "trainer_idle_s_per_round")),
    ("docs/scaling.md", "0.54 s of generation and 1.41 s of the rest", "1.41", "async.json",
     run("toy", "k0", "engine_idle_s_per_round")),
    ("docs/scaling.md", "gave 2.51 vs 2.59 s a round", "2.51", "async_transfer.json", run("toy", "k1")),
    ("docs/scaling.md", "gave 2.51 vs 2.59 s a round", "2.59", "async_transfer.json", run("toy", "k1_gloo")),
    ("docs/algorithm.md", "effective sample size of 0.91 / 0.82", "0.91", "correction.json",
     correction("seq_prod_tis", 1, "mismatch/ess")),
    ("docs/algorithm.md", "effective sample size of 0.91 / 0.82", "0.82", "correction.json",
     correction("seq_prod_tis", 2, "mismatch/ess")),
    ("docs/results.md", "1.05x the built-in round with the 151k vocabulary", "1.05", "endpoint_random_vocab151k.json",
     lambda d: d["endpoint_over_builtin_round"]),
    ("docs/results.md", "1.68x on the toy (not met", "1.68", "endpoint.json",
     lambda d: d["endpoint_over_builtin_round"]),
    ("docs/agents.md", "| 0.76 s | 1.27 s | **1.68x** | 1.64x |", "0.76", "endpoint.json",
     lambda d: d["median"]["builtin"]["round_s"]),
    ("docs/agents.md", "| 0.76 s | 1.27 s | **1.68x** | 1.64x |", "1.27", "endpoint.json",
     lambda d: d["median"]["endpoint"]["round_s"]),
    ("docs/agents.md", "| 0.76 s | 1.27 s | **1.68x** | 1.64x |", "1.64", "endpoint.json",
     lambda d: d["endpoint_over_builtin_per_token"]),
    ("docs/agents.md", "| 9.84 s | 10.30 s | **1.05x** | 1.06x |", "9.84", "endpoint_random_vocab151k.json",
     lambda d: d["median"]["builtin"]["round_s"]),
    ("docs/agents.md", "| 9.84 s | 10.30 s | **1.05x** | 1.06x |", "10.30", "endpoint_random_vocab151k.json",
     lambda d: d["median"]["endpoint"]["round_s"]),
    ("docs/agents.md", "| 0.030 -> 0.780 ± 0.215 |", "0.780", "agent_learning.json",
     lambda d: d["agent"]["mean_ci95"]["val_toy_2hop_end"][0]),
    ("docs/agents.md", "| 0.030 -> 0.780 ± 0.215 |", "0.215", "agent_learning.json",
     lambda d: d["agent"]["mean_ci95"]["val_toy_2hop_end"][1]),
    ("docs/agents.md", "| 0.030 -> 0.833 ± 0.328 |", "0.833", "agent_learning.json",
     lambda d: d["search"]["mean_ci95"]["val_toy_2hop_end"][0]),
    ("bench/README.md", "| 8.18 s (9.10, 7.26) | 3.74 s (3.65, 3.84) |", "8.18", "lora.json",
     lambda d: d["modes"]["full"]["step_s"]),
    ("bench/README.md", "| 8.18 s (9.10, 7.26) | 3.74 s (3.65, 3.84) |", "3.74", "lora.json",
     lambda d: d["modes"]["lora"]["step_s"]),
    ("bench/README.md", "| 2.069 s | 5.66 s |", "2.069", "lora_push.json", lambda d: d["ways"]["merged"]["push_s"]),
    ("bench/README.md", "| 2.069 s | 5.66 s |", "5.66", "lora_push.json", lambda d: d["ways"]["merged"]["generate_s"]),
    ("bench/README.md", "| 0.509 s | 10.20 s |", "0.509", "lora_push.json", lambda d: d["ways"]["adapter"]["push_s"]),
    ("bench/README.md", "| 0.509 s | 10.20 s |", "10.20", "lora_push.json",
     lambda d: d["ways"]["adapter"]["generate_s"]),
    ("docs/long-episodes.md", "| 0.99 / **0.22** |", "0.22", "compaction_learning.json",
     lambda d: d["tight_end"]["mean_ci95"]["test_toy_2hop"][0]),
    ("docs/long-episodes.md", "| 0.98 / **0.83** |", "0.83", "compaction_learning.json",
     lambda d: d["tight_compact"]["mean_ci95"]["test_toy_2hop"][0]),
    ("docs/long-episodes.md", "| 0.00 / 0.23 / 0.22 / **0.60** |", "0.60", "compaction_learning.json",
     lambda d: d["tight_compact"]["mean_ci95"]["val_toy_2hop_end"][0]),
    ("docs/toy-deep.md", "| 3-hop | 0.00 -> **0.007** ± 0.029 |", "0.007", "toy_deep.json",
     lambda d: d["deep"]["mean_ci95"]["val_toy_3hop_end"][0]),
    ("docs/toy-deep.md", "| 3-hop | 0.13 -> **0.340** ± 0.188 | **0.450** ± 0.442 |", "0.340", "toy_deep_warm.json",
     lambda d: d["deep"]["mean_ci95"]["val_toy_3hop_end"][0]),
    ("docs/toy-deep.md", "| 3-hop | 0.13 -> **0.340** ± 0.188 | **0.450** ± 0.442 |", "0.188", "toy_deep_warm.json",
     lambda d: d["deep"]["mean_ci95"]["val_toy_3hop_end"][1]),
    ("docs/toy-deep.md", "| 3-hop | 0.13 -> **0.340** ± 0.188 | **0.450** ± 0.442 |", "0.450", "toy_deep_warm.json",
     lambda d: d["deep"]["mean_ci95"]["test_toy_3hop"][0]),
    ("docs/toy-deep.md", "| 4-hop | 0.00 -> **0.049** ± 0.061 | **0.288** ± 0.674 |", "0.049", "toy_deep_warm.json",
     lambda d: d["deep"]["mean_ci95"]["val_toy_4hop_end"][0]),
    ("docs/toy-deep.md", "| 4-hop | 0.00 -> **0.049** ± 0.061 | **0.288** ± 0.674 |", "0.288", "toy_deep_warm.json",
     lambda d: d["deep"]["mean_ci95"]["test_toy_4hop"][0]),
    ("docs/commands.md", "3-hop validation 0.13 -> 0.34 ± 0.19, 4-hop 0.00 -> 0.05", "0.34", "toy_deep_warm.json",
     lambda d: d["deep"]["mean_ci95"]["val_toy_3hop_end"][0]),
    ("docs/commands.md", "3-hop validation 0.13 -> 0.34 ± 0.19, 4-hop 0.00 -> 0.05", "0.05", "toy_deep_warm.json",
     lambda d: d["deep"]["mean_ci95"]["val_toy_4hop_end"][0]),
    ("docs/async.md", "| 2.21 → 5.85 s | 2.17 → **4.03 s** |", "5.85", "partial_rollouts.json",
     lambda d: d["deep_k1"]["mean_ci95"]["rollout/time_s@end"][0]),
    ("docs/async.md", "| 2.21 → 5.85 s | 2.17 → **4.03 s** |", "4.03", "partial_rollouts.json",
     lambda d: d["deep_k1_partial"]["mean_ci95"]["rollout/time_s@end"][0]),
    ("docs/async.md", "| 1.28 ± 3.03 s | **0.31** ± 1.18 s |", "0.31", "partial_rollouts.json",
     lambda d: d["deep_k1_partial"]["mean_ci95"]["rollout/trainer_wait_s@end"][0]),
    ("docs/async.md", "| 0.13 → 0.243 ± 0.337 | 0.13 → **0.363** ± 0.180 |", "0.243", "partial_rollouts.json",
     lambda d: d["deep_k1"]["mean_ci95"]["val_toy_3hop_end"][0]),
    ("docs/async.md", "| 0.13 → 0.243 ± 0.337 | 0.13 → **0.363** ± 0.180 |", "0.363", "partial_rollouts.json",
     lambda d: d["deep_k1_partial"]["mean_ci95"]["val_toy_3hop_end"][0]),
    ("docs/async.md", "| 0.01 / 0.86 / 0.13 |", "0.13", "partial_rollouts.json",
     lambda d: d["deep_k1_partial"]["mean_ci95"]["token_age_2_share"][0]),
    ("docs/toy-deep.md", "took 4.0 s instead of 5.8 s", "4.0", "partial_rollouts.json",
     lambda d: d["deep_k1_partial"]["mean_ci95"]["rollout/time_s@end"][0]),
    ("docs/toy-deep.md", "the trainer waited 17 s instead of 27 s", "17", "partial_rollouts.json",
     lambda d: d["deep_k1_partial"]["mean_ci95"]["trainer_wait_total_s"][0]),
    ("docs/toy-deep.md", "the trainer waited 17 s instead of 27 s", "27", "partial_rollouts.json",
     lambda d: d["deep_k1"]["mean_ci95"]["trainer_wait_total_s"][0]),
    ("docs/planner.md", "| 0.1 | 3 | 0.870 ± 0.033 |", "0.870", "planner_front.json",
     lambda d: _front(d, "0.1")["utility"]),
    ("docs/planner.md", "| 1.0 | 3 | 0.518 ± 0.488 |", "0.518", "planner_front.json",
     lambda d: _front(d, "1.0")["utility"]),
    ("docs/planner.md", "| 0.1 | 3 | 0.870 ± 0.033 | 0.415 → 0.870 ± 0.012 | 0.953 ± 0.014 |", "0.953",
     "planner_front.json", lambda d: d["summary"]["env.reward.cost.search=0.1"]["val/toy_2hop/subem@final"]),
    ("docs/planner.md", "| 0.6 | 3 | 0.818 ± 0.063 | 0.415 → 0.648 ± 0.610 | 0.533 ± 1.147 | 1.22 ± 0.37 |",
     "1.22", "planner_front.json", lambda d: _front(d, "0.6")["searches"]),
    ("docs/planner.md", "to 0.518 at 1.89 (1.0)", "1.89", "planner_front.json",
     lambda d: _front(d, "1.0")["calls"]),
    ("docs/planner.md", "through 0.818 at 2.22 (0.6)", "2.22", "planner_front.json",
     lambda d: _front(d, "0.6")["calls"]),
    ("docs/planner.md", "0.02-0.10 of the sampled ones", "0.10", "planner_front.json",
     lambda d: _front(d, "0.1")["unfinished"]),
    ("docs/selfplay.md", "| `selfplay_qa` (n = 3) | 0.90 → 0.940 ± 0.025 | 0.02 → 0.720 ± 0.131 |", "0.720",
     "selfplay.json", lambda d: d["selfplay_qa"]["mean_ci95"]["val_toy_2hop_end"][0]),
    ("docs/selfplay.md", "| `selfplay` (n = 3) | 0.90 → 0.747 ± 0.117 |", "0.747", "selfplay.json",
     lambda d: d["selfplay"]["mean_ci95"]["val_toy_1hop_end"][0]),
    ("docs/selfplay.md", "| 0.800 / 0.097 | 0.26 → 0.42 | 0.23 → 0.06 |", "0.42", "selfplay.json",
     lambda d: d["selfplay"]["mean_ci95"]["rollout/proposer/valid_share@end"][0]),
    ("docs/selfplay.md", "| 0.800 / 0.097 | 0.26 → 0.42 | 0.23 → 0.06 |", "0.06", "selfplay.json",
     lambda d: d["selfplay"]["mean_ci95"]["rollout/proposer/difficulty@end"][0]),
    ("docs/environments.md", "| `goal_reflect_noisy` | 0.553 → 0.493 ± 0.165 |", "0.493", "goal_reflect.json",
     lambda d: d["goal_reflect_noisy"]["mean_ci95"]["val_toy_1hop_end"][0]),
    ("docs/environments.md", "| `simulated_noisy` | 0.530 → 0.560 ± 0.237 | 0.017 → 0.427 ± 0.112 |", "0.427",
     "goal_reflect.json", lambda d: d["simulated_noisy"]["mean_ci95"]["val_toy_2hop_end"][0]),
    ("docs/environments.md", "| 0.540 / 0.057 | 1.09 → 1.10 | 0.13 → 0.21 | 0.90 → 0.68, 0.53 → 0.38 |", "0.38",
     "goal_reflect.json", lambda d: d["goal_reflect_noisy"]["mean_ci95"]["reward/reflect_right@end"][0]),
    ("docs/environments.md", "| 0.5 | 0.39 → 0.343 ± 0.072 | 0.36 → 0.363 ± 0.057 |", "0.343", "goal_reflect.json",
     lambda d: d["goal_reflect_noisy"]["noise"]["mean_ci95"]["0.5"]["toy_1hop/subem"][0]),
    ("docs/environments.md", "| 0.06 → 0.020 ± 0.086 | 0.00 → 0.130 ± 0.025 |", "0.130", "goal_reflect.json",
     lambda d: d["simulated_noisy"]["noise"]["mean_ci95"]["0.5"]["toy_2hop/subem"][0]),
]  # fmt: skip


def _front(d: dict, cost: str) -> dict:
    """planner_front.json's front row of `env.reward.cost.search=<cost>`."""
    return next(row for row in d["front"] if row["group"] == f"env.reward.cost.search={cost}")


# docs/agents.md's framework table: (framework, its row's cells, ms per call, overhead per call or None)
FRAMEWORK_ROWS = [
    ("openai_agent", "| kept | 1 | 2.5 | - |", "2.5", None),
    ("langgraph_agent", "| kept | 1 | 30.3 | +27.8 ms |", "30.3", "27.8"),
    ("openai_agents_sdk_agent", "| kept | 1 | 4.4 | +1.9 ms |", "4.4", "1.9"),
    ("smolagents_agent", "| rewritten | 2 | 19.8 | +17.3 ms |", "19.8", "17.3"),
    ("pydantic_ai_agent", "| rewritten | 2 | 8.4 | +5.9 ms |", "8.4", "5.9"),
]
for name, row, ms, overhead in FRAMEWORK_ROWS:
    CITED.append(("docs/agents.md", row, ms, "frameworks.json", framework(name)))
    if overhead is not None:
        CITED.append(("docs/agents.md", row, overhead, "frameworks.json", framework(name, "overhead_ms_per_call")))


# docs/standards.md's adapter table: (adapter, its row's cells, ms per call, overhead per call or None)
ENV_ROWS = [
    ("builtin", "| 32 | 0.16 | - |", "0.16", None),
    ("openai_agent", "| 32 | 3.0 | +2.8 ms |", "3.0", "2.8"),
    ("openenv", "| 32 | 6.1 | +6.0 ms |", "6.1", "6.0"),
    ("verifiers_single", "| 16 | 58.1 | +57.9 ms |", "58.1", "57.9"),
    ("verifiers_shared", "| 32 | 49.2 | +49.0 ms |", "49.2", "49.0"),
    ("verifiers", "| 32 | 1230.0 | +1229.8 ms |", "1230.0", "1229.8"),
]
for name, row, ms, overhead in ENV_ROWS:
    adapter = lambda key, name=name: lambda d: d["results"][name][key]  # noqa: E731
    CITED.append(("docs/standards.md", row, ms, "envs.json", adapter("ms_per_call")))
    if overhead is not None:
        CITED.append(("docs/standards.md", row, overhead, "envs.json", adapter("overhead_ms_per_call")))


def scale(passages: int, backend: str, key: str):
    return lambda d: next(r[key] for r in d["scale"] if (r["passages"], r["backend"]) == (passages, backend))


WIKI18 = 21_015_324


def rerun(pick: Callable) -> Callable[[dict], float]:
    """A statistic of the 21M bm25s row's warm reruns' queries/s."""
    return lambda d: pick([r["qps_single"] for r in scale(WIKI18, "bm25s", "warm_reruns")(d)])


CITED += [
    ("docs/search.md", "| **1,420 s** | **4.42 GiB**", "1420", "retrieval.json", scale(WIKI18, "tantivy", "build_s")),
    (
        "docs/search.md",
        "| **1,420 s** | **4.42 GiB**",
        "4.42",
        "retrieval.json",
        scale(WIKI18, "tantivy", "build_peak_rss_gib"),
    ),
    (
        "docs/search.md",
        "with workers: 4.51)",
        "4.51",
        "retrieval.json",
        scale(WIKI18, "tantivy", "build_peak_anon_tree_gib"),
    ),
    ("docs/search.md", "18.4 GiB (3.33) | **36** |", "36", "retrieval.json", scale(WIKI18, "tantivy", "qps_single")),
    ("docs/search.md", "| **36** | 22 ms | **96 ms** |", "96", "retrieval.json", scale(WIKI18, "tantivy", "p99_ms")),
    ("docs/search.md", "| **bm25s** | **1,423 s** |", "1423", "retrieval.json", scale(WIKI18, "bm25s", "build_s")),
    (
        "docs/search.md",
        "with workers: **2.08**)",
        "2.08",
        "retrieval.json",
        scale(WIKI18, "bm25s", "build_peak_anon_tree_gib"),
    ),
    ("docs/search.md", "(12.95) | **229**;", "229", "retrieval.json", scale(WIKI18, "bm25s", "qps_single")),
    (
        "docs/search.md",
        "warm reruns **247-258** | 3.0 ms | **20 ms** |",
        "20",
        "retrieval.json",
        scale(WIKI18, "bm25s", "p99_ms"),
    ),
    (
        "docs/search.md",
        "warm reruns **247-258** | 3.0 ms | **20 ms** |",
        "3.0",
        "retrieval.json",
        scale(WIKI18, "bm25s", "p50_ms"),
    ),
    ("docs/search.md", "warm reruns **247-258**", "247", "retrieval.json", rerun(min)),
    ("docs/search.md", "warm reruns **247-258**", "258", "retrieval.json", rerun(max)),
    ("docs/search.md", "and **258, 247 and 255** in three reruns", "255", "retrieval.json", rerun(statistics.median)),
    (
        "bench/README.md",
        "anonymous memory, 229 queries/s on one core",
        "229",
        "retrieval.json",
        scale(WIKI18, "bm25s", "qps_single"),
    ),
    (
        "docs/search.md",
        "(3 minutes, default cache, before the compiled walk): 2,513",
        "2513",
        "retrieval.json",
        lambda d: d["soak_21m_bm25s_cached"]["queries_per_s"],
    ),
    (
        "docs/search.md",
        "2 workers): **305 queries/s through the service**",
        "305",
        "retrieval.json",
        lambda d: d["soak_21m_bm25s_uncached"]["queries_per_s"],
    ),
    (
        "docs/search.md",
        "46 of 3,475 requests timed out",
        "46",
        "retrieval.json",
        lambda d: d["soak_21m_bm25s_uncached"]["errors"],
    ),
    (
        "docs/search.md",
        "46 of 3,475 requests timed out",
        "3475",
        "retrieval.json",
        lambda d: d["soak_21m_bm25s_uncached"]["requests"],
    ),
    (
        "docs/search.md",
        "the same soak served 198 queries/s, and 60 of",
        "198",
        "retrieval.json",
        lambda d: d["soak_21m_bm25s_uncached_walk_only"]["queries_per_s"],
    ),
    (
        "docs/search.md",
        "| 1,000,000 | bm25s | 75 s |",
        "2164",
        "retrieval.json",
        scale(1_000_000, "bm25s", "qps_single"),
    ),
    ("docs/search.md", "| 5,000,000 | bm25s | 358 s |", "5.3", "retrieval.json", scale(5_000_000, "bm25s", "p99_ms")),
    (
        "docs/search.md",
        "| 5,000,000 | bm25s | 358 s |",
        "760",
        "retrieval.json",
        scale(5_000_000, "bm25s", "qps_single"),
    ),
    (
        "docs/search.md",
        "| 1,000,000 | tantivy | 67 s |",
        "669",
        "retrieval.json",
        scale(1_000_000, "tantivy", "qps_single"),
    ),
    (
        "docs/search.md",
        "with the default cache, 2,712 queries/s",
        "2712",
        "retrieval.json",
        lambda d: d["soak_21m_cached"]["queries_per_s"],
    ),
    (
        "docs/search.md",
        "without the cache (`cache_size=0`, 3 minutes), 40",
        "40",
        "retrieval.json",
        lambda d: d["soak_21m_uncached"]["queries_per_s"],
    ),
]


# bench/README.md's Lucene agreement table: (corpus, backend, k1, the row's cells from `questions` on)
LUCENE_SETTING = {1.2: "1.2, 0.75 (Lucene default)", 0.9: "0.9, 0.4 (pyserini default)"}
LUCENE_ROWS = [
    ("hotpotqa_dev500", "bm25s", 1.2, "500 | 0.987 | 0.942 | 0.654 | 0.654 | 29: 29 / 0 / 0 | 1.000 |"),
    ("hotpotqa_dev500", "rank_bm25", 1.2, "500 | 0.987 | 0.942 | 0.654 | 0.654 | 29: 29 / 0 / 0 | 1.000 |"),
    ("hotpotqa_dev500", "tantivy", 1.2, "500 | 1.000 | 1.000 | 0.654 | 0.654 | 0: 0 / 0 / 0 | 0.942 |"),
    ("toy_world", "tantivy", 1.2, "400 | 1.000 | 1.000 | 0.750 | 0.750 | 0: 0 / 0 / 0 | 1.000 |"),
    ("hotpotqa_dev500", "bm25s", 0.9, "500 | 0.990 | 0.946 | 0.649 | 0.647 | 27: 27 / 0 / 0 | 1.000 |"),
    ("hotpotqa_dev500", "rank_bm25", 0.9, "500 | 0.990 | 0.946 | 0.649 | 0.647 | 27: 27 / 0 / 0 | 1.000 |"),
    ("toy_world", "bm25s", 1.2, "400 | 1.000 | 1.000 | 0.750 | 0.750 | 0: 0 / 0 / 0 | 1.000 |"),
    ("toy_world", "rank_bm25", 1.2, "400 | 1.000 | 1.000 | 0.750 | 0.750 | 0: 0 / 0 / 0 | 1.000 |"),
    ("toy_world", "bm25s", 0.9, "400 | 1.000 | 1.000 | 0.750 | 0.750 | 0: 0 / 0 / 0 | 1.000 |"),
    ("toy_world", "rank_bm25", 0.9, "400 | 1.000 | 1.000 | 0.750 | 0.750 | 0: 0 / 0 / 0 | 1.000 |"),
]
LUCENE_KEYS = ["questions", "top3_overlap", "top3_identical", "recall3_dspo", "recall3_lucene", "differing"]
LUCENE_KEYS.append("top3_identical_vs_lucene_exact_lengths")
for corpus, backend, k1, cells in LUCENE_ROWS:
    row = f"| {corpus} | {LUCENE_SETTING[k1]} | {backend} | {cells}"
    numbers = [cell.strip().partition(":")[0] for cell in cells.strip("| ").split("|")]
    for key, number in zip(LUCENE_KEYS, numbers, strict=True):
        CITED.append(("bench/README.md", row, number, "lucene_agreement.json", agreement(corpus, backend, k1, key)))


@pytest.mark.parametrize(("doc", "text", "number", "results", "figure"), CITED, ids=[f"{c[0]}: {c[1]}" for c in CITED])
def test_cited_number_is_in_its_results_file(doc, text, number, results, figure) -> None:
    flat = lambda s: re.sub(r"\s+", " ", s)  # noqa: E731  the docs wrap lines
    assert flat(text) in flat((REPO / doc).read_text()), f"{doc} no longer cites {text!r}: update this test"
    decimals = len(number.partition(".")[2])
    value = figure(data(results))
    assert abs(value - float(number)) <= 0.5 * 10**-decimals + 1e-9, f"{doc} cites {number}, {results} has {value}"


def test_every_cited_performance_file_is_stamped() -> None:
    learning = {"correction.json", "agent_learning.json", "toy_deep.json", "toy_deep_warm.json"}
    learning.update({"compaction_learning.json", "partial_rollouts.json", "search_toy.json", "planner_front.json"})
    learning.update({"selfplay.json", "goal_reflect.json"})
    cited = {c[3] for c in CITED} - learning
    assert cited <= set(STAMPS), f"performance results cited but not stamped: {sorted(cited - set(STAMPS))}"


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except OSError:
        return None


@pytest.mark.parametrize("results", sorted(STAMPS))
def test_performance_results_say_what_they_were_measured_on(results: str) -> None:
    stamps = STAMPS[results](data(results))
    assert stamps and all(stamps), f"bench/results/{results} has no `measured` stamp: re-measure it (bench/README.md)"
    for stamp in stamps:
        commit = stamp.get("commit")
        assert commit and re.fullmatch(r"[0-9a-f]{40}", commit), f"{results}: no commit in {stamp}"
        assert stamp.get("source_changed") is False, f"{results} was measured on source that differed from {commit}"
        known = _git("cat-file", "-e", f"{commit}^{{commit}}")
        if known is None or known.returncode:  # no git, or a shallow clone without that commit
            continue
        ancestor = _git("merge-base", "--is-ancestor", commit, "HEAD")
        assert ancestor.returncode == 0, f"{results}: commit {commit[:12]} is not in this branch's history"


def test_provenance_names_the_commit_and_counts_documentation_as_no_source_change() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from _outputs import provenance
    finally:
        sys.path.remove(str(REPO / "bench"))
    stamp = provenance()
    head = _git("rev-parse", "HEAD")
    if head is None or head.returncode:
        pytest.skip("not a git checkout")
    assert stamp["commit"] == head.stdout.strip()
    changed = stamp["changed_paths"]
    assert stamp["source_changed"] is any(not p.endswith(".md") for p in changed)
