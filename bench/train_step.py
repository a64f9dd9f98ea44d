"""Training-step cost: tokens/s, peak memory and padding share of one optimizer step on a round of trajectories.

    python bench/train_step.py [--groups 8] [--group-size 5] [--micro-batch-size 8] [--repeats 3]
                               [--hidden-size 192 --num-layers 3 --num-heads 3] [--device cpu|cuda]
                               [--micro-batch-tokens N] [--vocab toy|qwen]

What one step is: the work `DSPOModule.training_step` does for one mini-batch with M = 1 (fully on-policy): for every
micro-batch, logprobs at the trained positions (`masked_token_logprobs`, LM head in chunks), the DSPO sequence-level
clipped loss (`policy_loss("dspo", ...)`, normalizer = the whole mini-batch), backward; then gradient clipping and
one AdamW step. It calls the same functions as the module, without the Lightning loop around them, so the numbers are
the step's own cost.

The round: real multi-turn trajectories of the toy world (scripted demonstrations rendered by the real agent loop with
BM25 over the toy corpus: 1- and 2-hop questions, tool turns spliced as in RL), a share of them imperfect so lengths
vary as in a rollout. Two layouts of the same round are compared, alternated:
- `bucketed`: dspo's `build_round` (shuffle, then sort the mini-batch by length before cutting micro-batches; each
  micro-batch is padded only to its own longest sequence);
- `random`: the same micro-batch size, sequences in shuffled order (what a plain DataLoader would give);
- `tokens`: packed longest first into micro-batches of at most `--micro-batch-tokens` padded tokens
  (`algorithm.micro_batch_tokens`; default: the micro-batch size x the round's median length, the same mean budget).
`--vocab qwen` redraws every token id from Qwen2.5's 151k vocabulary (same lengths, masks and turns) and builds the
random model on that tokenizer: the LM head then dominates, as in real runs.

Against the machine's limit: the same run measures this machine's float32 matmul rate (`torch.mm` on the shapes of the
step's largest products: the LM head's and the MLP's, at the micro-batch's row count, and a square 2048 product; the
best is the limit) and counts the step's FLOPs with `torch.utils.flop_counter.FlopCounterMode` (matmuls and
attention, forward and backward: the arithmetic the update needs; elementwise work is not counted, as in MFU).
Attention is counted by this script's own formula (`attention_formulas`: the causal half of QKᵀ and PV), on every
device: torch counts none on CPU, so results measured before 2026-11-26 left it out; `efficiency_matmuls_only` is that
older figure. `efficiency` = counted FLOPs / step seconds / the limit (goal >= 0.5).

padding share = tokens computed on padding / all tokens computed (goal <= 10 %). tokens/s counts real tokens
(prompt + response) forwarded and backpropagated per second. Peak memory: on CUDA `max_memory_allocated`; on CPU the
peak resident set size above the level before the step, sampled every 5 ms (allocator caching makes it approximate).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance


class PeakRSS:
    """Peak resident memory above the level at entry, sampled in a background thread (CPU runs)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        import psutil

        self.process, self.interval_s = psutil.Process(), interval_s
        self.base = self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def delta_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def toy_trajectories(workdir: Path, count: int, seed: int) -> tuple[list, object]:
    """`count` rendered toy-world trajectories (30 % imperfect) and the toy tokenizer."""
    from dspo.data.qa import load_qa
    from dspo.toy.render import render_demonstrations, toy_retriever
    from dspo.toy.tokenizer import load_tokenizer
    from dspo.toy.warmstart import build_toy_tokenizer
    from dspo.toy.world import ToyWorldConfig, build_toyworld, load_world_meta

    world = build_toyworld(str(workdir / "world"), ToyWorldConfig(seed=seed))
    tokenizer = load_tokenizer(build_toy_tokenizer(world, str(workdir / "tokenizer")))
    items = load_qa(world.train, benchmark="toy", limit=count)
    agent = {"tag_format": "searchr1", "topk": 3, "max_turns": 3, "max_obs_tokens": 256}
    demos = render_demonstrations(items, load_world_meta(world), tokenizer, toy_retriever(world), 0.3, seed, agent)
    return demos, tokenizer


def as_groups(trajectories: list, group_size: int) -> list:
    """Groups of `group_size` trajectories with 0/1 rewards mixed inside each group (so every advantage is set).

    A real group shares one prompt; here its members come from different questions, which changes nothing in the
    step's cost but gives the round the length spread of a rollout over many questions."""
    from dspo.types import QAItem, RolloutGroup

    groups = []
    for g in range(len(trajectories) // group_size):
        members = trajectories[g * group_size : (g + 1) * group_size]
        for i, t in enumerate(members):
            t.reward = float(i % 2 == 0)
        item = QAItem(id=f"bench-{g}", question=members[0].question, golden_answers=members[0].golden_answers)
        groups.append(RolloutGroup(item=item, trajectories=members, prompt_index=g))
    return groups


def with_vocabulary(trajectories: list, vocab_size: int, seed: int) -> list:
    """The same trajectories (lengths, masks, turns) with token ids drawn at random from `vocab_size` ids: a large
    vocabulary's cost on a real rollout's length distribution."""
    from dataclasses import replace

    rng = random.Random(seed)
    return [
        replace(
            t,
            prompt_ids=[rng.randrange(vocab_size) for _ in t.prompt_ids],
            response_ids=[rng.randrange(vocab_size) for _ in t.response_ids],
        )
        for t in trajectories
    ]


def layouts(
    groups: list, micro_batch_size: int, pad_id: int, seed: int, micro_batch_tokens: int | None = None
) -> dict[str, list]:
    """Micro-batches of one round as dspo builds them (`bucketed`), in shuffled order (`random`), and packed by a token
    budget (`tokens`, algorithm.micro_batch_tokens) when one is given."""
    import torch

    from dspo.algorithms import group_advantages
    from dspo.data.round_builder import build_round, collate_trajectories

    bucketed = build_round(groups, 1, micro_batch_size, pad_id, policy_version=0, seed=seed).minibatches[0]
    advantages = group_advantages(torch.stack([g.rewards for g in groups]))
    flat = [(t, float(a)) for g, adv in zip(groups, advantages) for t, a in zip(g.trajectories, adv.tolist())]
    random.Random(seed).shuffle(flat)
    parts = [flat[i : i + micro_batch_size] for i in range(0, len(flat), micro_batch_size)]
    shuffled = [collate_trajectories([t for t, _ in p], [a for _, a in p], pad_id, 0) for p in parts]
    out = {"bucketed": bucketed, "random": shuffled}
    if micro_batch_tokens:
        packed = build_round(groups, 1, micro_batch_size, pad_id, 0, seed, micro_batch_tokens=micro_batch_tokens)
        out["tokens"] = packed.minibatches[0]
    return out


def matmul_rate(device: str, shapes: list[tuple[int, int, int]], repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` float32 `torch.mm` rate (FLOP/s) for each [m, k] @ [k, n] shape."""
    import torch

    rates = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            tic = time.perf_counter()
            torch.mm(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - tic)
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n / best
    return rates


ATTENTION_OPS = (  # (forward, backward) overloads of the fused attention kernels scaled_dot_product_attention picks
    ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
    ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"),
    ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
)


def causal_attention_flops(query_shape, key_shape, value_shape, backward: bool = False) -> int:
    """Matmul FLOPs of causal attention on [B, Hq, Lq, d] queries, [B, Hk, Lk, d] keys, [B, Hk, Lk, dv] values.

    Dense, the forward is QKᵀ and PV: 2·B·Hq·Lq·Lk·(d + dv); the backward's four products (dV, dP, dQ, dK) twice
    that. A causal LM needs each query against the keys up to it only, (Lk + 1) / 2Lk of the dense product when
    Lq = Lk (right-padded rows are counted whole: their padding is the padding share, reported apart)."""
    b, hq, lq, d = query_shape
    lk, dv = key_shape[-2], value_shape[-1]
    dense = 2 * b * hq * lq * lk * (d + dv) * (2 if backward else 1)
    return dense * (lk + 1) // (2 * lk) if lq == lk else dense


def attention_formulas() -> dict:
    """FlopCounterMode formulas (custom_mapping) for every fused attention kernel, counting the causal half.

    Why not torch's own: it counts attention only for the CUDA kernels, and dense; the CPU kernel
    (`_scaled_dot_product_flash_attention_for_cpu`) it does not count at all, so on CPU this script's efficiency
    used to leave the attention (~30 % of the toy step's time) out of the work done. Counted here alike on CPU and
    CUDA. Arguments arrive as shapes (FlopCounterMode's shape wrapper): forwards start (query, key, value),
    backwards (grad_out, query, key, value)."""
    import torch

    def forward(query, key, value, *_, **__):
        return causal_attention_flops(query, key, value)

    def backward(_grad_out, query, key, value, *_, **__):
        return causal_attention_flops(query, key, value, backward=True)

    formulas = {}
    for fwd, bwd in ATTENTION_OPS:
        if hasattr(torch.ops.aten, fwd):
            formulas[getattr(torch.ops.aten, fwd)] = forward
            formulas[getattr(torch.ops.aten, bwd)] = backward
    return formulas


def step_flops(model, optimizer, micro_batches: list, device: str) -> tuple[float, float]:
    """FLOPs of one optimizer step (matmuls and causal attention, forward and backward) and the attention's part."""
    from torch.utils.flop_counter import FlopCounterMode

    formulas = attention_formulas()
    with FlopCounterMode(display=False, custom_mapping=formulas) as counter:
        optimizer_step(model, optimizer, micro_batches, device)
    names = {str(op).split(".")[-1] for op in formulas}
    by_op = counter.get_flop_counts()["Global"]
    attention = sum(n for op, n in by_op.items() if str(op).split(".")[-1] in names)
    return float(counter.get_total_flops()), float(attention)


def optimizer_step(model, optimizer, micro_batches: list, device: str) -> None:
    """One DSPO optimizer step over `micro_batches` (the module's computation, see the module docstring)."""
    import torch

    from dspo.algorithms.losses import OBJECTIVES, loss_normalizer, policy_loss
    from dspo.models.logprobs import masked_token_logprobs

    micro = [b.to(device) for b in micro_batches]
    num_sequences = sum(len(b) for b in micro)
    num_tokens = float(sum(b.loss_mask.sum() for b in micro))
    normalizer = loss_normalizer(OBJECTIVES["dspo"].normalizer_unit, num_sequences, num_tokens)
    for batch in micro:
        logprobs, _ = masked_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
        loss, _ = policy_loss(
            "dspo", logprobs, logprobs.detach(), batch.advantages, batch.loss_mask, normalizer=normalizer
        )  # dspo's own clip range (3e-4, 4e-4)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(model, optimizer, micro_batches: list, device: str) -> dict[str, float]:
    import torch

    from dspo.data.round_builder import padding_share

    real = sum(int(b.attention_mask.sum()) for b in micro_batches)
    computed = sum(b.attention_mask.numel() for b in micro_batches)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as rss:
        tic = time.perf_counter()
        optimizer_step(model, optimizer, micro_batches, device)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - tic
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else rss.delta_mib
    return {
        "seconds": seconds,
        "tokens_per_s": real / seconds,
        "computed_tokens_per_s": computed / seconds,
        "padding_share": padding_share(micro_batches),
        "peak_mib": peak,
        "real_tokens": real,
        "computed_tokens": computed,
        "micro_batches": len(micro_batches),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8, help="B: groups per round (one mini-batch, M = 1)")
    parser.add_argument("--group-size", type=int, default=5, help="G: trajectories per group")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per layout (after one warm-up each)")
    parser.add_argument("--hidden-size", type=int, default=192)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--num-heads", type=int, default=3)
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=0,
        help="also the token-budget layout (algorithm.micro_batch_tokens); default: micro-batch size x the round's "
        "median length (the same mean budget); -1: leave it out",
    )
    parser.add_argument(
        "--vocab",
        choices=["toy", "qwen"],
        default="toy",
        help="qwen: a random model with Qwen2.5's 151k vocabulary on the same trajectories (ids redrawn)",
    )
    add_output_arguments(parser, "train_step.json", flag="--output")
    args = parser.parse_args(argv)
    args.output = output_path(parser, args, "train_step.json", flag="--output")
    return args


def main() -> None:
    args = parse_args()
    measured = provenance()

    import torch
    from transformers import AutoModelForCausalLM

    from dspo.toy.model import build_tiny_model
    from dspo.training.module import OptimizerConfig, build_adamw

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="dspo-bench-step-") as tmp:
        work = Path(tmp)
        trajectories, tokenizer = toy_trajectories(work, args.groups * args.group_size, args.seed)
        tokenizer_dir = str(work / "tokenizer")
        if args.vocab == "qwen":
            from transformers import AutoTokenizer

            tokenizer_dir = str(Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "qwen2.5")
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            trajectories = with_vocabulary(trajectories, len(tokenizer), args.seed)
        groups = as_groups(trajectories, args.group_size)
        model_dir = build_tiny_model(
            tokenizer_dir,
            str(work / "model"),
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_kv_heads=1,
            intermediate_size=args.hidden_size * 8 // 3,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).train()
        model.config.use_cache = False
    optimizer = build_adamw(list(model.parameters()), OptimizerConfig(lr=1e-6))  # as DSPOModule builds it
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    budget = args.micro_batch_tokens or int(args.micro_batch_size * statistics.median(lengths))
    args.micro_batch_tokens = None if budget < 0 else budget
    variants = layouts(groups, args.micro_batch_size, tokenizer.pad_token_id, args.seed, args.micro_batch_tokens)
    counted = {name: step_flops(model, optimizer, micro, args.device) for name, micro in variants.items()}
    flops = {name: total for name, (total, _) in counted.items()}
    rows = max(int(b.loss_mask.sum()) for b in variants["bucketed"])  # LM head rows of the largest micro-batch
    tokens = max(b.attention_mask.numel() for b in variants["bucketed"])
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    shapes = [(rows, hidden, vocab), (tokens, hidden, model.config.intermediate_size), (2048, 2048, 2048)]
    rates = matmul_rate(args.device, shapes)
    limit = max(rates.values())
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for micro in variants.values():  # warm-up (allocator, kernels) once per layout
        optimizer_step(model, optimizer, micro, args.device)
    for _ in range(args.repeats):  # A, B, A, B, ...: load drift hits both layouts alike
        for name, micro in variants.items():
            results[name].append(measure(model, optimizer, micro, args.device))

    summary = {name: _median(runs) for name, runs in results.items()}
    for name, s in summary.items():
        s["flops"] = flops[name]
        s["achieved_flops_per_s"] = flops[name] / s["seconds"]
        s["efficiency"] = s["achieved_flops_per_s"] / limit
        s["attention_flops"] = counted[name][1]
        # the figure as this script gave it before attention was counted (torch counts none on CPU): comparable to
        # results measured before 2026-11-26
        s["efficiency_matmuls_only"] = (flops[name] - counted[name][1]) / s["seconds"] / limit
    report = {
        "measured": measured,
        "machine": _machine(args.device),
        "args": vars(args),
        "parameters": sum(p.numel() for p in model.parameters()),
        "matmul_flops_per_s": rates,
        "matmul_limit_flops_per_s": limit,
        "efficiency": summary["bucketed"]["efficiency"],  # dspo's layout
        "sequence_lengths": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
        "summary": summary,
        "runs": results,
    }
    print(
        f"\n{args.groups} groups x {args.group_size} = {len(trajectories)} trajectories, lengths "
        f"{min(lengths)}-{max(lengths)} (median {statistics.median(lengths):.0f}), micro-batch {args.micro_batch_size},"
        f" token budget {args.micro_batch_tokens}, {report['parameters'] / 1e6:.2f}M parameters, vocabulary "
        f"{model.config.vocab_size:,}, {args.device}, median of {args.repeats}\n"
    )
    print("matmul rate (float32 torch.mm): " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in rates.items()))
    print(
        "| layout | micro-batches | step | tokens/s (real) | computed tokens/s | padding | peak memory | GFLOP/s "
        "| efficiency | without attention |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(
            f"| {name} | {s['micro_batches']:.0f} | {s['seconds']:.2f} s | {s['tokens_per_s']:,.0f} | "
            f"{s['computed_tokens_per_s']:,.0f} | "
            f"{100 * s['padding_share']:.1f} % | {s['peak_mib']:,.0f} MiB | {s['achieved_flops_per_s'] / 1e9:.1f} | "
            f"{s['efficiency']:.2f} | {s['efficiency_matmuls_only']:.2f} |"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2, default=str))  # args hold Paths
    print(f"\nwrote {args.output}")
    keys = ("seconds", "tokens_per_s", "padding_share", "efficiency", "attention_flops")
    figures = {f"{name}.{k}": s[k] for name, s in summary.items() for k in keys}
    figures.update({f"{name}.real_tokens": s["real_tokens"] or None for name, s in summary.items()})
    figures.update({f"{name}.flops": flops[name] or None for name in summary})
    require_measured("train_step", {**figures, "matmul_limit_flops_per_s": limit or None})


def _median(runs: list[dict]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _machine(device: str) -> dict:
    import torch

    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
    }


if __name__ == "__main__":
    main()
