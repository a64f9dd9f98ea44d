"""An episode trained as several samples (`Trajectory.segments`) trains exactly as the same tokens unsplit, off-policy
too (issue 70, item 3): dspo and gspo take one ratio and one clip decision per episode (`blocks.episode_ratio`), the
rows' weights carry each sample's share |y_sample| / |y_episode| (`PolicyBatch.sample_scale`, as `DSPOModule`
applies it), grpo's per-row token mean scaled by that share is the episode's token mean, dapo's token mean needs
nothing. Hand-computed cases first, then a property test over random episodes, splits, deltas, clips and weights.
`tests/training/test_module.py::test_split_episodes_train_as_unsplit_off_policy_through_the_module` does it through the
module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dspo.algorithms.blocks import (
    clipped_surrogate,
    denominator,
    episode_ratio,
    masked_log_ratio,
    ratio_stats,
    sequence_ratio,
    sequence_weights,
)
from dspo.algorithms.losses import OBJECTIVES, ClipRange, policy_loss, register_objective, sequence_clip_loss
from dspo.testing import examples

DSPO_CLIP = {"clip_low": 3e-4, "clip_high": 4e-4}
ALL = ("dspo", "gspo", "grpo", "dapo")


# ------------------------------------------------------------------------------------------------- by hand
def test_episode_ratio_pools_the_rows_of_each_episode_by_hand():
    """Rows 0 and 2 are one episode (ids need not be consecutive nor 0-based): Σδ = 0.1 + 0.2 + 0.5·3 = 1.8 over
    5 tokens, s = e^0.36 = 1.4333294; row 1 alone: e^0.3 = 1.3498588; an episode without trained tokens: s = 1."""
    delta = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float64)
    ratio, lengths, first = episode_ratio(delta, mask, torch.tensor([4, 9, 4, 2]))
    assert ratio.tolist() == pytest.approx([math.exp(0.36), math.exp(0.3), math.exp(0.36), 1.0], abs=1e-12)
    assert lengths.tolist() == [5.0, 1.0, 5.0, 0.0]
    assert first.tolist() == [True, True, False, True]
    alone, alone_lengths, all_first = episode_ratio(delta, mask)  # None: every row its own episode
    torch.testing.assert_close((alone, alone_lengths), sequence_ratio(delta, mask), rtol=0, atol=0)
    assert all_first.all()
    with pytest.raises(ValueError, match=r"episodes must be \[N\]=4 ids, got \(3,\)"):
        episode_ratio(delta, mask, torch.tensor([0, 1, 2]))


def _finding(name: str, split: bool):
    """One episode, 4 trained tokens with log-ratio deltas [+1e-3, +1e-3, -1e-3, -1e-3], Â = 1, clip 3e-4 / 4e-4:
    one row, or two rows of 2 tokens each with share 0.5 (the module's sample_scale) and one episode id."""
    leaf = torch.full((4,), -1.0, requires_grad=True)
    delta = torch.tensor([1e-3, 1e-3, -1e-3, -1e-3])
    shape = (2, 2) if split else (1, 4)
    logprobs, old = leaf.view(shape), (leaf.detach() - delta).view(shape)
    weights = torch.full(shape, 0.5 if split else 1.0)
    advantages, episodes = torch.ones(shape[0]), torch.zeros(shape[0], dtype=torch.long)
    mask = torch.ones(shape)
    loss, stats = policy_loss(name, logprobs, old, advantages, mask, DSPO_CLIP, 1, weights=weights, episodes=episodes)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss, grad, stats


@pytest.mark.parametrize("name", ["dspo", "gspo"])
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split_2_2"])
def test_a_split_episode_has_one_ratio_and_one_clip_decision_by_hand(name, split):
    """s = e^((2e-3 − 2e-3)/4) = 1, inside [0.9997, 1.0004]: the loss is −Â·s/N = −1 and each token's gradient is
    −Â·s/(N·|y|) = −0.25, split or not. With a ratio per sample (before issue 70) the first sample's e^1e-3 = 1.0010005
    was clipped (gradient 0) and the second's e^−1e-3 = 0.9990005 not: [0, 0, −0.2498, −0.2498], clipfrac 0.5."""
    loss, grad, stats = _finding(name, split)
    assert float(loss.detach()) == pytest.approx(-1.0, abs=1e-7)
    torch.testing.assert_close(grad, torch.full((4,), -0.25), atol=1e-7, rtol=0)
    assert float(stats["clipfrac"]) == 0.0 and float(stats["ratio_mean"]) == pytest.approx(1.0, abs=1e-7)
    assert float(stats["ratio_min"]) == float(stats["ratio_max"])  # one episode: one ratio in the statistics


def _per_row_oracle(logprobs, old, advantages, mask, clip: ClipRange, normalizer, weights):
    """The objective before issue 70, written out from the blocks: s_i per row (Eq. 6), clipped per row (Eq. 11)."""
    delta, mask_f = masked_log_ratio(logprobs, old, mask)
    ratio, lengths = sequence_ratio(delta, mask_f)
    surrogate, is_clipped = clipped_surrogate(ratio, advantages, clip.clip_low, clip.clip_high)
    surrogate = surrogate * (lengths > 0)
    per_row = sequence_weights(weights, mask_f, "oracle")
    if per_row is not None:
        surrogate = surrogate * per_row
    loss = -surrogate.sum() / denominator(normalizer, surrogate.shape[0], "oracle")
    return loss, ratio_stats(ratio, lengths > 0, is_clipped)


@pytest.mark.parametrize("with_weights", [False, True])
def test_unsplit_rows_are_bit_identical_to_a_ratio_per_row(with_weights):
    """Each row its own episode (`collate_trajectories`' default ids, or None): loss, gradient and statistics are
    bit-for-bit the per-row objective's, so unsplit runs train exactly as before issue 70."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=gen) * 3
    delta = (torch.rand(6, 9, generator=gen) - 0.5) * 4e-3 + torch.tensor([1e-3, 1e-3, -1e-3, -1e-3, 0, 0])[:, None]
    mask = (torch.rand(6, 9, generator=gen) > 0.3).float()
    mask[4] = 0.0  # an empty row
    old[5, 7:], mask[5, 7:] = float("nan"), 0.0  # padding holding NaN never leaks
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.7, 1.0, 0.0])
    weights = torch.rand(6, generator=gen)[:, None].expand(6, 9).contiguous() if with_weights else None
    clip = ClipRange(3e-4, 4e-4)
    results = []
    for run in ("oracle", "none", "arange"):
        leaf = (old.nan_to_num() + delta).requires_grad_(True)
        if run == "oracle":
            loss, stats = _per_row_oracle(leaf, old, advantages, mask, clip, 4.0, weights)
        else:
            episodes = None if run == "none" else torch.arange(10, 16)
            loss, stats = sequence_clip_loss(leaf, old, advantages, mask, clip, 4.0, weights, episodes=episodes)
        (grad,) = torch.autograd.grad(loss, leaf)
        results.append((loss.detach(), grad, stats))
    assert 0 < float(results[0][2]["clipfrac"]) < 1  # some rows clipped, some not
    for loss, grad, stats in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
        assert all(torch.equal(stats[k], results[0][2][k]) for k in stats)


def test_an_objective_with_todays_signature_is_called_without_episode_ids():
    """A user objective registered before `takes_episodes` existed (no `episodes` parameter) keeps working through
    `policy_loss` and `Objective.compute`, which pass the ids only to objectives that declare them."""

    def plain(logprobs, old_logprobs, advantages, mask, settings, normalizer=None, weights=None):
        return -(advantages[:, None] * logprobs * mask).sum(), {}

    register_objective("plain_test_objective")(plain)
    try:
        logprobs, mask = torch.full((2, 3), -1.0), torch.ones(2, 3)
        loss, _ = policy_loss("plain_test_objective", logprobs, logprobs, torch.ones(2), mask, episodes=torch.zeros(2))
        assert float(loss) == 6.0 and not OBJECTIVES["plain_test_objective"].takes_episodes
    finally:
        OBJECTIVES.pop("plain_test_objective")
    assert OBJECTIVES["dspo"].takes_episodes and OBJECTIVES["gspo"].takes_episodes
    assert not OBJECTIVES["grpo"].takes_episodes and not OBJECTIVES["dapo"].takes_episodes  # token terms: exact as is


# ------------------------------------------------------------------------------------------------- property
@dataclass
class Episode:
    logprobs: list[float]  # the current logprob of each position
    deltas: list[float]  # logπθ − logπold of each position (off-policy)
    mask: list[float]  # 1 on trained positions (0: an environment token)
    advantage: float
    weight: float  # its sequence-level correction weight
    cuts: list[int]  # where its samples start (besides 0)


@st.composite
def episodes(draw, scale: float) -> Episode:
    n = draw(st.integers(1, 10))
    unit = st.floats(-1.0, 1.0, allow_nan=False, allow_subnormal=False)
    offset = draw(st.sampled_from([0.0, scale, -scale]))  # a whole episode above or below the clip range too
    deltas = [offset + scale * draw(unit) for _ in range(n)]
    mask = draw(st.lists(st.sampled_from([1.0, 1.0, 1.0, 0.0]), min_size=n, max_size=n))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []  # 1-4 samples
    return Episode(
        logprobs=draw(st.lists(st.floats(-4.0, -0.05), min_size=n, max_size=n)),
        deltas=deltas,
        mask=mask,
        advantage=draw(st.floats(-2.0, 2.0, allow_subnormal=False)),
        weight=draw(st.floats(0.1, 2.0)),
        cuts=cuts,
    )


@st.composite
def cases(draw) -> dict:
    scale = draw(st.sampled_from([1e-4, 3e-4, 1e-3, 0.3]))  # small, around dspo's clip range, large
    eps = draw(st.lists(episodes(scale), min_size=1, max_size=4))
    rows = sum(len(e.cuts) + 1 for e in eps)
    return {
        "episodes": eps,
        "clip": draw(st.sampled_from([ClipRange(3e-4, 4e-4), ClipRange(0.2, 0.28)])),
        "correction": draw(st.sampled_from(["none", "episode", "token"])),
        "order": draw(st.permutations(range(rows))),  # samples of several episodes interleaved
        "pads": (draw(st.integers(0, 3)), draw(st.integers(0, 3))),  # extra padding: unsplit, split
        "token_weights": draw(st.lists(st.floats(0.1, 2.0), min_size=40, max_size=40)),
    }


def _rows(eps: list[Episode], split: bool, order: list[int] | None) -> list[tuple[int, int, int]]:
    """(episode, start, end) of each row, as positions of the episode; split: one per sample, in `order`."""
    rows = []
    for k, e in enumerate(eps):
        bounds = [0, *e.cuts, len(e.deltas)] if split else [0, len(e.deltas)]
        rows += [(k, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    return [rows[i] for i in order] if split else rows


def _batch(case: dict, split: bool, name: str):
    """Leaf logprobs [T] of every position of every episode and a padded batch gathered from it: logprobs, old
    logprobs, mask, advantages, weights as `DSPOModule._episode_share` makes them, episode ids, normalizer."""
    eps = case["episodes"]
    rows = _rows(eps, split, case["order"])
    starts = [0]
    for e in eps:
        starts.append(starts[-1] + len(e.deltas))
    flat = torch.tensor([x for e in eps for x in e.logprobs])
    leaf = flat.clone().requires_grad_(True)
    old_flat = flat - torch.tensor([x for e in eps for x in e.deltas])  # one float32 old value per token, both ways
    mask_flat = torch.tensor([x for e in eps for x in e.mask])
    width = max(b - a for _, a, b in rows) + case["pads"][split]
    index = torch.full((len(rows), width), -1)
    for r, (k, a, b) in enumerate(rows):
        index[r, : b - a] = torch.arange(starts[k] + a, starts[k] + b)
    real, safe = index >= 0, index.clamp(min=0)
    logprobs = torch.where(real, leaf[safe], -math.inf)  # padding holds -inf and NaN: it must never leak
    old = torch.where(real, old_flat[safe], math.nan)
    mask = torch.where(real, mask_flat[safe], 0.0)
    episode = torch.tensor([k for k, _, _ in rows])
    trained = mask.sum(dim=1)
    episode_trained = torch.tensor([sum(eps[k].mask) for k, _, _ in rows])
    pieces = torch.bincount(episode, minlength=len(eps))[episode].float()
    share = torch.where(episode_trained > 0, trained / episode_trained.clamp(min=1.0), 1.0 / pieces)  # sample_scale
    correction = {
        "none": None,
        "episode": torch.tensor([eps[k].weight for k, _, _ in rows])[:, None].expand(len(rows), width),
        "token": torch.tensor(case["token_weights"])[safe],
    }[case["correction"]]
    objective = OBJECTIVES[name]
    if objective.normalizer_unit == "sequence":
        weights = (torch.ones_like(mask) if correction is None else correction) * share[:, None]
        normalizer = float(len(eps))  # episodes
    else:
        weights, normalizer = correction, float(mask_flat.sum())
    advantages = torch.tensor([eps[k].advantage for k, _, _ in rows])
    return leaf, (logprobs, old, advantages, mask, case["clip"], normalizer), weights, episode


def _away_from_the_clip_edges(case: dict) -> bool:
    """Whether every episode's ratio is more than 1e-6 from a clip edge: split and unsplit sum an episode's
    log-ratios in different orders (float32 rounding, ~1e-7), which at the edge itself may decide the clip apart."""
    clip = case["clip"]
    for e in case["episodes"]:
        trained = sum(e.mask)
        if trained:
            ratio = math.exp(sum(d * m for d, m in zip(e.deltas, e.mask)) / trained)
            if min(abs(ratio - 1 - clip.clip_high), abs(ratio - 1 + clip.clip_low)) < 1e-6:
                return False
    return True


@pytest.mark.parametrize("name", ALL)
@settings(
    max_examples=examples(100),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(case=cases())
def test_split_episodes_have_the_gradient_and_loss_of_the_same_episodes_unsplit(name, case):
    """Random episodes (1-10 positions, environment tokens among them) cut into 1-4 samples at random points, their
    samples interleaved in one batch and padded to another width; log-ratio deltas small, around dspo's clip range
    and large, whole episodes above or below it; advantages of both signs; no correction, one weight per episode, or
    one per token (token weights only for the token-level objectives: dspo and gspo refuse them). The gradient with
    respect to every position's logprob and the loss equal the unsplit episodes' (atol 1e-6), and so do the ratio
    statistics: dspo's and gspo's count episodes."""
    if case["correction"] == "token" and OBJECTIVES[name].ratio_level == "sequence":
        case = {**case, "correction": "episode"}
    if OBJECTIVES[name].takes_episodes:
        assume(_away_from_the_clip_edges(case))
    out = {}
    for split in (False, True):
        leaf, args, weights, episode = _batch(case, split, name)
        loss, stats = policy_loss(name, *args, weights=weights, episodes=episode if split else None)
        (grad,) = torch.autograd.grad(loss, leaf)
        out[split] = loss.detach(), grad, stats
    (whole, whole_grad, whole_stats), (split_loss, split_grad, split_stats) = out[False], out[True]
    torch.testing.assert_close(split_loss, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(split_grad, whole_grad, atol=1e-6, rtol=1e-5)
    for key, value in whole_stats.items():
        torch.testing.assert_close(split_stats[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_an_empty_batch_with_episode_ids_has_no_ratios():
    """No rows (a rank with nothing to train in a micro-batch): empty outputs, no error from an empty id tensor."""
    from dspo.algorithms.blocks import episode_ratio

    ratio, lengths, first = episode_ratio(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    assert ratio.shape == lengths.shape == first.shape == (0,)


def test_an_objective_record_says_what_its_registration_declares():
    """`register_objective`'s facts reach the record the trainer reads: a plug-in that declares nothing gets one
    advantage per sequence and no episode ids; one that declares both gets them (dspo/gspo take episodes, grpo/dapo
    per-token advantages)."""
    from dspo.algorithms.losses import OBJECTIVES, register_objective, sequence_clip_loss

    try:
        register_objective("plain_70")(sequence_clip_loss)
        register_objective("both_70", token_advantages=True, takes_episodes=True)(sequence_clip_loss)
        plain, both = OBJECTIVES["plain_70"], OBJECTIVES["both_70"]
        assert (plain.token_advantages, plain.takes_episodes) == (False, False)
        assert (both.token_advantages, both.takes_episodes) == (True, True)
    finally:
        OBJECTIVES.pop("plain_70")
        OBJECTIVES.pop("both_70")
    assert OBJECTIVES["dspo"].takes_episodes and not OBJECTIVES["dspo"].token_advantages
    assert OBJECTIVES["grpo"].token_advantages and not OBJECTIVES["grpo"].takes_episodes
