"""`python -m dspo.gpu_check`: does dspo's GPU path work on this machine (no vLLM needed)? One JSON of results.

    python -m dspo.gpu_check                                  # CUDA: real shapes, writes outputs/gpu_check/cuda.json
    python -m dspo.gpu_check --cpu                            # the same code on the CPU with small shapes (the tests)
    python -m dspo.gpu_check --output bench/results/gpu_check.json --parts head,fsdp,train

Parts (`--parts`, all by default):
- `head`: `HeadLogprobs` (the LM head's hand-written backward) against autograd's path, in fp32 and in bf16 under
  autocast: logprobs, gradients of the hidden states and of the head's weight, with tolerances per dtype.
- `fsdp`: bf16-mixed optimizer steps (autocast over fp32 weights, fused AdamW, gradient clipping) of a randomly
  initialised Qwen2-architecture model of Qwen2.5-0.5B's shape (151,936-token vocabulary) sharded with FSDP2 on one
  device, through the same functions `DSPOModule` uses (`shard_for_logprobs`, `policy_loss`, `clip_grad_norm`,
  `build_adamw`); its FLOP/s (FLOPs counted by `FlopCounterMode`) against a bf16 matmul measured in the same run.
- `train`: `dspo-train` on the toy default with the HF rollout engine on the device (`rollout=hf`), as a subprocess:
  10 steps on CUDA (bf16-mixed), 2 shortened steps on the CPU.

Exit status 0 when every part passed, 1 otherwise. `--cpu` runs on any machine; without `--cpu` CUDA is required.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

QWEN2_LAYER = "transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer"


@dataclass(frozen=True)
class Shapes:
    """Sizes of one mode. The CUDA model is Qwen2.5-0.5B's shape (its config.json), randomly initialised."""

    head_rows: int
    head_hidden: int
    head_vocab: int
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    micro_batches: int
    sequences: int  # per micro-batch
    length: int  # tokens per sequence, the last `response` of them trained
    response: int
    matmul: int  # n of the n x n x n bf16 reference product
    train_steps: int


CUDA = Shapes(1024, 896, 151_936, 151_936, 896, 4864, 24, 14, 2, 2, 4, 1024, 768, 8192, 10)
CPU = Shapes(12, 32, 300, 2048, 64, 128, 2, 4, 2, 2, 2, 48, 32, 512, 2)
# The shortened toy default of the CPU mode (as tests/conftest.py's SHORT_DEFAULT)
CPU_TRAIN = [
    "algorithm.group_size=4",
    "algorithm.batch_groups=2",
    "algorithm.micro_batch_size=4",
    "data.val_limit=8",
    "data.test_limit=8",
    "trainer.val_check_interval=2",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------------ head
def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: one number per tensor, meaningful for bf16 and fp32 alike."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def check_head(device: torch.device, shapes: Shapes, seed: int = 0) -> dict[str, Any]:
    """HeadLogprobs vs autograd (`_autograd_head_logprobs`) in fp32 and under bf16 autocast."""
    from dspo.models.logprobs import HeadLogprobs, _autograd_head_logprobs

    tolerance = {"fp32": 1e-4, "bf16-autocast": 2e-2}  # bf16: products of 8-bit mantissas, summed in another order
    results: dict[str, Any] = {}
    for mode, limit in tolerance.items():
        torch.manual_seed(seed)
        head = torch.nn.Linear(shapes.head_hidden, shapes.head_vocab, bias=False, device=device)
        hidden = torch.randn(shapes.head_rows, shapes.head_hidden, device=device, requires_grad=True)
        targets = torch.randint(0, shapes.head_vocab, (shapes.head_rows,), device=device)
        upstream = torch.randn(shapes.head_rows, device=device)
        out = {}
        for path in ("fused", "autograd"):
            hidden.grad, head.weight.grad = None, None
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode != "fp32"):
                if path == "fused":
                    logprobs, _ = HeadLogprobs.apply(hidden, head.weight, None, targets, 0.9, False)
                else:
                    logprobs, _ = _autograd_head_logprobs(head, hidden, targets, 0.9, False)
            (logprobs * upstream).sum().backward()
            out[path] = (logprobs.detach(), hidden.grad.clone(), head.weight.grad.clone())
        errors = {
            name: _relative_error(got, want)
            for name, got, want in zip(("logprobs", "grad_hidden", "grad_weight"), out["fused"], out["autograd"])
        }
        results[mode] = {"relative_error": errors, "tolerance": limit, "passed": max(errors.values()) <= limit}
    results["passed"] = all(r["passed"] for r in results.values() if isinstance(r, dict))
    return results


# ------------------------------------------------------------------------------------------------------ fsdp
def bf16_matmul_rate(device: torch.device, n: int, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of an n x n x n bf16 `torch.mm`: this device's reachable matmul rate."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.mm(a, b)  # warm-up (library initialisation, kernel choice)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        tic = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - tic)
    return 2 * n**3 / best


def random_qwen2(shapes: Shapes, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Qwen2 causal LM of `shapes`, fp32 (master weights), dropout-free, in train mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dspo.training.module import train_mode_without_dropout

    config = Qwen2Config(
        vocab_size=shapes.vocab,
        hidden_size=shapes.hidden,
        intermediate_size=shapes.intermediate,
        num_hidden_layers=shapes.layers,
        num_attention_heads=shapes.heads,
        num_key_value_heads=shapes.kv_heads,
        max_position_embeddings=max(shapes.length, 64),
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        use_cache=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).float()
    train_mode_without_dropout(model)
    return model


def _micro_batches(shapes: Shapes, device: torch.device, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(shapes.micro_batches):
        ids = torch.randint(0, shapes.vocab, (shapes.sequences, shapes.length), generator=generator)
        loss_mask = torch.zeros(shapes.sequences, shapes.length)
        loss_mask[:, shapes.length - shapes.response :] = 1
        advantages = torch.randn(shapes.sequences, generator=generator)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask, "adv": advantages}
        batches.append({k: v.to(device) for k, v in batch.items()})
    return batches


def _optimizer_step(runner, model, optimizer, batches: list[dict[str, torch.Tensor]], device: torch.device) -> float:
    """One DSPO optimizer step as `DSPOModule.training_step` takes it under bf16-mixed: forward under autocast,
    backward outside it, the whole mini-batch as normalizer, global-norm clipping, AdamW."""
    from dspo.algorithms import OBJECTIVES, policy_loss
    from dspo.algorithms.blocks import loss_normalizer
    from dspo.models.fsdp import clip_grad_norm

    tokens = float(sum(b["loss_mask"].sum() for b in batches))
    normalizer = loss_normalizer(OBJECTIVES["dspo"].normalizer_unit, sum(len(b["adv"]) for b in batches), tokens)
    total = 0.0
    for batch in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logprobs, _ = runner(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], 1.0, 1024)
        loss, _ = policy_loss(  # dspo's own clip range (its record's defaults)
            "dspo", logprobs, logprobs.detach(), batch["adv"], batch["loss_mask"], normalizer=normalizer
        )
        loss.backward()
        total += float(loss.detach())
    clip_grad_norm([p for p in model.parameters() if p.grad is not None], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_fsdp_step(device: torch.device, shapes: Shapes, timed_steps: int = 2) -> dict[str, Any]:
    """bf16-mixed optimizer steps of a random Qwen2 under FSDP2 on one device (a one-process group); FLOP/s of the
    step against the bf16 matmul rate measured here. One warm-up step, then `timed_steps` timed ones (the best)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.utils.flop_counter import FlopCounterMode

    from dspo.models.fsdp import shard_for_logprobs
    from dspo.training.module import OptimizerConfig, build_adamw

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("data_parallel",))
        model = random_qwen2(shapes, device)
        parameters = sum(p.numel() for p in model.parameters())
        runner = shard_for_logprobs(model, mesh, [QWEN2_LAYER])
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        optimizer = build_adamw(list(model.parameters()), OptimizerConfig(lr=1e-6))
        batches = _micro_batches(shapes, device)
        first_loss = _optimizer_step(runner, model, optimizer, batches, device)  # warm-up
        with FlopCounterMode(display=False) as counter:
            _optimizer_step(runner, model, optimizer, batches, device)
        flops = float(counter.get_total_flops())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = []
        for _ in range(timed_steps):
            _sync(device)
            tic = time.perf_counter()
            loss = _optimizer_step(runner, model, optimizer, batches, device)
            _sync(device)
            seconds.append(time.perf_counter() - tic)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    finally:
        dist.destroy_process_group()
    matmul = bf16_matmul_rate(device, shapes.matmul)
    step_rate = flops / min(seconds)
    finite = all(math.isfinite(x) for x in (first_loss, loss))
    return {
        "parameters": parameters,
        "sharded_fsdp2": sharded,
        "shapes": {k: v for k, v in asdict(shapes).items() if not k.startswith(("head_", "train_"))},
        "step_seconds": seconds,
        "step_flops": flops,
        "step_flops_per_s": step_rate,
        "bf16_matmul_flops_per_s": matmul,
        "fraction_of_matmul_rate": step_rate / matmul,
        "peak_memory_gib": peak,
        "loss_finite": finite,
        "passed": finite and sharded and flops > 0,
    }


# ------------------------------------------------------------------------------------------------------ train
def train_command(cuda: bool, steps: int, run_name: str = "gpu_check") -> list[str]:
    """`dspo-train` on the toy default with the HF engine on the device: the run `check_training` starts."""
    device = ["rollout.engine.device=cuda", "trainer.accelerator=gpu", "+trainer.precision=bf16-mixed"]
    cpu = ["rollout.engine.device=cpu", "trainer.accelerator=cpu", *CPU_TRAIN]
    return [
        sys.executable,
        "-m",
        "dspo.train",
        "rollout=hf",
        *(device if cuda else cpu),
        f"trainer.max_steps={steps}",
        f"run_name={run_name}",
    ]


def check_training(cuda: bool, steps: int, outputs: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `train_command` with DSPO_OUTPUTS=`outputs`; the run's exit status, time, steps and test scores."""
    import os

    outputs.mkdir(parents=True, exist_ok=True)
    command = train_command(cuda, steps)
    env = {**(env or os.environ), "DSPO_OUTPUTS": str(outputs)}
    log_file = outputs / "dspo-train.log"
    tic = time.perf_counter()
    with open(log_file, "w") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600).returncode
    seconds = time.perf_counter() - tic
    runs = sorted((outputs / "train").glob("gpu_check_*/metrics.yaml"))
    metrics: dict[str, float] = {}
    if runs:
        import yaml

        metrics = yaml.safe_load(runs[-1].read_text()) or {}
    step = None
    if runs and (runs[-1].parent / "checkpoints" / "last.ckpt").exists():
        step = torch.load(runs[-1].parent / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        step = step["global_step"]
    return {
        "command": " ".join(command[1:]),
        "exit_code": code,
        "seconds": seconds,
        "global_step": step,
        "metrics": {k: v for k, v in metrics.items() if k.startswith(("test/", "val/subem_mean"))},
        "log": str(log_file),
        "log_tail": "" if code == 0 else log_file.read_text()[-3000:],
        "passed": code == 0 and step == steps,
    }


# ------------------------------------------------------------------------------------------------------ main
def environment(device: torch.device) -> dict[str, Any]:
    import importlib.util

    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "vllm_installed": importlib.util.find_spec("vllm") is not None,
    }
    for name in ("transformers", "lightning"):
        info[name] = __import__(name).__version__
    return info


def run(cpu: bool, parts: list[str], output: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Every part asked for; the results (also written to `output` as JSON)."""
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible; use --cpu for the CPU mode")
    device, shapes = (torch.device("cpu"), CPU) if cpu else (torch.device("cuda", 0), CUDA)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results: dict[str, Any] = {"mode": device.type, "environment": environment(device), "started": time.ctime()}
    if "head" in parts:
        results["head_logprobs"] = check_head(device, shapes)
    if "fsdp" in parts:
        results["fsdp_step"] = check_fsdp_step(device, shapes)
    if "train" in parts:
        results["train"] = check_training(not cpu, shapes.train_steps, output.parent / f"{output.stem}-runs", env)
    results["passed"] = all(results[k]["passed"] for k in ("head_logprobs", "fsdp_step", "train") if k in results)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU mode: small shapes, fp32 training run")
    parser.add_argument("--parts", default="head,fsdp,train", help="comma-separated subset of head,fsdp,train")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default outputs/gpu_check/<mode>.json)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"head", "fsdp", "train"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from head,fsdp,train")
    output = args.output or Path("outputs/gpu_check") / ("cpu.json" if args.cpu else "cuda.json")
    results = run(args.cpu, parts, output)
    for part in ("head_logprobs", "fsdp_step", "train"):
        if part in results:
            print(f"{part:14s} {'passed' if results[part]['passed'] else 'FAILED'}")
    if "fsdp_step" in results:
        step = results["fsdp_step"]
        print(
            f"FSDP2 step: {step['step_flops_per_s'] / 1e12:.3g} TFLOP/s = {step['fraction_of_matmul_rate']:.2f} of "
            f"the bf16 matmul rate ({step['bf16_matmul_flops_per_s'] / 1e12:.3g} TFLOP/s)"
        )
    print(f"results: {output}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
