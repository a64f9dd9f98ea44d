"""TRL side of `bench/vs_trl.py`: time optimizer steps of TRL's `GRPOTrainer` in GSPO mode on CPU.

    bench/.trl-venv/bin/python bench/_trl_side.py SPEC.json RESULT.json

Runs inside the throwaway TRL environment that `vs_trl.py` builds (its `.pth` file puts dspo's environment on the path,
so torch, transformers and dspo are the very same installations). SPEC holds the model directory, the pre-rendered
prompts (the chat-template text dspo's agent builds), gold answers, G, B, micro-batch size, lengths, sampling and
optimizer settings. One TRL optimizer step = generate B x G completions with `model.generate` (stopping at the same
strings as dspo's agent), score them with dspo's subEM reward, one forward/backward per micro-batch, one AdamW step.
The wall time of every step is recorded by a `TrainerCallback`; RESULT gets the per-step records.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any


def prompt_digest(token_lists: list[list[int]]) -> str:
    """A short hash of the prompts' token ids (compared with dspo's to prove both sides see the same tokens)."""
    return hashlib.sha256(json.dumps(token_lists).encode()).hexdigest()[:16]


class StepRecorder:
    """Per-step bookkeeping filled by the reward function and the generate wrapper, read by the step callback."""

    def __init__(self, eos_ids: set[int]) -> None:
        self.eos_ids = eos_ids
        self.generate_s = 0.0
        self.tokens: list[int] = []
        self.rewards: list[float] = []

    def reset(self) -> None:
        self.generate_s, self.tokens, self.rewards = 0.0, [], []


def main(spec_path: str, result_path: str) -> None:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import accelerate
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dspo.env.rewards import extract_answer, subem_reward

    torch.manual_seed(int(spec["seed"]))
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    recorder = StepRecorder({tokenizer.eos_token_id, tokenizer.pad_token_id})

    # transformers' generate needs the tokenizer for stop strings; TRL does not pass it, so the model carries it.
    generate = model.generate

    def generate_with_stops(*args: Any, **kwargs: Any) -> Any:
        tic = time.perf_counter()
        out = generate(*args, tokenizer=tokenizer, **kwargs)
        recorder.generate_s += time.perf_counter() - tic
        return out

    model.generate = generate_with_stops

    def subem(completions: list[str], golden_answers: list[list[str]], completion_ids: list[list[int]], **_: Any):
        rewards = [subem_reward(extract_answer(text), gold) for text, gold in zip(completions, golden_answers)]
        recorder.rewards.extend(rewards)
        recorder.tokens.extend(sum(t not in recorder.eos_ids for t in ids) for ids in completion_ids)
        return rewards

    steps: list[dict[str, float]] = []

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step: `begin` = on_step_begin -> on_step_end (generation, reward, loss,
        backward, AdamW); `cycle` = previous on_step_end -> this one (adds logging and the data loader)."""

        def __init__(self) -> None:
            self.tic = self.last_end = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.tic = time.perf_counter()
            recorder.reset()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            n = max(len(recorder.tokens), 1)
            steps.append(
                {
                    "step_s": now - self.tic,
                    "cycle_s": now - self.last_end if self.last_end else float("nan"),
                    "generate_s": recorder.generate_s,
                    "train_s": now - self.tic - recorder.generate_s,
                    "trajectories": float(len(recorder.tokens)),
                    "tokens_per_traj": sum(recorder.tokens) / n,
                    "reward_mean": sum(recorder.rewards) / n,
                    "torch_threads": float(torch.get_num_threads()),
                }
            )
            self.last_end = now

    prompts = spec["prompts"]
    dataset = Dataset.from_dict({"prompt": prompts, "golden_answers": spec["golden_answers"]})
    token_lists = [tokenizer(text=p)["input_ids"] for p in prompts]
    batch = spec["group_size"] * spec["prompts_per_step"]
    micro, stop = spec["micro_batch_size"], spec["stop"]
    config = GRPOConfig(
        output_dir=str(Path(result_path).parent / "trl_output"),  # nothing is saved there (save_strategy="no")
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,  # steps_per_generation defaults to it: one generation per step
        num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        generation_kwargs={"pad_token_id": tokenizer.eos_token_id, **({"stop_strings": stop} if stop else {})},
        beta=0.0,
        num_iterations=1,
        importance_sampling_level="sequence",  # GSPO
        loss_type="grpo",  # per-sequence mean of a per-sequence ratio = GSPO's objective
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        scale_rewards="group",
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=spec["warmup"] + spec["steps"],
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        seed=int(spec["seed"]),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=subem,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    result = {
        "steps": steps,
        "prompt_digest": prompt_digest(token_lists),
        "prompt_tokens_mean": sum(map(len, token_lists)) / len(token_lists),
        "versions": {
            "trl": trl.__version__,
            "accelerate": accelerate.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torch_path": str(Path(torch.__file__).parent),
        },
    }
    Path(result_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
