"""Roll the policy back to a checkpoint: model, optimizer and scheduler, with the learning rate scaled (issue 55).

Only those three are restored. The prompt sampler, the RNG states, the round producer and the step count are left
where they are, so the run continues with prompts and seeds it has not trained on (a replay of the same rounds from
the same weights would collapse the same way), and the global step keeps counting.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch


def restore(trainer: pl.Trainer, pl_module: pl.LightningModule, path: str, lr_scale: float) -> None:
    """Load `path`'s weights, optimizer and scheduler into the running trainer (every rank loads the same file), set
    the learning rate to `optimizer.lr x lr_scale`, and move `weights_version` so that the engine gets the restored
    weights before its next round (in this process or the engine process at k >= 1)."""
    if Path(path).is_dir():  # trainer=fsdp: the strategy reads each rank's shards into the model and optimizer
        checkpoint = trainer.strategy.load_checkpoint(path, weights_only=True)
    else:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # no arbitrary unpickling
        _load_file(trainer, pl_module, checkpoint, path)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
    set_lr_scale(pl_module, lr_scale)
    pl_module.weights_version += 1  # the producer pushes whenever the version it pushed differs


def set_lr_scale(pl_module: pl.LightningModule, lr_scale: float) -> None:
    """The scheduler's base rate = `optimizer.lr x lr_scale`, and the current rate with it (LambdaLR: base x lambda)."""
    scheduler = pl_module.trainer.lr_scheduler_configs[0].scheduler
    base = pl_module.optim_cfg.lr * lr_scale
    scheduler.base_lrs = [base for _ in scheduler.base_lrs]
    factors = getattr(scheduler, "lr_lambdas", None) or [lambda _: 1.0] * len(scheduler.base_lrs)
    for group, factor in zip(scheduler.optimizer.param_groups, factors, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)


def _load_file(trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict, path: str) -> None:
    """Weights and optimizer state of a single-file checkpoint (every rank holds the full state)."""
    missing, unexpected = pl_module.load_state_dict(checkpoint["state_dict"], strict=False)
    trained = {name for name, p in pl_module.named_parameters() if p.requires_grad}  # not LoRA's frozen base
    if unexpected or any(key in trained for key in missing):
        raise RuntimeError(
            f"guard: {path} does not match the policy (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    trainer.optimizers[0].load_state_dict(checkpoint["optimizer_states"][0])
