"""`dspo-plan [--json] [overrides]`: the per-GPU memory plan of the `dspo-train` config these overrides compose.

Composes conf/train.yaml as `dspo-train` would (nothing is built, loaded or downloaded: the model is read from its
config.json on the meta device), prints the plan's table, whether it fits and, when it does not, the overrides that
would. Exit status 0 when it fits, 1 when it does not, 2 on a config error.
"""

from __future__ import annotations

import json
import sys
from functools import partial

from dspo.process.runtime import run_command

HELP = """dspo-plan: the memory plan of a dspo-train config, per GPU: parameters, gradients and AdamW state (precision,
FSDP2 shards, LoRA), the reference model, activations of the config's micro-batch (gradient checkpointing, the LM
head's chunks), the weight push, the colocated engine (weights, KV cache in tokens and trajectories) and env=planner's
answerer. It says whether the config fits and, if not, which overrides would. Nothing is loaded: the model's sizes
come from the config.json in model.path. dspo-train runs the same check before a GPU run loads its model.

Examples:
  dspo-plan experiment=one_gpu_qwen2.5_7b_lora model.path=data/model_configs/qwen2.5-7b plan.gpu=80GB
  dspo-plan experiment=paper_qwen2.5_7b model.path=data/model_configs/qwen2.5-7b plan.gpu=80GB trainer.devices=8
  dspo-plan --json experiment=gpu24_qwen2.5_3b_lora model.path=data/model_configs/qwen2.5-3b plan.gpu=24GB

Options: --json prints the plan as JSON (terms in bytes, phases, fits, suggestions). The GPU is the visible one, or
plan.gpu=80GB|40GB|24GB|79.6GiB|<bytes>; plan.reserve_gb sets the CUDA context and allocator slack (2 GB).
Outputs: the table on stdout; exit status 0 fits, 1 does not fit, 2 a config error. Nothing is written.
Docs: docs/memory.md#the-memory-plan-dspo-plan
Whole config: dspo-train --cfg job [overrides] (the same composition)."""


EXAMPLE = "dspo-plan experiment=one_gpu_qwen2.5_7b_lora model.path=/models/Qwen2.5-7B-Instruct   (docs/scaling.md)"


def main(argv: list[str] | None = None) -> int:
    from dspo.process.errors import user_errors
    from dspo.training.plan_config import plan_of
    from dspo.training.plan_report import as_json, report

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(HELP)
        return 0
    want_json = "--json" in args
    overrides = [a for a in args if a != "--json"]
    with user_errors("dspo-plan", EXAMPLE):
        cfg = compose_train(overrides)
        plan = plan_of(cfg)
        print(json.dumps(as_json(cfg, plan), indent=2) if want_json else report(cfg, plan), flush=True)
        return 0 if plan.fits else 1


def compose_train(overrides: list[str]):
    """conf/train.yaml with `overrides`, as dspo-train composes it (without a run folder: nothing is written)."""
    from hydra import compose, initialize_config_dir

    from dspo.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _command() -> None:
    sys.exit(main())


# the `dspo-plan` command (dspo.process.runtime.run_command: the exit status is main's)
cli = partial(run_command, _command)

if __name__ == "__main__":
    cli()
