"""dspo side of `bench/vs_trl.py`: time training rounds of the real Lightning loop (what `dspo-train` runs).

    .venv/bin/python bench/_dspo_side.py SPEC.json RESULT.json

Composes `conf/train.yaml` with Hydra's compose API and the overrides in SPEC (the orchestrator builds them: model,
QA file, algorithm variant, G, B, lengths), instantiates data, module, the environment callback and the trainer as
`dspo.train.build` (no checkpointing, no logger, no validation: TRL's side saves and logs nothing either), and
runs `trainer.fit` for warm-up + measured rounds. One round = one train batch: at its `on_train_batch_start` the
`EnvironmentCallback` pushes the weights into the in-process vLLM engine and samples groups until B pass the filter,
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


# Phases of one step, each the wall time of the function(s) that do it (wrapped by `RoundClock._wrap`).
PHASES = {
    "push_s": "weight push into the engine (LocalEngine.push -> engine.push_weights)",
    "generate_s": "rollout: engine calls, reward, filter (RolloutEnvironment.sample_round)",
    "collate_s": "round building: advantages, bucketing, padding (dspo.data.buffer.build_round)",
    "forward_s": "logprob forwards: policy (with entropy), old / reference when they apply (DSPOModule._logprobs)",
    "loss_s": "objective and its statistics (dspo.algorithms.losses.policy_loss)",
    "backward_s": "backward passes (DSPOModule.manual_backward)",
    "clip_s": "gradient norm and clipping (DSPOModule._clip_gradients)",
    "optimizer_s": "AdamW step (torch optimizer step hooks)",
}


class PhaseTimer:
    """Accumulates the wall time spent in wrapped functions, per phase, until `take()`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: dict[str, float] = {}

    def start(self, phase: str) -> None:
        self._open[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        self.seconds[phase] += time.perf_counter() - self._open.pop(phase)

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any):
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - tic

        return timed

    def take(self) -> dict[str, float]:
        out = {phase: self.seconds.get(phase, 0.0) for phase in PHASES}
        self.seconds.clear()
        return out


class RoundClock(pl.Callback):
    """Wall time per train batch (= one round: weight push, rollout, reward, filter, update) and its rollout stats.

    `step_s`: this hook's on_train_batch_start -> on_train_batch_end (it runs before the environment callback's
    start hook, which samples the round); `cycle_s`: previous batch end -> this one (adds Lightning's loop overhead).
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.tic = self.last_end = 0.0
        self.round: dict[str, float] = {}
        self.wrapped = False
        self.prompt_ids: list[list[int]] = []
        self.phases = PhaseTimer()

    def _wrap(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import dspo.callbacks.environment_callback as env_module
        import dspo.module as module_module
        import dspo.rollout.producer as producer_module

        env_cb = next(c for c in trainer.callbacks if isinstance(c, env_module.EnvironmentCallback))
        side = env_cb.producer.side  # the in-process engine (bench runs at max_staleness 0)
        sample_round = side.environment.sample_round

        def reading_sample_round(*args: Any, **kwargs: Any):
            groups, stats = sample_round(*args, **kwargs)
            self.round.update({k.removeprefix("rollout/"): float(v) for k, v in stats.items()})
            return groups, stats

        wrap = self.phases.wrap
        side.environment.sample_round = wrap("generate_s", reading_sample_round)
        side.engine.push_weights = wrap("push_s", side.engine.push_weights)
        producer_module.build_round = wrap("collate_s", producer_module.build_round)
        module_module.policy_loss = wrap("loss_s", module_module.policy_loss)
        methods = {"_logprobs": "forward_s", "manual_backward": "backward_s", "_clip_gradients": "clip_s"}
        for name, phase in methods.items():
            setattr(pl_module, name, wrap(phase, getattr(pl_module, name)))
        optimizer = pl_module.optimizers().optimizer
        optimizer.register_step_pre_hook(lambda *_: self.phases.start("optimizer_s"))
        optimizer.register_step_post_hook(lambda *_: self.phases.stop("optimizer_s"))
        items = trainer.datamodule.sampler.items
        self.prompt_ids = [side.agent.prompt_ids(item) for item in items]
        self.wrapped = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.wrapped:
            self._wrap(trainer, pl_module)
        self.round = {}
        self.phases.take()
        self.tic = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch

        now = time.perf_counter()
        r = self.round
        sampled = r.get("groups_sampled", 0.0)
        group_size = pl_module.algo.group_size
        tokens = r.get("tokens_per_s", 0.0) * r.get("time_s", 0.0)
        phases = self.phases.take()
        step_s = now - self.tic
        self.steps.append(
            {
                "step_s": step_s,
                "cycle_s": now - self.last_end if self.last_end else float("nan"),
                **phases,
                "other_s": step_s - sum(phases.values()),
                "train_s": step_s - phases["generate_s"] - phases["push_s"],  # everything after the rollout
                "keep_rate": r.get("keep_rate", float("nan")),
                "groups_sampled": sampled,
                "engine_calls": r.get("engine_calls", float("nan")),
                "trajectories": sampled * group_size,
                "tokens_per_traj": tokens / max(sampled * group_size, 1),
                "reward_mean": r.get("sampled_reward_mean", float("nan")),
                "torch_threads": float(torch.get_num_threads()),
            }
        )
        self.last_end = now


def top_ops(profiler: Any, rows: int) -> list[dict[str, Any]]:
    """The operators with the most self CPU time over the whole run (all steps, warm-up included)."""
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_cpu_s": e.self_cpu_time_total / 1e6,
            "share": e.self_cpu_time_total / total,
        }
        for e in events[:rows]
    ]


def main(spec_path: str, result_path: str) -> None:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    os.environ["DSPO_NUM_THREADS"] = str(spec["threads"])
    from dspo.runtime import configure_allocator, configure_threads

    # as dspo-train on CPU (dspo.runtime.process_settings, for this whole process): in-process vLLM engine, the
    # allocator that keeps large blocks, torch threads = DSPO_NUM_THREADS
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    configure_allocator()
    configure_threads()
    from hydra import compose, initialize_config_dir

    from dspo.rollout.environment import SamplingExhausted
    from dspo.train import CONF_DIR, build

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=spec["overrides"])
    pl.seed_everything(cfg.seed, workers=True)
    objects = build(cfg)  # what dspo-train instantiates (the overrides turn the logger and checkpoints off)
    trainer: pl.Trainer = objects["trainer"]
    module, datamodule = objects["module"], objects["datamodule"]
    clock = RoundClock()
    trainer.callbacks.insert(0, clock)  # first, so its batch-start hook runs before the environment samples
    error, profiler = None, None
    if spec.get("profile"):  # operator-level view (it slows every step down: phase times of such a run are not kept)
        import torch

        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    try:
        trainer.fit(module, datamodule=datamodule)
    except SamplingExhausted as exc:  # e.g. a model that never earns a reward: the filter keeps nothing
        error = f"SamplingExhausted: {exc}"
    finally:
        if profiler is not None:
            profiler.__exit__(None, None, None)
    import vllm

    result = {
        "steps": clock.steps,
        "error": error,
        "prompt_digest": prompt_digest(clock.prompt_ids),
        "prompt_tokens_mean": sum(map(len, clock.prompt_ids)) / max(len(clock.prompt_ids), 1),
        "versions": {"vllm": vllm.__version__, "lightning": pl.__version__},
    }
    if profiler is not None:
        result["top_ops"] = top_ops(profiler, spec.get("profile_rows", 20))
    Path(result_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
