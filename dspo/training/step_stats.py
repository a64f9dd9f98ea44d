"""`MiniBatchStats`: the statistics of one optimizer step, accumulated over its micro-batches.

Each micro-batch's loss and KL are already divided by the whole mini-batch's count (the objective's `normalizer`), so
their sum is the mini-batch's value; the objective's statistics (clip fraction, mean ratio) are means over episodes
(sequences, unless an episode was split into samples: dspo and gspo take one ratio per episode), weighted by each
micro-batch's share of the mini-batch's episodes; entropy and the engine/trainer mismatch are
token means, weighted by each micro-batch's share of the trained tokens; the ratio's minimum and maximum, and the
smallest correction weight (`mismatch/weight_min`), are the extremes over micro-batches (with trained tokens); the
effective sample size `mismatch/ess` is the whole mini-batch's, from its per-sequence correction weights. Values
are Python floats, as the trainer logs them (`train/*`, `loss/*`, `mismatch/*`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dspo.algorithms.blocks import Stats
from dspo.algorithms.rollout_correction import effective_sample_size, sequence_mean_weights
from dspo.types import PolicyBatch

_EXTREMES = {"ratio_min": min, "ratio_max": max}


@dataclass
class MiniBatchStats:
    num_sequences: int  # sequences in the mini-batch (this process)
    num_tokens: float  # trained tokens in the mini-batch (this process)
    num_micro_batches: int
    num_episodes: int | None = None  # episodes in the mini-batch (this process); None: one per sequence
    totals: dict[str, float] = field(default_factory=dict)
    _sequence_weights: list[torch.Tensor] = field(default_factory=list)  # per-sequence correction weights so far
    _min_seen: bool = False  # a micro-batch with trained tokens gave mismatch/weight_min

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
        correction: torch.Tensor | None = None,
    ) -> None:
        """One micro-batch: its loss and KL (already mini-batch-normalized), its entropy [N, L] on trained tokens, the
        objective's statistics, the mismatch statistics and the correction weights [N, L] (`correction_weights`;
        without them `mismatch/ess` is the token-weighted mean of the micro-batches' own)."""
        tokens = self.num_tokens
        self._sum("train/loss", float(loss.detach()))
        self._sum("loss/kl", float(kl.detach()))
        self._sum("train/entropy", float((entropy * batch.loss_mask).sum() / tokens if tokens else entropy.sum() * 0))
        episodes = self.num_episodes or self.num_sequences
        weight = (int(batch.episode_heads().sum()) if self.num_episodes else len(batch)) / episodes
        for key, value in objective.items():
            name = f"loss/{key}"
            if key in _EXTREMES:
                start = math.inf if key == "ratio_min" else -math.inf
                self.totals[name] = _EXTREMES[key](self.totals.get(name, start), float(value))
            else:
                self._sum(name, float(value * weight))
        share = float(batch.loss_mask.sum()) / tokens if tokens else 1.0 / self.num_micro_batches
        trained = bool(batch.loss_mask.sum() > 0)
        for key, value in mismatch.items():  # token means: the mini-batch's = token-weighted sum of micro-batches
            name = f"mismatch/{key}"
            if key == "weight_min":  # the smallest over micro-batches with trained tokens (else the empty one's 1)
                if trained and self._min_seen:
                    self.totals[name] = min(self.totals[name], float(value))
                elif trained or name not in self.totals:
                    self.totals[name] = float(value)
                self._min_seen = self._min_seen or trained
            elif key == "ess" and correction is not None:
                self._sequence_weights.append(
                    sequence_mean_weights(correction.detach(), batch.loss_mask, batch.episode_ids)
                )
                self.totals[name] = float(effective_sample_size(torch.cat(self._sequence_weights)))
            else:
                self._sum(name, float(value) * share)
