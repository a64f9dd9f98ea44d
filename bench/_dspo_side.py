"""dspo side of `bench/vs_trl.py`: time training rounds of the real Lightning loop (what `dspo-train` runs).

    .venv/bin/python bench/_dspo_side.py SPEC.json RESULT.json

Composes `conf/train.yaml` with Hydra's compose API and the overrides in SPEC (the orchestrator builds them: model,
QA file, algorithm variant, G, B, lengths), instantiates data, module, the environment callback and the trainer as
`dspo.train.build` (no checkpointing, no logger, no validation: TRL's side saves and logs nothing either), and
runs `trainer.fit` for warm-up + measured rounds. One round = one train batch: at its `on_train_batch_start` the
`EnvironmentCallback` pushes the weights into the in-process vLLM engine and samples groups until B pass the filter,
then `training_step` does the forward/backward passes and the AdamW step. `RoundClock`, first in the callback list,
times each batch and wraps the environment to read every round's rollout statistics.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


def prompt_digest(token_lists: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(token_lists).encode()).hexdigest()[:16]


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

    def _wrap(self, trainer: pl.Trainer) -> None:
        from dspo.callbacks.environment_callback import EnvironmentCallback

        env_cb = next(c for c in trainer.callbacks if isinstance(c, EnvironmentCallback))
        sample_round, push_weights = env_cb.environment.sample_round, env_cb.engine.push_weights

        def timed_sample_round(*args: Any, **kwargs: Any):
            groups, stats = sample_round(*args, **kwargs)
            self.round.update({k.removeprefix("rollout/"): float(v) for k, v in stats.items()})
            return groups, stats

        def timed_push(*args: Any, **kwargs: Any):
            tic = time.perf_counter()
            out = push_weights(*args, **kwargs)
            self.round["push_s"] = time.perf_counter() - tic
            return out

        env_cb.environment.sample_round, env_cb.engine.push_weights = timed_sample_round, timed_push
        items = trainer.datamodule.sampler.items
        self.prompt_ids = [env_cb.agent.prompt_ids(item) for item in items]
        self.wrapped = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.wrapped:
            self._wrap(trainer)
        self.round = {"push_s": 0.0}
        self.tic = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch

        now = time.perf_counter()
        r = self.round
        sampled = r.get("groups_sampled", 0.0)
        group_size = pl_module.algo.group_size
        tokens = r.get("tokens_per_s", 0.0) * r.get("time_s", 0.0)
        self.steps.append(
            {
                "step_s": now - self.tic,
                "cycle_s": now - self.last_end if self.last_end else float("nan"),
                "push_s": r.get("push_s", 0.0),
                "generate_s": r.get("time_s", float("nan")),  # sample_round: engine calls + reward + filter
                "train_s": now - self.tic - r.get("time_s", 0.0) - r.get("push_s", 0.0),
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


def main(spec_path: str, result_path: str) -> None:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    os.environ["DSPO_NUM_THREADS"] = str(spec["threads"])
    from dspo.runtime import configure_threads

    configure_threads()  # as dspo-train: in-process vLLM engine, torch threads = DSPO_NUM_THREADS
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
    error = None
    try:
        trainer.fit(module, datamodule=datamodule)
    except SamplingExhausted as exc:  # e.g. a model that never earns a reward: the filter keeps nothing
        error = f"SamplingExhausted: {exc}"
    import vllm

    result = {
        "steps": clock.steps,
        "error": error,
        "prompt_digest": prompt_digest(clock.prompt_ids),
        "prompt_tokens_mean": sum(map(len, clock.prompt_ids)) / max(len(clock.prompt_ids), 1),
        "versions": {"vllm": vllm.__version__, "lightning": pl.__version__},
    }
    Path(result_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
