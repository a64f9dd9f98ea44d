"""What flows between the data module, the round producer and the module, free of Lightning (issue 41): the prompt
sampler (`PromptSampler`, which the data module owns and checkpoints and the producer draws from) and the slots the
train and eval loaders yield (`RoundSlot`, `EvalSlot`), which the producer fills (`dspo.rollout.producer`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspo.types import PolicyBatch, QAItem, RoundReport


@dataclass
class RoundSlot:
    """Placeholder for one optimizer step's data, filled by the environment callback."""

    index: int  # position in the train stream (for debugging only)
    micro_batches: list[PolicyBatch] = field(default_factory=list)  # this optimizer step's data
    round_batches: list[PolicyBatch] = field(default_factory=list)  # whole round, set on its first step only
    round_index: int = -1
    minibatch_index: int = -1
    report: RoundReport | None = None  # what sampling the round showed, set on its first step only (the guard reads it)


@dataclass
class EvalSlot:
    """One validation/test batch: the questions, and the greedy predictions the environment callback adds at
    `on_{validation,test}_batch_start` (the module only scores them: it never calls the environment)."""

    items: list[QAItem]  # [n] questions of one benchmark
    predictions: list | None = None  # [n] dspo.eval.pipeline.Prediction, in the order of `items`


class PromptSampler:
    """Seeded, resumable stream of training prompts: a fresh permutation per epoch; rank r of W takes every W-th."""

    def __init__(self, items: list[QAItem], seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if not items:
            raise ValueError("PromptSampler needs at least one training question (check data.train_files)")
        self.items, self.seed, self.rank, self.world_size = items, seed, rank, world_size
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(len(self.items), generator=generator).tolist()
        return order[self.rank :: self.world_size] or order

    def take(self, n: int) -> list[tuple[int, QAItem]]:
        """Next n (global index, item) pairs; rolls over to a new epoch's permutation when exhausted."""
        out = []
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            index = self._order[self.position]
            out.append((index, self.items[index]))
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation()
