"""`StepProgressBar`: a run's progress as RL steps out of `trainer.max_steps`, with reward and keep-rate, and a short
table of the validation scores after each validation.

Why not Lightning's default bar: dspo's train stream is endless (a train batch is one optimizer step of a round), so
"epochs" mean nothing and the default description reads "Epoch 0/-2".
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar


def validation_table(metrics: dict[str, float], step: int) -> str:
    """`step 25 · validation subEM  toy_1hop 0.410  toy_2hop 0.120  mean 0.265` from `val/<benchmark>/subem` values."""
    scores = {k[len("val/") : -len("/subem")]: v for k, v in sorted(metrics.items()) if k.endswith("/subem")}
    if not scores:
        return ""
    parts = [f"{name} {value:.3f}" for name, value in scores.items() if "/" not in name]
    if "val/subem_mean" in metrics:
        parts.append(f"mean {metrics['val/subem_mean']:.3f}")
    return f"step {step} · validation subEM  " + "  ".join(parts)


class StepProgressBar(RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        return "RL step"

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version number: not progress
        return items

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        line = validation_table({k: float(v) for k, v in trainer.callback_metrics.items()}, trainer.global_step)
        if line:
            if self.progress is not None:
                self.progress.console.print(line)
            else:
                print(line, flush=True)
