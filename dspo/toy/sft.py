"""The SFT loop of the toy warm start: weighted next-token loss, length-bucketed batches, AdamW with warm-up + cosine.

Plain torch, no Trainer: the warm start is a few thousand small steps on CPU, and its loss weights (per target token:
1 on generated tokens, `name_weight` on copied name pieces, 0 on prompts and, by default, on retrieved passages) are
the one thing that needs care.
"""

from __future__ import annotations

import math
import random
import time
from typing import Protocol

import torch
from tqdm.auto import tqdm

from dspo.process.progress_log import Every, duration, progress_logger, time_left
from dspo.toy.drills import Example
from dspo.types import Trajectory

PROGRESS_EVERY_S = 30.0  # a progress line this often during the SFT (train.log; the console when redirected)
progress = progress_logger("warmstart")


class SFTSettings(Protocol):
    """What the loop reads of its config (`dspo.toy.warmstart.WarmStartConfig` has them)."""

    seed: int
    lr: float
    weight_decay: float
    warmup_steps: int
    grad_clip: float


def demo_examples(
    trajectories: list[Trajectory], context_weight: float, name_ids: set[int] = frozenset(), name_weight: float = 1.0
) -> list[Example]:
    """Whole trajectories: weight 1 on mask-1 tokens (`name_weight` on those in `name_ids`), `context_weight` on
    environment tokens, 0 on the prompt."""

    def weight(token: int, mask: int) -> float:
        if not mask:
            return context_weight
        return name_weight if token in name_ids else 1.0

    return [
        (
            t.prompt_ids + t.response_ids,
            [0.0] * len(t.prompt_ids) + [weight(tok, m) for tok, m in zip(t.response_ids, t.response_mask)],
        )
        for t in trajectories
    ]


def _batches(examples: list[Example], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped by similar length (little padding), in a shuffled batch order."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def _collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, L], attention_mask [B, L], loss weights [B, L], right-padded."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    weights = torch.zeros((len(examples), width), dtype=torch.float32)
    for row, (seq, weight) in enumerate(examples):
        ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
        weights[row, : len(seq)] = torch.tensor(weight, dtype=torch.float32)
    return ids, attention, weights


def sft_loss(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Weighted mean next-token cross-entropy; `loss_mask` weighs each *target* token (1 = model-generated)."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # [B, L-1, V]
    targets, weights = ids[:, 1:], loss_mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")  # [B, L-1]
    return (nll * weights).sum() / weights.sum().clamp(min=1.0)


def sft_line(done: int, total: int, losses: list[float], elapsed: float) -> str:
    """`warm start (SFT): step 400/2800 (14 %), loss 1.234, 1m 30s so far, about 9m 00s left` (the loss: the mean of
    the last 20 steps; the time left: at the mean speed so far)."""
    recent = losses[-20:]
    loss = f", loss {sum(recent) / len(recent):.3f}" if recent else ""
    left = time_left(elapsed, done, total)
    tail = f", about {duration(left)} left" if left is not None else ""
    share = 100 * done // max(total, 1)
    return f"warm start (SFT): step {done}/{total} ({share} %){loss}, {duration(elapsed)} so far{tail}"


def train_sft(
    model: torch.nn.Module, stages: list[tuple[list[Example], int, int]], pad_id: int, config: SFTSettings
) -> list[float]:
    """AdamW, linear warm-up then cosine decay over all stages; `stages` = [(examples, steps, batch_size)] run in
    order. Returns the loss per step."""
    rng = random.Random(config.seed)
    total = sum(steps for _, steps, _ in stages)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    losses: list[float] = []
    # tqdm's bar on a terminal only (disable=None): written to a file it is a carriage-return run per update; a
    # progress line every PROGRESS_EVERY_S says the same there, and in train.log (dspo.process.progress_log)
    bar = tqdm(total=total, desc="warm start (SFT)", dynamic_ncols=True, mininterval=2.0, disable=None)
    every, started = Every(PROGRESS_EVERY_S), time.monotonic()
    for examples, steps, batch_size in stages:
        queue: list[list[int]] = []
        for _ in range(steps):
            if not queue:
                queue = _batches(examples, batch_size, rng)
            loss = sft_loss(model, *_collate([examples[i] for i in queue.pop()], pad_id))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            if every.due():
                progress.info(sft_line(len(losses), total, losses, time.monotonic() - started))
    bar.close()
    model.eval()
    return losses
