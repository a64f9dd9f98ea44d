"""`MiniBatchStats`: the statistics of one optimizer step, accumulated over its micro-batches.

Each micro-batch's loss and KL are already divided by the whole mini-batch's count (the objective's `normalizer`), so
their sum is the mini-batch's value; the objective's statistics (clip fraction, mean ratio) are means over sequences,
weighted by each micro-batch's share of the mini-batch's sequences; entropy and the engine/trainer mismatch are
token means, weighted by each micro-batch's share of the trained tokens; the ratio's minimum and maximum are the
extremes over micro-batches. Values are Python floats, as the trainer logs them (`train/*`, `loss/*`, `mismatch/*`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dspo.algorithms.blocks import Stats
from dspo.types import PolicyBatch

_EXTREMES = {"ratio_min": min, "ratio_max": max}


@dataclass
class MiniBatchStats:
    num_sequences: int  # sequences in the mini-batch (this process)
    num_tokens: float  # trained tokens in the mini-batch (this process)
    num_micro_batches: int
    totals: dict[str, float] = field(default_factory=dict)

    def _sum(self, name: str, value: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + value

    def add(
        self,
        batch: PolicyBatch,
        loss: torch.Tensor,
        kl: torch.Tensor,
        entropy: torch.Tensor,
        objective: Stats,
        mismatch: Stats,
    ) -> None:
        """One micro-batch: its loss and KL (already mini-batch-normalized), its entropy [N, L] on trained tokens, the
        objective's statistics and the mismatch statistics (`correction_weights`)."""
        tokens = self.num_tokens
        self._sum("train/loss", float(loss.detach()))
        self._sum("loss/kl", float(kl.detach()))
        self._sum("train/entropy", float((entropy * batch.loss_mask).sum() / tokens if tokens else entropy.sum() * 0))
        weight = len(batch) / self.num_sequences
        for key, value in objective.items():
            name = f"loss/{key}"
            if key in _EXTREMES:
                start = math.inf if key == "ratio_min" else -math.inf
                self.totals[name] = _EXTREMES[key](self.totals.get(name, start), float(value))
            else:
                self._sum(name, float(value * weight))
        share = float(batch.loss_mask.sum()) / tokens if tokens else 1.0 / self.num_micro_batches
        for key, value in mismatch.items():  # token means: the mini-batch's = token-weighted sum of micro-batches
            self._sum(f"mismatch/{key}", float(value) * share)
