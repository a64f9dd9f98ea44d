"""Token-budget micro-batches (algorithm.micro_batch_tokens, issue 31 point 1): packing by hand, every sequence once,
ranks agreeing on a count, config errors, and the gradient of a mini-batch equal to the fixed-size path's."""

from __future__ import annotations

import pytest
import torch

from dspo.algorithms.config import AlgorithmConfig
from dspo.data.round_builder import build_round, pack_by_tokens, split_to
from dspo.testing import build_toy_lm, toy_run
from dspo.training.module import DSPOModule
from dspo.types import QAItem, RolloutGroup, Trajectory


def test_packing_longest_first_within_the_budget_by_hand():
    lengths = [5, 12, 3, 9, 12, 4, 30]
    # longest first: 30 (alone: over the budget), then 12+12 (2x12=24), 9+5 (2x9=18 <= 24, 3x9=27 > 24), 4+3 (2x4)
    assert pack_by_tokens(lengths, 24) == [[6], [1, 4], [3, 0], [5, 2]]
    assert pack_by_tokens(lengths, 1000) == [[6, 1, 4, 3, 0, 5, 2]]
    assert pack_by_tokens([], 8) == []


def test_split_to_halves_the_largest_part_until_the_count():
    lengths = [30, 12, 12, 9, 5, 4, 3]
    parts = [[0], [1, 2], [3, 4, 5, 6]]  # padded 30, 24, 36
    assert split_to(parts, lengths, 4) == [[0], [1, 2], [3, 4], [5, 6]]
    assert split_to(parts, lengths, 3) == parts
    with pytest.raises(ValueError, match="cannot split 7 episodes into 8"):
        split_to(parts, lengths, 8)


def _groups(lengths: list[int], group_size: int = 4) -> list[RolloutGroup]:
    groups = []
    for g in range(len(lengths) // group_size):
        trajectories = [
            Trajectory([1, 2], [7] * (n - 2), [1] * (n - 2), [-0.5] * (n - 2), reward=float(i % 2))
            for i, n in enumerate(lengths[g * group_size : (g + 1) * group_size])
        ]
        groups.append(RolloutGroup(QAItem(str(g), "q", ["a"]), trajectories))
    return groups


def test_every_sequence_once_and_each_micro_batch_within_its_budget():
    lengths = [40, 6, 9, 33, 12, 7, 25, 8, 5, 18, 30, 11, 6, 14, 9, 21]
    rnd = build_round(_groups(lengths), 2, 8, 0, 0, seed=3, micro_batch_tokens=48)
    seen = []
    for minibatch in rnd.minibatches:
        for batch in minibatch:
            n, width = batch.input_ids.shape
            assert n * width <= 48 or n == 1
            seen += batch.attention_mask.sum(dim=1).tolist()
    assert sorted(seen) == sorted(lengths)
    agreed = build_round(_groups(lengths), 2, 8, 0, 0, seed=3, micro_batch_tokens=48, agree_counts=lambda c: [7, 8])
    assert [len(mb) for mb in agreed.minibatches] == [7, 8]  # split to what the other ranks run


def test_config_validates_the_budget():
    assert AlgorithmConfig().micro_batch_tokens is None
    with pytest.raises(ValueError, match=r"algorithm.micro_batch_tokens: must be >= 1 \(or null"):
        AlgorithmConfig(micro_batch_tokens=0)


@pytest.mark.parametrize("loss", ["dspo", "dapo"])
def test_the_gradient_of_a_minibatch_equals_the_fixed_size_paths(tmp_path, loss):
    lm = build_toy_lm(str(tmp_path / "lm"))

    class Probe(DSPOModule):
        def _clip_gradients(self):
            self.grads = {n: p.grad.detach().clone() for n, p in self.policy.named_parameters() if p.grad is not None}
            self.micro = [
                tuple(b.input_ids.shape) for b in self.trainer.callbacks[0].producer.state.current.minibatches[0]
            ]
            return super()._clip_gradients()

    runs = {}
    for name, budget in (("fixed", None), ("tokens", 20)):
        run = toy_run(lm, str(tmp_path / name), 1, module_cls=Probe, loss=loss, micro_batch_tokens=budget)
        run.trainer.fit(run.module, datamodule=run.datamodule)
        runs[name] = run.module
    fixed, tokens = runs["fixed"], runs["tokens"]
    assert len(tokens.micro) != len(fixed.micro) and all(n * w <= 20 or n == 1 for n, w in tokens.micro)
    assert fixed.grads.keys() == tokens.grads.keys()
    for name, grad in fixed.grads.items():
        torch.testing.assert_close(tokens.grads[name], grad, atol=1e-6, rtol=0)
    assert max(float(g.abs().max()) for g in fixed.grads.values()) > 1e-3
