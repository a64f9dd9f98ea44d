"""LoRA against full fine-tuning (issue 44): the update's memory, step time and checkpoint size.

    python bench/lora.py [--shape qwen2.5-0.5b|tiny] [--rank 16] [--alpha 32] [--sequences 4] [--length 256]
                         [--micro-batch-size 2] [--repeats 2] [--device cpu|cuda] [--threads N]
    python bench/lora.py --shape tiny --sequences 2 --length 32 --repeats 1     # smoke (tests/bench/test_smoke.py)

Each mode runs in its own process, so that its peak memory starts from a clean baseline: a Qwen2 with random weights
at the shape (`qwen2.5-0.5b`: 24 layers, hidden 896, 14 query / 2 KV heads, MLP 4,864, 151,936 vocabulary, tied
embeddings: 494 M parameters), fp32, dropout off as `DSPOModule` has it; `lora` injects adapters of rank `--rank` on
the attention and MLP projections with dspo's own `add_adapters` (the full model stays, frozen). One step is what
`DSPOModule.training_step` does with M = 1 (as bench/train_step.py): per micro-batch `masked_token_logprobs`, the DSPO
loss and its backward, then the gradient clip and dspo's AdamW (`build_adamw`). Random token ids, the first quarter of
each sequence a prompt (not trained).

Measured per mode: parameters (all, and trainable) and their bytes, the gradients' and the AdamW state's bytes (the
tensors that exist after the backward and after the step), the peak memory of the first step (which allocates the
AdamW state) and of the steady steps (CUDA: `max_memory_allocated` above the level before the step; CPU: the peak
resident set size above it, sampled every 5 ms), the median step time of `--repeats` steps after the first, and the
size on disk of the checkpoint `DSPOModule` would write (its `state_dict` rule: with LoRA only the adapters, plus the
optimizer state), with `torch.save`.

Computed (no measurement): the memory of Qwen2.5-0.5B / 3B / 7B on one 80 GB GPU, full fine-tuning against LoRA, from
the exact parameter counts of models built on the meta device (docs/scaling.md quotes the table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _checks import require_measured  # bench/ is on sys.path when this script runs
from _outputs import add_output_arguments, output_path, provenance

# Qwen2.5 shapes (config.json of each model; the 7B one is shipped in data/tokenizers/qwen2.5/)
SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=176, vocab_size=2048, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip
GB = 1e9


def qwen2(shape: str, device: str = "cpu"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, use_cache=False)
    config._attn_implementation = "sdpa"
    with __import__("torch").device(device):
        return Qwen2ForCausalLM(config)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def batches(vocab: int, sequences: int, length: int, micro: int, seed: int) -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for start in range(0, sequences, micro):
        n = min(micro, sequences - start)
        ids = torch.randint(0, vocab, (n, length), generator=gen)
        mask = torch.zeros(n, length)
        mask[:, length // 4 :] = 1
        advantages = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
        out.append({"ids": ids, "attention": torch.ones_like(ids), "mask": mask, "advantages": advantages})
    return out


class Peak:
    """Peak memory above the level at entry: CUDA's allocator counter, or the sampled resident set size (CPU)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> Peak:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from train_step import PeakRSS

            self.rss = PeakRSS().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.base
        else:
            self.rss.__exit__(*exc)
            self.bytes = self.rss.peak - self.rss.base


def step(model, optimizer, micro: list[dict], device: str, record: dict | None = None) -> None:
    """One DSPO optimizer step (M = 1); `record` gets the bytes of the gradients and of the AdamW state."""
    import torch

    from dspo.algorithms.losses import OBJECTIVES, loss_normalizer, policy_loss
    from dspo.models.logprobs import masked_token_logprobs

    tokens = float(sum(b["mask"].sum() for b in micro))
    normalizer = loss_normalizer(OBJECTIVES["dspo"].normalizer_unit, sum(len(b["ids"]) for b in micro), tokens)
    for b in micro:
        b = {k: v.to(device) for k, v in b.items()}
        logprobs, _ = masked_token_logprobs(model, b["ids"], b["attention"], b["mask"])
        loss, _ = policy_loss("dspo", logprobs, logprobs.detach(), b["advantages"], b["mask"], normalizer=normalizer)
        loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    if record is not None:
        record["gradient_bytes"] = tensor_bytes(p.grad for p in trainable if p.grad is not None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    if record is not None:
        states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        record["optimizer_state_bytes"] = tensor_bytes(states)


def checkpoint_bytes(model, optimizer, lora: bool) -> int:
    """Bytes on disk of what DSPOModule's checkpoint holds: its state_dict rule (`DSPOModule._frozen_base_key`: with
    LoRA the frozen base is left out) and the optimizer state."""
    import torch

    from dspo.models.lora import is_adapter_key

    state = {f"policy.{k}": v for k, v in model.state_dict().items() if not lora or is_adapter_key(k)}
    with tempfile.TemporaryDirectory(prefix="dspo-bench-lora-") as tmp:
        path = Path(tmp) / "step.ckpt"
        torch.save({"state_dict": state, "optimizer_states": [optimizer.state_dict()]}, path)
        return path.stat().st_size


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this process: the figures of the module docstring."""
    import torch

    from dspo.models.lora import LoraConfig, add_adapters
    from dspo.training.module import OptimizerConfig, build_adamw, train_mode_without_dropout

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = qwen2(args.shape).to(args.device)
    train_mode_without_dropout(model)
    lora = args.worker == "lora"
    if lora:
        add_adapters(model, LoraConfig(r=args.rank, alpha=args.alpha))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_adamw(trainable, OptimizerConfig(lr=1e-5))
    micro = batches(model.config.vocab_size, args.sequences, args.length, args.micro_batch_size, args.seed)
    out = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "parameter_bytes": tensor_bytes(model.parameters()),
    }
    with Peak(args.device) as first:
        tic = time.perf_counter()
        step(model, optimizer, micro, args.device, record=out)
        out["first_step_s"] = time.perf_counter() - tic
    out["first_step_peak_bytes"] = first.bytes
    seconds, peaks = [], []
    for _ in range(args.repeats):
        with Peak(args.device) as peak:
            tic = time.perf_counter()
            step(model, optimizer, micro, args.device)
            seconds.append(time.perf_counter() - tic)
        peaks.append(peak.bytes)
    out["step_s"] = statistics.median(seconds)
    out["step_s_runs"] = seconds
    out["steady_peak_bytes"] = max(peaks)
    out["checkpoint_bytes"] = checkpoint_bytes(model, optimizer, lora)
    return out


def lora_parameters(model, rank: int, targets) -> int:
    """r · (in + out) for every linear layer whose name ends in one of `targets` (what peft injects)."""
    import torch

    return sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in targets
    )


def computed_plan(rank: int, tokens: int = 16384, head_rows: int = 1024) -> dict:
    """GB of each part on one GPU, no sharding, for Qwen2.5-0.5B/3B/7B. Full fine-tuning: fp32 master weights, their
    gradients and AdamW's two moments (16 B a parameter, docs/scaling.md's plan on one GPU), + an fp32 reference model
    when β > 0. LoRA: the frozen base in bf16 (`model.dtype=bfloat16`: a frozen weight has no update to round away),
    the adapters with their gradients and moments in fp32 (`add_adapters` makes them fp32), no reference. Activations
    (gradient checkpointing; LoRA's backward goes through the same layers) as docs/scaling.md: each layer's input
    (bf16), one recomputed MLP, the LM head's chunk; the vLLM engine's bf16 copy of the weights beside them."""
    from dspo.models.lora import QWEN2_TARGETS

    plan = {}
    for shape in ("qwen2.5-0.5b", "qwen2.5-3b", "qwen2.5-7b"):
        model = qwen2(shape, device="meta")
        params = sum(p.numel() for p in model.parameters())
        adapters = lora_parameters(model, rank, QWEN2_TARGETS)
        c = model.config
        activations = (
            c.num_hidden_layers * tokens * c.hidden_size * 2
            + 3 * tokens * c.intermediate_size * 2
            + 3 * head_rows * c.vocab_size * 4
        )
        plan[shape] = {
            "parameters": params,
            "lora_parameters": adapters,
            "full": {
                "weights_gb": 4 * params / GB,
                "gradients_gb": 4 * params / GB,
                "adamw_gb": 8 * params / GB,
                "reference_if_kl_gb": 4 * params / GB,
            },
            "lora": {
                "weights_gb": (2 * params + 4 * adapters) / GB,
                "gradients_gb": 4 * adapters / GB,
                "adamw_gb": 8 * adapters / GB,
                "reference_if_kl_gb": 0.0,
            },
            "activations_gb": activations / GB,
            "engine_weights_bf16_gb": 2 * params / GB,
        }
        for mode in ("full", "lora"):
            part = plan[shape][mode]
            part["training_state_gb"] = part["weights_gb"] + part["gradients_gb"] + part["adamw_gb"]
            part["with_activations_and_engine_weights_gb"] = (
                part["training_state_gb"] + plan[shape]["activations_gb"] + plan[shape]["engine_weights_bf16_gb"]
            )
    return plan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    add_output_arguments(parser, "lora.json")
    args = parser.parse_args(argv)
    if args.worker is None:
        args.output = output_path(parser, args, "lora.json")
    return args


def run_worker(mode: str, argv: list[str]) -> tuple[dict | None, str | None]:
    """(figures, None) from a `--worker mode` subprocess, or (None, the tail of its error)."""
    command = [sys.executable, __file__, *argv, "--worker", mode]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        return None, done.stderr or done.stdout
    return json.loads(done.stdout.strip().splitlines()[-1]), None


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(run_mode(args)))
        return
    measured = provenance()
    argv = [a for a in sys.argv[1:] if a != "--update-shipped"]
    modes, errors = {}, {}
    for mode in ("full", "lora"):
        modes[mode], errors[mode] = run_worker(mode, argv)
    plan = computed_plan(args.rank)
    report = {"measured": measured, "args": vars(args), "modes": modes, "computed_one_80gb_gpu": plan}
    print(f"\n{args.shape}, LoRA r = {args.rank} (alpha {args.alpha}), {args.sequences} x {args.length} tokens, "
          f"micro-batch {args.micro_batch_size}, {args.device}, median of {args.repeats}")  # fmt: skip
    rows = [
        ("parameters", lambda m: f"{m['parameters'] / 1e6:,.1f} M"),
        ("trainable", lambda m: f"{m['trainable_parameters'] / 1e6:,.2f} M"),
        ("parameter memory", lambda m: mib(m["parameter_bytes"])),
        ("gradients", lambda m: mib(m["gradient_bytes"])),
        ("AdamW state", lambda m: mib(m["optimizer_state_bytes"])),
        ("peak above the weights, first step", lambda m: mib(m["first_step_peak_bytes"])),
        ("peak above the weights, later steps", lambda m: mib(m["steady_peak_bytes"])),
        ("step time (median)", lambda m: f"{m['step_s']:.2f} s"),
        ("checkpoint on disk", lambda m: mib(m["checkpoint_bytes"])),
    ]  # fmt: skip
    print("| | full | LoRA |\n|---|---:|---:|")
    for name, show in rows:
        print(f"| {name} | " + " | ".join(show(modes[m]) if modes[m] else "FAILED" for m in ("full", "lora")) + " |")
    print(
        "\ncomputed, one 80 GB GPU (GB): training state (weights + gradients + AdamW) | + activations + engine weights"
    )
    for shape, p in plan.items():
        parts = [
            (m, p[m]["training_state_gb"], p[m]["with_activations_and_engine_weights_gb"]) for m in ("full", "lora")
        ]
        print(f"{shape}: " + "; ".join(f"{m} {state:.1f} | {total:.1f}" for m, state, total in parts))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.output}")
    keys = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "steady_peak_bytes", "step_s",
            "checkpoint_bytes")  # fmt: skip
    figures = {f"{m}.{k}": (modes[m] or {}).get(k) for m in ("full", "lora") for k in keys}
    figures = {k: (v or None) if not k.endswith("peak_bytes") else v for k, v in figures.items()}
    require_measured("lora", figures, errors=errors)


if __name__ == "__main__":
    main()
