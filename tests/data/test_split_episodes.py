"""An episode trained as several samples (compacted contexts, an endpoint's prefix breaks, branches) weighs what it
would unsplit (issue 52, point 3): samples scaled by their share of the episode's trained tokens, episodes counted in
the normalizer, all samples in one micro-batch, episode statistics counting episodes."""

from __future__ import annotations

import math

import pytest
import torch

from dspo.algorithms.config import AlgorithmConfig
from dspo.data.round_builder import build_round, episode_samples
from dspo.models import ModelConfig
from dspo.testing import build_toy_lm, split_episode
from dspo.training.module import DSPOModule, OptimizerConfig
from dspo.types import QAItem, RolloutGroup, Trajectory


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    return build_toy_lm(str(tmp_path_factory.mktemp("lm")))


def _group(lengths=(9, 6, 7, 5), rewards=(1.0, 1.0, 0.0, 0.0), item="q") -> RolloutGroup:
    trajectories = []
    for k, (n, reward) in enumerate(zip(lengths, rewards)):
        response = [3 + (5 * k + 3 * i) % 40 for i in range(n)]
        mask = [0 if i == 2 else 1 for i in range(n)]  # one environment token, never trained
        trajectories.append(Trajectory([1, 4, 5], response, mask, [-1.0 if m else 0.0 for m in mask], reward))
    return RolloutGroup(QAItem(item, "question", ["a"]), trajectories)


def _split(group: RolloutGroup, pieces: dict[int, int]) -> RolloutGroup:
    """The same group with episode i trained as pieces[i] samples (same tokens, each in the same context)."""
    import copy

    group = copy.deepcopy(group)
    group.trajectories = [split_episode(t, pieces.get(i, 1)) for i, t in enumerate(group.trajectories)]
    return group


def test_sample_scales_are_each_samples_share_of_the_episodes_trained_tokens():
    trajectory = split_episode(_group().trajectories[0], 3)  # 9 tokens, 8 trained: 3 | 3 | 3 tokens, 2 | 3 | 3 trained
    samples = episode_samples(trajectory, 0.5, episode=7)
    # the final context first (`Trajectory.samples`), then the earlier ones in order
    assert [s.trajectory.response_mask for s in samples] == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    trained = [sum(s.trajectory.response_mask) for s in samples]
    assert sum(trained) == 8
    assert [s.scale for s in samples] == pytest.approx([n / 8 for n in trained])
    assert {s.episode for s in samples} == {7} and {s.advantage for s in samples} == {0.5}
    assert [s.scale for s in episode_samples(_group().trajectories[1], 1.0, 0)] == [1.0]  # unsplit: exactly 1


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3])
def test_an_episodes_samples_share_one_micro_batch(micro_batch_size):
    groups = [_split(_group(), {0: 3, 2: 2}), _split(_group(item="r"), {1: 2})]
    round_ = build_round(groups, 1, micro_batch_size, pad_token_id=0, policy_version=0, seed=3)
    (micro,) = round_.minibatches
    seen: list[int] = []
    for batch in micro:
        ids = batch.episode_ids.tolist()
        assert ids == sorted(ids, key=ids.index)  # an episode's rows are consecutive
        assert not set(ids) & set(seen)  # ... and never in two micro-batches
        seen += list(dict.fromkeys(ids))
        assert len(batch) <= micro_batch_size or len(set(ids)) == 1  # only a lone episode passes the size
    assert sorted(seen) == list(range(8))
    assert sum(len(b) for b in micro) == 8 + 2 + 1 + 1


def _gradient(lm_dir: str, groups: list[RolloutGroup], loss: str, micro_batch_size: int = 2):
    """The mini-batch's gradient and loss as `training_step` accumulates them (M = 1: on-policy, s_i = 1)."""
    algo = AlgorithmConfig(group_size=4, batch_groups=len(groups), loss=loss, micro_batch_size=micro_batch_size)
    module = DSPOModule(ModelConfig(path=lm_dir), algo, OptimizerConfig())
    module.configure_model()
    round_ = build_round(groups, 1, micro_batch_size, pad_token_id=0, policy_version=0, seed=0)
    micro = round_.minibatches[0]
    counts = module._counts(micro)
    total = 0.0
    for batch in micro:
        value, _ = module.micro_batch_loss(batch, counts)
        value.backward()
        total += float(value)
    grads = {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}
    return grads, total, counts


@pytest.mark.parametrize("loss", ["dspo", "grpo", "dapo"])
def test_a_split_episode_has_the_gradient_of_the_same_tokens_unsplit(lm_dir, loss):
    """Each later sample's context is the earlier one extended (as a compaction that rewrote nothing would leave it),
    so every token's logprob is the same split or not, and so must the gradient be. Before issue 52 the split episode
    counted 3 times in N = 10 and each sample had its own 1/|y|: its tokens weighed up to 3x the others'."""
    groups = [_group(), _group((4, 8, 6, 7), (0.0, 1.0, 0.0, 1.0), item="r")]
    whole, whole_loss, whole_counts = _gradient(lm_dir, groups, loss)
    split, split_loss, split_counts = _gradient(lm_dir, [_split(groups[0], {0: 3, 3: 2}), groups[1]], loss)
    assert whole_counts.episodes == split_counts.episodes == 8 and split_counts.sequences == 11
    assert split_loss == pytest.approx(whole_loss, abs=1e-6)
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-3  # the comparison is not between zeros
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, atol=1e-7, rtol=1e-5, msg=name)


def test_a_split_episodes_total_weight_by_hand(lm_dir):
    """Rewards 1, 1, 0, 0: Â = ±0.5 / sqrt(1/3) = ±0.866 (Eq. 10, unbiased std). With N = 4 episodes each episode's
    terms sum to weight Â/4 = 0.2165 whatever it is split into: its samples' scales (|y_seg| / |y_episode|) add to 1."""
    group = _split(_group(), {0: 2})
    round_ = build_round([group], 1, 8, pad_token_id=0, policy_version=0, seed=0)
    (batch,) = round_.minibatches[0]
    algo = AlgorithmConfig(group_size=4, batch_groups=1)
    counts = DSPOModule(ModelConfig(path=lm_dir), algo, OptimizerConfig())._counts([batch])
    assert counts.objective == 4.0 and len(batch) == 5
    advantage = 0.5 / math.sqrt(1 / 3)
    per_episode = {}
    for episode, scale, a in zip(batch.episode_ids.tolist(), batch.sample_scale.tolist(), batch.advantages.tolist()):
        per_episode[episode] = per_episode.get(episode, 0.0) + scale * a / counts.objective
    assert sorted(abs(w) for w in per_episode.values()) == pytest.approx([advantage / 4] * 4, abs=1e-6)


def test_step_statistics_count_episodes_not_samples(lm_dir, tmp_path):
    """train/reward_mean and train/response_tokens_mean describe episodes: a split episode counts once."""
    from dspo.testing import SplittingAgent, attach, toy_run

    logged: dict[str, float] = {}
    slots = []

    class Capture(DSPOModule):
        def training_step(self, slot, batch_idx):
            slots.append(slot)
            return super().training_step(slot, batch_idx)

        def log_dict(self, values, *args, **kwargs):
            logged.update(values)

    run = toy_run(lm_dir, str(tmp_path), 1, module_cls=Capture)
    attach(run.callback, SplittingAgent(pieces=2), run.engine)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    micro = slots[0].micro_batches
    rows = sum(len(b) for b in micro)
    assert rows > 8  # 2 groups of 4 episodes, most of them split in two
    heads = torch.cat([b.episode_heads() for b in micro])
    rewards = torch.cat([b.rewards for b in micro])[heads]
    tokens = float(sum(b.loss_mask.sum() for b in micro))
    assert len(rewards) == 8
    assert logged["train/reward_mean"] == pytest.approx(float(rewards.mean()))
    assert logged["train/response_tokens_mean"] == pytest.approx(tokens / 8)
