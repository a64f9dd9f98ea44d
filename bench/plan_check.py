"""The memory plan's training-side terms against measured peak memory on this CPU (issue 72).

    python bench/plan_check.py                       # tiny, ~0.1B and Qwen2.5-0.5B shapes (about 10 min on 2 cores)
    python bench/plan_check.py --cases tiny-full     # smoke (tests/bench/test_smoke.py)

Each case runs in its own process (a clean baseline): a Qwen2 with random weights built from a config.json (the toy's
shipped warm start, a ~0.1B shape, data/model_configs/qwen2.5-0.5b: nothing downloaded), fp32 as on a CPU,
then two optimizer steps of what `DSPOModule.training_step` does (two micro-batches of `--sequences` x `--length`
random tokens, the last three quarters of each trained; `masked_token_logprobs`, the DSPO loss, backward, clip,
dspo's AdamW). Resident memory (RSS) is read after the model is built (parameters), after the first backward
the first optimizer step (AdamW moments, with what a first step allocates once), sampled every 5 ms through the second
step's forward and backward (its peak above the state it started with: activations, the LM head, gradients) and after
that backward (the gradients). The same quantities come from
`dspo.training.plan.memory_plan` for the same shape and settings; the table gives both and their ratio, and the
script exits non-zero when a case measured nothing or its whole peak's ratio (measured over planned) leaves
[0.85, 1.15] (the tiny model aside: its few MB are within the noise of the process's own allocations). Children run
with `--allocator live` by default (glibc returns freed blocks, so the resident set follows the live tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance

REPO = Path(__file__).resolve().parents[1]
# a ~0.1B Qwen2 shape (138 M parameters, 78 M of them the 151,936-row embedding), written here
SMALL = dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=2816, vocab_size=151936, tie_word_embeddings=True, model_type="qwen2",
             architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6, max_position_embeddings=4096)  # fmt: skip
MODELS = {
    "tiny": REPO / "data/toy_warmstart/model",
    "0.1b": None,  # SMALL, written to a temporary folder
    "0.5b": REPO / "data/model_configs/qwen2.5-0.5b",
}
CASES = {  # name: (model, LoRA rank or None, gradient checkpointing)
    "tiny-full": ("tiny", None, False),
    "0.1b-full": ("0.1b", None, False),
    "0.1b-checkpointing": ("0.1b", None, True),
    "0.1b-lora": ("0.1b", 16, False),
    "0.5b-full": ("0.5b", None, False),
}
TOLERANCE = 0.15
# live: glibc returns every freed block over 128 KiB at once, so the resident set follows the live tensors (what the
# plan counts); kept: glibc's defaults, whose adaptive threshold keeps freed blocks of up to 32 MiB in the heap (a real
# process's resident set also holds those; dspo-train's DSPO_MALLOC=keep keeps more, on purpose: docs/training.md)
ALLOCATORS = {"live": {"MALLOC_MMAP_THRESHOLD_": "131072"}, "kept": {}}


def model_dir(name: str, scratch: Path) -> Path:
    if MODELS[name] is not None:
        return MODELS[name]
    folder = scratch / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SMALL))
    return folder


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def planned(path: Path, rank: int | None, checkpointing: bool, args, trained: int) -> dict[str, int]:
    """The plan's training-side terms for this case (CPU, fp32, one process)."""
    from dspo.training.plan import PlanSettings, memory_plan
    from dspo.training.plan_config import model_shape

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    shape = model_shape(str(path), rank, targets if rank else ())
    settings = PlanSettings(
        device="CPU", device_bytes=1 << 40, on_gpu=False, shards=1, fsdp=False, ddp=False, master_bytes=4,
        compute_bytes=4, lora=rank is not None, reference=False, gradient_checkpointing=checkpointing,
        micro_tokens=args.sequences * args.length, sequence_tokens=args.length, trained_tokens=trained,
        head_chunk_rows=args.chunk, reserve_bytes=0,
    )  # fmt: skip
    plan = memory_plan(shape, settings)
    by_name = {t.name: t.bytes for t in plan.terms}
    params = by_name.get("parameters", 0) + by_name.get("frozen base", 0) + by_name.get("adapters", 0)
    update = sum(t.bytes for t in plan.terms if t.phases == frozenset({"update"}))
    return {
        "parameters": params,
        "gradients": by_name["gradients"],
        "adamw": by_name["AdamW moments"],
        "step_peak": update,  # what the update adds to the state it starts with (gradients included)
        "total": params + by_name["AdamW moments"] + update,
    }


def run_case(args) -> dict:
    """One case in this process: measured and planned bytes."""
    import threading
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dspo.algorithms.losses import OBJECTIVES, loss_normalizer, policy_loss
    from dspo.models.logprobs import WORKSPACE, masked_token_logprobs
    from dspo.models.lora import LoraConfig, add_adapters
    from dspo.training.module import OptimizerConfig, build_adamw, train_mode_without_dropout

    torch.set_num_threads(args.threads)
    name, rank, checkpointing = CASES[args.case]
    path = model_dir(name, Path(args.scratch))
    torch.manual_seed(0)
    base = rss()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    train_mode_without_dropout(model)
    if rank:
        add_adapters(model, LoraConfig(r=rank))
    measured = {"parameters": rss() - base}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_adamw(trainable, OptimizerConfig(lr=1e-5, fused=False))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    micro = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (args.sequences, args.length), generator=gen)
        mask = torch.zeros(args.sequences, args.length)
        mask[:, args.length // 4 :] = 1
        micro.append((ids, mask))
    trained = int(micro[0][1][:, 1:].sum())

    def backward() -> None:
        normalizer = loss_normalizer(OBJECTIVES["dspo"].normalizer_unit, 2 * args.sequences, 2.0 * trained)
        for ids, mask in micro:
            logprobs, _ = masked_token_logprobs(model, ids, torch.ones_like(ids), mask, chunk_size=args.chunk)
            advantages = torch.where(torch.arange(len(ids)) % 2 == 0, 1.0, -1.0)
            loss, _ = policy_loss("dspo", logprobs, logprobs.detach(), advantages, mask, normalizer=normalizer)
            loss.backward()

    before = rss()
    backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    WORKSPACE.clear()
    measured["adamw"] = rss() - before  # and whatever the first step allocates once (kernels' caches)
    state = rss()
    peak = [state]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    backward()
    stop.set()
    sampler.join()
    WORKSPACE.clear()
    measured["gradients"] = rss() - state  # the second step's, before the optimizer frees them
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    measured["step_peak"] = max(peak[0], rss()) - state
    measured["total"] = max(peak[0], rss()) - base
    plan = planned(path, rank, checkpointing, args, trained)
    return {"case": args.case, "trained_positions_per_micro_batch": trained, "measured": measured, "planned": plan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--sequences", type=int, default=2, help="sequences per micro-batch (two micro-batches a step)")
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--chunk", type=int, default=1024, help="algorithm.logprob_chunk_size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--allocator", choices=list(ALLOCATORS), default="live", help="see ALLOCATORS in the source")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a process of its own
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)  # the ~0.1B config.json's folder
    add_output_arguments(parser, "plan_check.json")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args)))
        return
    results = []
    scratch = tempfile.TemporaryDirectory(prefix="dspo-plan-check-")
    args.scratch = args.scratch or scratch.name
    for case in args.cases:
        command = [sys.executable, __file__, "--case", case, *_passed(args)]
        env = {**os.environ, **ALLOCATORS[args.allocator]}
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
        if done.returncode != 0:
            require_measured("plan_check", {case: None}, errors={case: done.stderr[-3000:]})
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(table(results))
    report = {"cases": results, "settings": {k: v for k, v in vars(args).items() if k != "out"}, **provenance()}
    out = output_path(parser, args, "plan_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out}")
    ratios = {r["case"]: r["measured"]["total"] / r["planned"]["total"] for r in results}
    outside = {c: round(x, 3) for c, x in ratios.items() if abs(x - 1) > TOLERANCE and not c.startswith("tiny")}
    figures = {f"{r['case']}.{k}": v for r in results for k, v in r["measured"].items()}
    require_measured("plan_check", figures, errors={"outside_tolerance": str(outside)} if outside else None)


def _passed(args) -> list[str]:
    return ["--sequences", str(args.sequences), "--length", str(args.length), "--chunk", str(args.chunk),
            "--threads", str(args.threads), "--scratch", args.scratch]  # fmt: skip


def table(results: list[dict]) -> str:
    lines = ["| case | term | planned MB | measured MB | measured / planned |", "|---|---|---:|---:|---:|"]
    for r in results:
        for term in ("parameters", "gradients", "adamw", "step_peak", "total"):
            p, m = r["planned"][term], r["measured"][term]
            lines.append(
                f"| {r['case']} | {term} | {p / 1e6:,.1f} | {m / 1e6:,.1f} | {m / p if p else float('nan'):.3f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
