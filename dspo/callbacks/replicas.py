"""`ReplicaCheck`: at the end of training, prove that data-parallel ranks hold the same policy and took the same steps.

DDP keeps replicas identical only if every rank runs the same optimizer steps on all-reduced gradients; a rank that
skipped a step, or a bug that updated one rank alone, would silently train W different models and export rank 0's.
Each rank fingerprints its trainable parameters (float64 sum and sum of squares per tensor, in name order), the
fingerprints and step counts are gathered, and rank 0 writes `<run dir>/replicas.json`. A difference raises.

Under FSDP the parameters are shards (each rank holds a different part by design), so only steps and the per-step
data counts are compared; the shards are checked by the FSDP tests instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

log = logging.getLogger(__name__)


class ReplicasDiverged(RuntimeError):
    """Data-parallel ranks ended training with different parameters or step counts."""


def parameter_fingerprint(module: torch.nn.Module) -> torch.Tensor:
    """[2 * P] float64: (sum, sum of squares) of each trainable parameter, in name order; exact across identical
    replicas (same values, same reduction order), cheap next to an optimizer step."""
    values = []
    for _, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        if param.requires_grad:
            data = param.detach().to(torch.float64)
            values.extend([data.sum(), data.square().sum()])
    return torch.stack(values) if values else torch.zeros(0, dtype=torch.float64)


def _is_sharded(module: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in module.parameters())


class ReplicaCheck(pl.Callback):
    """Args: filename: written under `trainer.default_root_dir` by rank 0."""

    def __init__(self, filename: str = "replicas.json") -> None:
        self.filename = filename
        self.sequences_per_step: list[int] = []  # this rank's trained sequences at each optimizer step
        # and its forward/backward passes: each backward is a collective under DDP and FSDP, so ranks must agree
        self.micro_batches_per_step: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        micro = getattr(batch, "micro_batches", None) or []
        self.sequences_per_step.append(sum(len(b) for b in micro))
        self.micro_batches_per_step.append(len(micro))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size < 2:
            return
        policy = getattr(pl_module, "policy", None) or pl_module
        sharded = _is_sharded(policy)
        steps = torch.tensor([trainer.global_step, len(self.sequences_per_step)], dtype=torch.float64)
        gathered = {"steps": pl_module.all_gather(steps.to(pl_module.device)).cpu()}  # [W, 2]
        same_steps = bool((gathered["steps"] == gathered["steps"][0]).all())
        # the next tensors have one entry per step: gathered only when every rank has as many (else sizes differ)
        counts = torch.tensor(self.sequences_per_step if same_steps else [], dtype=torch.float64)
        passes = torch.tensor(self.micro_batches_per_step if same_steps else [], dtype=torch.float64)
        fingerprint = torch.zeros(0, dtype=torch.float64) if sharded else parameter_fingerprint(policy).cpu()
        for name, value in (("counts", counts), ("passes", passes), ("fingerprint", fingerprint)):
            gathered[name] = pl_module.all_gather(value.to(pl_module.device)).cpu()  # [W, ...]
        same_params = sharded or bool((gathered["fingerprint"] == gathered["fingerprint"][0]).all())
        same_steps = same_steps and bool((gathered["passes"] == gathered["passes"][0]).all())
        report = {
            "world_size": trainer.world_size,
            "sharded": sharded,
            "identical_parameters": same_params,
            "same_steps": same_steps,
            "ranks": [
                {
                    "rank": rank,
                    "global_step": int(gathered["steps"][rank][0]),
                    "sequences_per_step": [int(n) for n in gathered["counts"][rank]],
                    "micro_batches_per_step": [int(n) for n in gathered["passes"][rank]],
                    "fingerprint_sum": float(gathered["fingerprint"][rank].sum()) if not sharded else None,
                }
                for rank in range(trainer.world_size)
            ],
        }
        if trainer.is_global_zero:
            path = Path(trainer.default_root_dir) / self.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2) + "\n")
        if not (same_steps and same_params):
            raise ReplicasDiverged(
                f"data-parallel ranks diverged (identical parameters: {same_params}, same steps: {same_steps}); "
                f"see {Path(trainer.default_root_dir) / self.filename}. This is a bug in dspo or in the strategy: "
                "please report it with that file."
            )
        log.info("replica check: %d ranks, same steps, %s", trainer.world_size, "sharded" if sharded else "same params")
