"""Round building: rollout groups -> advantages -> shuffled mini-batches -> padded `PolicyBatch` micro-batches.

Advantages: one per trajectory from the configured estimator on the groups' rewards (Eq. 10 by default), or, with
per-turn credit (`env.reward.credit=turn`), one per token: each model turn's tokens get the trajectory-level
advantage (the estimator on outcome + shaping) plus the same estimator's advantage of that turn's step reward among
the group's step rewards (`turn_advantages`; StepSearch), so both parts are on the estimator's scale.

One round holds B groups of G trajectories. They are shuffled (seeded) and cut into M mini-batches, one optimizer step
each (M = 1 is fully on-policy). An episode trained as several samples (`Trajectory.segments`: a compacted context, an
agent that rewrote its history, a branch) stays in one micro-batch, every sample with the episode's advantage and a
`sample_scale` of |y_sample| / |y_episode| trained tokens: a sequence-mean objective scales each sample's term by it
and counts episodes, not samples, so a split episode weighs what it would unsplit (docs/training.md). Its importance
weight is computed over all its samples (`correction_weights(episodes=...)`), which is why they share a micro-batch.

Data-parallel ranks run the same number of micro-batches whatever their episodes split into: every rank runs the most
any rank has (`agree_counts`), because each backward is a collective under DDP and FSDP.

Inside a mini-batch, sequences are sorted by length before being cut into micro-batches, and each micro-batch is
padded only to its own longest sequence: this length bucketing keeps the share of padding small without packing
(packing would need varlen attention masks that vLLM-free CPU training lacks).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dspo.algorithms.advantages import group_advantages, turn_advantages
from dspo.types import PolicyBatch, RolloutGroup, Trajectory


@dataclass
class Round:
    """One round's training data. `minibatches[m]` is the list of micro-batches of optimizer step m."""

    groups: list[RolloutGroup]
    minibatches: list[list[PolicyBatch]]
    policy_version: int
    stats: dict[str, float]

    @property
    def num_sequences(self) -> int:
        return sum(len(mb) for micro in self.minibatches for mb in micro)


def _pad(rows: list[list[float]], value: float, dtype: torch.dtype) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def collate_trajectories(
    trajectories: list[Trajectory],
    advantages: list,
    pad_token_id: int,
    policy_version: int,
    sample_scale: list[float] | None = None,
    episode_ids: list[int] | None = None,
) -> PolicyBatch:
    """Pad prompt+response of each trajectory to one [N, L] batch; loss_mask covers the response's mask-1 tokens.

    Token t's engine logprob sits at position t, as loss_mask and the trainer's logprobs (dspo.models.logprobs) do.
    `advantages`: one float per trajectory ([N]), or one list per trajectory of one value per response token
    ([N, L], placed after the prompt like the logprobs; per-turn credit). `sample_scale` and `episode_ids` ([N] each;
    default 1 and one episode per row): which rows are samples of one episode (consecutive), and their weights.
    """
    ids = [t.prompt_ids + t.response_ids for t in trajectories]
    masks = [[0] * len(t.prompt_ids) + list(t.response_mask) for t in trajectories]
    engine = [[0.0] * len(t.prompt_ids) + list(t.engine_logprobs) for t in trajectories]
    if advantages and isinstance(advantages[0], list):
        per_token = [[0.0] * len(t.prompt_ids) + list(a) for t, a in zip(trajectories, advantages)]
        advantage_tensor = _pad(per_token, 0.0, torch.float32)  # [N, L]
    else:
        advantage_tensor = torch.tensor(advantages, dtype=torch.float32)  # [N]
    n = len(trajectories)
    return PolicyBatch(
        input_ids=_pad(ids, pad_token_id, torch.long),  # [N, L]
        attention_mask=_pad([[1] * len(x) for x in ids], 0, torch.long),  # [N, L]
        loss_mask=_pad(masks, 0, torch.float32),  # [N, L]
        engine_logprobs=_pad(engine, 0.0, torch.float32),  # [N, L]
        advantages=advantage_tensor,  # [N], or [N, L] with per-turn credit
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),  # [N]
        policy_version=policy_version,
        episode_ids=torch.tensor(episode_ids if episode_ids is not None else range(n), dtype=torch.long),  # [N]
        sample_scale=torch.tensor(sample_scale if sample_scale is not None else [1.0] * n, dtype=torch.float32),
    )


@dataclass
class Sample:
    """One row of a round: a sample of an episode, with the episode's advantage, id and this sample's scale."""

    trajectory: Trajectory
    advantage: float | list[float]
    episode: int  # position of its episode in the round (after the shuffle)
    scale: float  # |y_sample| / |y_episode| in trained tokens (1 / samples for an episode without trained tokens)

    @property
    def length(self) -> int:
        return len(self.trajectory.prompt_ids) + len(self.trajectory.response_ids)


def episode_samples(trajectory: Trajectory, advantage: float | list[float], episode: int) -> list[Sample]:
    """The rows of one episode (`Trajectory.samples`), each scaled by its share of the episode's trained tokens."""
    samples = trajectory.samples()
    trained = [float(sum(s.response_mask)) for s in samples]
    total = sum(trained)
    scales = [t / total for t in trained] if total > 0 and len(samples) > 1 else [1.0 / len(samples)] * len(samples)
    return [Sample(s, advantage, episode, scale) for s, scale in zip(samples, scales)]


def turn_credit(
    groups: list[RolloutGroup], advantages: Callable[[torch.Tensor], torch.Tensor]
) -> list[list[list[float]]]:
    """Per-token advantages [B][G][response tokens]: a model turn's tokens get the trajectory-level advantage (the
    estimator on outcome + shaping, i.e. the total without the step rewards) plus the advantage `advantages` gives
    that turn's step reward among the group's step rewards (the same estimator: `group_mean` or `rloo` would otherwise
    add an unscaled trajectory part to a std-scaled step part); tool tokens get 0 (they are never trained)."""
    levels = [[t.reward - sum(s for s in t.step_rewards if s is not None) for t in g.trajectories] for g in groups]
    outcome_adv = advantages(torch.tensor(levels, dtype=torch.float32)).tolist()  # [B][G]
    out = []
    for group, outcome_row in zip(groups, outcome_adv):
        step_rewards = [list(t.step_rewards) or [None] * len(t.turn_spans) for t in group.trajectories]
        steps = turn_advantages(step_rewards, estimator=advantages)
        rows = []
        for trajectory, outcome, turn_steps in zip(group.trajectories, outcome_row, steps):
            per_token = [0.0] * len(trajectory.response_ids)
            for (start, end), step in zip(trajectory.turn_spans, turn_steps):
                per_token[start:end] = [outcome + step] * (end - start)
            rows.append(per_token)
        out.append(rows)
    return out


def padding_share(batches: list[PolicyBatch]) -> float:
    """Tokens computed on padding / all tokens computed, over the given micro-batches."""
    total = sum(b.attention_mask.numel() for b in batches)
    real = sum(int(b.attention_mask.sum()) for b in batches)
    return 0.0 if total == 0 else 1.0 - real / total


def pack_by_tokens(lengths: Sequence[int], budget: int, rows: Sequence[int] | None = None) -> list[list[int]]:
    """Indices of `lengths`, longest first, packed into micro-batches whose padded size (rows x the longest) is at
    most `budget` tokens; one longer than the budget is a micro-batch of its own (verl's dynamic batch size). `rows`:
    the sequences each index stands for (an episode's samples travel together; default 1 each)."""
    rows = rows if rows is not None else [1] * len(lengths)
    parts: list[list[int]] = []
    filled = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if parts and (filled + rows[i]) * lengths[parts[-1][0]] <= budget:
            parts[-1].append(i)
            filled += rows[i]
        else:
            parts.append([i])
            filled = rows[i]
    return parts


def pack_by_count(rows: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive indices packed into micro-batches of at most `size` sequences (`rows[i]` each); an index of more
    rows than `size` (an episode's samples) is a micro-batch of its own."""
    parts: list[list[int]] = []
    filled = 0
    for i, n in enumerate(rows):
        if parts and filled + n <= size:
            parts[-1].append(i)
            filled += n
        else:
            parts.append([i])
            filled = n
    return parts


def split_to(
    parts: list[list[int]], lengths: Sequence[int], count: int, rows: Sequence[int] | None = None
) -> list[list[int]]:
    """`parts` split until there are `count` of them (the largest padded part of 2+ indices halved first), so that
    every data-parallel rank runs as many forward/backward passes (DDP and FSDP collectives must pair up). `rows` as
    in `pack_by_tokens`: an index is never split (an episode's samples stay together)."""
    rows = rows if rows is not None else [1] * len(lengths)
    parts = [list(p) for p in parts]
    if count > sum(len(p) for p in parts):
        raise ValueError(
            f"cannot split {sum(len(p) for p in parts)} episodes into {count} micro-batches (ranks must hold as many "
            "episodes per mini-batch: algorithm.batch_groups must be divisible by the number of ranks)"
        )
    while len(parts) < count:
        splittable = [k for k, p in enumerate(parts) if len(p) > 1]
        k = max(splittable, key=lambda k: sum(rows[i] for i in parts[k]) * max(lengths[i] for i in parts[k]))
        half = len(parts[k]) // 2
        parts[k : k + 1] = [parts[k][:half], parts[k][half:]]
    return parts


def build_round(
    groups: list[RolloutGroup],
    num_minibatches: int,
    micro_batch_size: int,
    pad_token_id: int,
    policy_version: int,
    seed: int,
    advantages: Callable[[torch.Tensor], torch.Tensor] = group_advantages,
    credit: str = "trajectory",
    micro_batch_tokens: int | None = None,
    agree_counts: Callable[[list[int]], list[int]] | None = None,
) -> Round:
    """Advantages per group (`advantages`: rewards [B, G] -> [B, G], the configured estimator; Eq. 10 by default; or
    per token with `credit="turn"`), shuffle, split into `num_minibatches`, bucket into micro-batches: of
    `micro_batch_size` sequences, or with `micro_batch_tokens` packed by tokens (`pack_by_tokens`); an episode's
    samples always share one micro-batch. `agree_counts` maps this rank's micro-batch count per mini-batch to the
    counts every rank must run (their maximum), and micro-batches are split to reach them."""
    if not groups:
        raise ValueError("build_round got no rollout groups")
    flat = _episodes_with_advantages(groups, advantages, credit)
    if len(flat) % num_minibatches:
        raise ValueError(
            f"{len(flat)} trajectories cannot be split into algorithm.num_minibatches={num_minibatches} equal "
            "mini-batches; choose B*G divisible by it"
        )
    random.Random(seed).shuffle(flat)
    per_minibatch = len(flat) // num_minibatches
    chunks, plans = [], []
    for m in range(num_minibatches):
        start = m * per_minibatch
        episodes = [episode_samples(t, a, start + k) for k, (t, a) in enumerate(flat[start : start + per_minibatch])]
        longest = [max(sample.length for sample in unit) for unit in episodes]
        order = sorted(range(len(episodes)), key=longest.__getitem__)  # by longest sample; stable
        units, lengths = [episodes[k] for k in order], [longest[k] for k in order]
        rows = [len(unit) for unit in units]
        if micro_batch_tokens is None:
            plan = pack_by_count(rows, micro_batch_size)
        else:
            plan = pack_by_tokens(lengths, micro_batch_tokens, rows)
        chunks.append((units, lengths, rows))
        plans.append(plan)
    if agree_counts is not None:
        targets = agree_counts([len(plan) for plan in plans])
        plans = [split_to(plan, lengths, n, rows) for plan, (_, lengths, rows), n in zip(plans, chunks, targets)]
    minibatches = [
        [_collate([sample for i in part for sample in units[i]], pad_token_id, policy_version) for part in plan]
        for plan, (units, _, _) in zip(plans, chunks)
    ]
    stats = {"padding_share": padding_share([b for mb in minibatches for b in mb])}
    return Round(groups=groups, minibatches=minibatches, policy_version=policy_version, stats=stats)


def _episodes_with_advantages(
    groups: list[RolloutGroup], advantages: Callable[[torch.Tensor], torch.Tensor], credit: str
) -> list[tuple[Trajectory, float | list[float]]]:
    """(episode, its advantage) for every trajectory of the round, group by group."""
    if credit == "turn":
        if any(t.segments for g in groups for t in g.trajectories):
            raise ValueError(
                "env.reward.credit=turn: some episodes were trained as several samples (Trajectory.segments: a "
                "rewritten history or a compacted context), and per-turn credit covers one token sequence; use "
                "env.reward.credit=trajectory with this agent"
            )
        return [
            pair
            for g, per_token in zip(groups, turn_credit(groups, advantages))
            for pair in zip(g.trajectories, per_token)
        ]
    rewards = torch.stack([g.rewards for g in groups])  # [B, G]
    group_adv = advantages(rewards)  # [B, G]
    return [(t, float(a)) for g, adv in zip(groups, group_adv) for t, a in zip(g.trajectories, adv.tolist())]


def _collate(samples: list[Sample], pad_token_id: int, policy_version: int) -> PolicyBatch:
    return collate_trajectories(
        [s.trajectory for s in samples],
        [s.advantage for s in samples],
        pad_token_id,
        policy_version,
        sample_scale=[s.scale for s in samples],
        episode_ids=[s.episode for s in samples],
    )
