"""dspo side of `bench/vs_trl.py`: time training rounds of the real Lightning loop (what `dspo-train` runs).

    .venv/bin/python bench/_dspo_side.py SPEC.json RESULT.json

Composes `conf/train.yaml` with Hydra's compose API and the overrides in SPEC (the orchestrator builds them: model,
QA file, algorithm variant, G, B, lengths), instantiates data, module, the environment callback and the trainer as
`dspo.train.build` (no checkpointing, no logger, no validation: TRL's side saves and logs nothing either), and
runs `trainer.fit` for warm-up + measured rounds. One round = one train batch: at its `on_train_batch_start` the
`RolloutCallback` pushes the weights into the in-process vLLM engine and samples groups until B pass the filter,
then `training_step` does the forward/backward passes and the AdamW step. `RoundClock`, first in the callback list,
times each batch and wraps the environment to read every round's rollout statistics, and the functions that do each
phase of a step to time them (`PHASES`; `other_s` is the rest: Lightning's loop, logging, Python).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


def prompt_digest(token_lists: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(token_lists).encode()).hexdigest()[:16]


# Phases of one step, each timed at a public seam (`RoundClock._wrap`); `other_s` is the rest of the step.
PHASES = {
    "push_s": "weight push into the engine (the engine's push_weights, dspo.engines)",
    "generate_s": "rollout: engine calls, reward, filter (the logged rollout/time_s)",
    "collate_s": "round building: advantages, bucketing, padding (the environment's hook less push and generation)",
    "forward_s": "logprob forward, entropy, correction weights, KL (DSPOModule.micro_batch_loss less the objective)",
    "loss_s": "objective and its statistics (the algorithm.loss record of dspo.algorithms.OBJECTIVES)",
    "backward_s": "backward passes (DSPOModule.manual_backward)",
    "clip_s": "gradient norm and clipping (last backward's end -> the optimizer step)",
    "optimizer_s": "AdamW step (torch optimizer step hooks)",
}
# Phases whose seam must have been entered at least once per step: a seam the code no longer calls measures 0 s,
# which would pass for a fast phase; the step's record says NaN instead, and bench/_checks.py fails the run.
TIMED = ("push_s", "loss_s", "backward_s", "optimizer_s")  # and micro_batch_loss (forward_s)


class PhaseTimer:
    """Accumulates the wall time spent in wrapped functions, per phase, and how often each ran, until `take()`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._open: dict[str, float] = {}

    def start(self, phase: str) -> None:
        self._open[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        self.seconds[phase] += time.perf_counter() - self._open.pop(phase)
        self.calls[phase] += 1

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any):
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - tic
                self.calls[phase] += 1

        return timed

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = {phase: self.seconds.get(phase, 0.0) for phase in self.seconds}
        calls = dict(self.calls)
        self.seconds.clear()
        self.calls.clear()
        return out, calls


def timed_objective(name: str, timer: PhaseTimer) -> None:
    """Replace the registered objective `name` by the same record whose loss is timed (`OBJECTIVES` is read at every
    micro-batch: `AlgorithmConfig.objective`), through the registry's public pop/add."""
    from dataclasses import replace

    from dspo.algorithms import OBJECTIVES

    record = OBJECTIVES.pop(name)
    if record is None:
        raise KeyError(f"objective {name!r} is not registered: {sorted(OBJECTIVES)}")
    OBJECTIVES.add(name, replace(record, loss=timer.wrap("loss_s", record.loss)))


def timed_push(timer: PhaseTimer) -> None:
    """Time `push_weights` of every engine class of dspo.engines (the Engine protocol's method)."""
    import inspect

    import dspo.engines as engines

    classes = [c for _, c in inspect.getmembers(engines, inspect.isclass) if c.__module__.startswith(engines.__name__)]
    patched = [c for c in classes if "push_weights" in vars(c) and not inspect.isabstract(c)]
    if not patched:
        raise AttributeError("no engine class in dspo.engines defines push_weights: update bench/_dspo_side.py")
    for cls in patched:
        cls.push_weights = timer.wrap("push_s", cls.push_weights)


class RoundClock(pl.Callback):
    """Wall time per train batch (= one round: weight push, rollout, reward, filter, update) and its rollout stats.

    `step_s`: this hook's on_train_batch_start -> on_train_batch_end (it runs before the environment callback's
    start hook, which samples the round); `cycle_s`: previous batch end -> this one (adds Lightning's loop overhead).
    The round's rollout statistics are what the environment callback logs (`rollout/*`, trainer.callback_metrics).
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.tic = self.last_end = self.update_start = self.backward_end = 0.0
        self.wrapped = False
        self.phases = PhaseTimer()

    def _wrap(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wrap = self.phases.wrap
        training_step = pl_module.training_step

        def marked_training_step(*args: Any, **kwargs: Any):
            self.update_start = time.perf_counter()  # the environment's hook (push, rollout, round) has run
            return training_step(*args, **kwargs)

        backward = wrap("backward_s", pl_module.manual_backward)

        def marked_backward(*args: Any, **kwargs: Any):
            try:
                return backward(*args, **kwargs)
            finally:
                self.backward_end = time.perf_counter()

        pl_module.training_step = marked_training_step
        pl_module.micro_batch_loss = wrap("micro_batch_loss_s", pl_module.micro_batch_loss)
        pl_module.manual_backward = marked_backward
        optimizer = pl_module.optimizers().optimizer

        def before_step(*_: Any) -> None:
            self.phases.seconds["clip_s"] += time.perf_counter() - self.backward_end
            self.phases.start("optimizer_s")

        optimizer.register_step_pre_hook(before_step)
        optimizer.register_step_post_hook(lambda *_: self.phases.stop("optimizer_s"))
        self.wrapped = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.wrapped:
            self._wrap(trainer, pl_module)
        self.phases.take()
        self.tic = self.update_start = self.backward_end = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch

        now = time.perf_counter()
        r = {
            k.removeprefix("rollout/"): float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith("rollout/")
        }
        seconds, calls = self.phases.take()
        generate = r.get("time_s", float("nan"))
        phases = {phase: seconds.get(phase, 0.0) for phase in PHASES}
        phases["generate_s"] = generate
        phases["collate_s"] = self.update_start - self.tic - phases["push_s"] - generate
        phases["forward_s"] = seconds.get("micro_batch_loss_s", 0.0) - phases["loss_s"]
        phases.update({p: float("nan") for p in TIMED if not calls.get(p)})
        phases.update({"forward_s": float("nan")} if not calls.get("micro_batch_loss_s") else {})
        sampled = r.get("groups_sampled", 0.0)
        trajectories = sampled * pl_module.algo.group_size
        step_s = now - self.tic
        self.steps.append(
            {
                "step_s": step_s,
                "cycle_s": now - self.last_end if self.last_end else float("nan"),
                **phases,
                "other_s": step_s - sum(phases.values()),
                "train_s": now - self.update_start,  # everything after the environment's hook
                "keep_rate": r.get("keep_rate", float("nan")),
                "groups_sampled": sampled,
                "engine_calls": r.get("engine_calls", float("nan")),
                "trajectories": trajectories,
                "tokens_per_traj": r.get("generated_tokens", float("nan")) / max(trajectories, 1),
                "reward_mean": r.get("sampled_reward_mean", float("nan")),
                "torch_threads": float(torch.get_num_threads()),
            }
        )
        self.last_end = now


def top_ops(profiler: Any, rows: int, by_shape: bool = False) -> list[dict[str, Any]]:
    """The operators with the most self CPU time over the whole run (all steps, warm-up included); `by_shape`: one
    row per operator and input shapes (`shapes`), which tells the LM head's `[rows, vocab]` passes and the
    `[vocab, hidden]` gradients apart from the engine's calls of the same operator."""
    events = sorted(
        profiler.key_averages(group_by_input_shape=by_shape), key=lambda e: e.self_cpu_time_total, reverse=True
    )
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_cpu_s": e.self_cpu_time_total / 1e6,
            "share": e.self_cpu_time_total / total,
            **({"shapes": str(e.input_shapes)} if by_shape else {}),
        }
        for e in events[:rows]
    ]


def agent_prompt_ids(cfg: Any, items: list) -> list[list[int]]:
    """The first prompt's token ids per item, as dspo's agent renders them from this configuration (chat template,
    tags, tool schemas): what the TRL side's prompts must hash to."""
    from hydra.utils import instantiate
    from transformers import AutoTokenizer

    from dspo.agent import build_agent

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    agent = build_agent(instantiate(cfg.rollout.agent), engine=None, tokenizer=tokenizer, env=instantiate(cfg.env))
    return [agent.first_prompt(item) for item in items]


def main(spec_path: str, result_path: str) -> None:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    os.environ["DSPO_NUM_THREADS"] = str(spec["threads"])
    from dspo.process.runtime import configure_allocator, configure_threads

    # as dspo-train on CPU (dspo.process.runtime.process_settings, for this whole process): in-process vLLM engine, the
    # allocator that keeps large blocks, torch threads = DSPO_NUM_THREADS
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    configure_allocator()
    configure_threads()
    from hydra import compose, initialize_config_dir

    from dspo.rollout.sampler import SamplingExhausted
    from dspo.train import CONF_DIR, build

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=spec["overrides"])
    pl.seed_everything(cfg.seed, workers=True)
    objects = build(cfg)  # what dspo-train instantiates (the overrides turn the logger and checkpoints off)
    trainer: pl.Trainer = objects["trainer"]
    module, datamodule = objects["module"], objects["datamodule"]
    clock = RoundClock()
    timed_objective(cfg.algorithm.loss, clock.phases)
    timed_push(clock.phases)
    trainer.callbacks.insert(0, clock)  # first, so its batch-start hook runs before the environment samples
    error, profiler = None, None
    if spec.get("profile"):  # operator-level view (it slows every step down: phase times of such a run are not kept)
        import torch

        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        profiler.__enter__()
    try:
        trainer.fit(module, datamodule=datamodule)
    except SamplingExhausted as exc:  # e.g. a model that never earns a reward: the filter keeps nothing
        error = f"SamplingExhausted: {exc}"
    finally:
        if profiler is not None:
            profiler.__exit__(None, None, None)
    import vllm

    prompt_ids = agent_prompt_ids(cfg, datamodule.sampler.items)
    result = {
        "steps": clock.steps,
        "error": error,
        "prompt_digest": prompt_digest(prompt_ids),
        "prompt_tokens_mean": sum(map(len, prompt_ids)) / max(len(prompt_ids), 1),
        "versions": {"vllm": vllm.__version__, "lightning": pl.__version__},
    }
    if profiler is not None:
        result["top_ops"] = top_ops(profiler, spec.get("profile_rows", 20))
        result["top_ops_by_shape"] = top_ops(profiler, spec.get("profile_rows", 20), by_shape=True)
    Path(result_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
