import math
from functools import partial
from pathlib import Path

import pytest
import torch

from dspo.algorithms.advantages import group_advantages
from dspo.algorithms.rollout_correction import correction_weights
from dspo.data.round_builder import build_round, collate_trajectories, padding_share
from dspo.types import QAItem, RolloutGroup, Trajectory

QWEN_TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "qwen2.5"


def _traj(prompt_len: int, response: list[int], mask: list[int], reward: float) -> Trajectory:
    return Trajectory(
        prompt_ids=list(range(1, prompt_len + 1)),
        response_ids=response,
        response_mask=mask,
        engine_logprobs=[-0.5 if m else 0.0 for m in mask],
        reward=reward,
    )


def _group(rewards: list[float], lengths: list[int]) -> RolloutGroup:
    trajectories = [_traj(3, [7] * n, [1] * (n - 1) + [0], r) for r, n in zip(rewards, lengths)]
    return RolloutGroup(item=QAItem(id="q", question="q?", golden_answers=["a"]), trajectories=trajectories)


def test_collate_pads_and_masks_only_response_tokens():
    t1 = _traj(2, [5, 6, 7], [1, 0, 1], 1.0)
    t2 = _traj(3, [8], [1], 0.0)
    batch = collate_trajectories([t1, t2], [0.5, -0.5], pad_token_id=0, policy_version=3)
    assert batch.input_ids.tolist() == [[1, 2, 5, 6, 7], [1, 2, 3, 8, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 0, 0, 1, 0]]
    assert batch.engine_logprobs.tolist() == [[0, 0, -0.5, 0, -0.5], [0, 0, 0, -0.5, 0]]
    assert batch.advantages.tolist() == [0.5, -0.5] and batch.rewards.tolist() == [1.0, 0.0]
    assert batch.policy_version == 3
    assert padding_share([batch]) == pytest.approx(1 / 10)


def test_round_advantages_split_and_bucketing():
    groups = [_group([1, 0, 0, 1], [2, 9, 3, 8]), _group([0, 0, 1, 0], [4, 5, 6, 7])]
    rnd = build_round(groups, num_minibatches=2, micro_batch_size=2, pad_token_id=0, policy_version=1, seed=0)
    assert len(rnd.minibatches) == 2 and all(len(mb) == 2 for mb in rnd.minibatches)
    assert rnd.num_sequences == 8
    advantages = sorted(float(a) for mb in rnd.minibatches for b in mb for a in b.advantages)
    # group 1: mean 0.5, unbiased std = sqrt(1/3) -> ±0.866; group 2: mean 0.25, std 0.5 -> 1.5 and -0.5 (x3)
    expected = sorted([0.8660254] * 2 + [-0.8660254] * 2 + [1.5] + [-0.5] * 3)
    assert advantages == pytest.approx(expected, abs=1e-4)
    for mb in rnd.minibatches:  # sorted by length inside a mini-batch: micro-batch widths are non-decreasing
        widths = [b.input_ids.shape[1] for b in mb]
        assert widths == sorted(widths)
    assert 0 <= rnd.stats["padding_share"] < 0.5


def test_round_rejects_indivisible_minibatches():
    with pytest.raises(ValueError, match="num_minibatches=3"):
        build_round([_group([1, 0], [2, 3])], 3, 2, 0, 0, 0)


def test_bucketing_reduces_padding_versus_random_order():
    lengths = [2, 30, 3, 29, 4, 28, 5, 27]
    groups = [_group([1, 0, 1, 0], lengths[:4]), _group([0, 1, 0, 1], lengths[4:])]
    rnd = build_round(groups, 1, 2, 0, 0, seed=0)
    bucketed = rnd.stats["padding_share"]
    unsorted = collate_trajectories([t for g in groups for t in g.trajectories], [0.0] * 8, 0, 0)
    assert bucketed < padding_share([unsorted]) / 3
    assert torch.isfinite(rnd.minibatches[0][0].advantages).all()


def test_engine_logprobs_align_with_trainer_logprobs_on_a_multi_turn_layout(tmp_path):
    """prompt | model turn | tool turn (mask 0) | model turn; two trajectories, different prompt lengths, right-padded.

    The engine (HFEngine, fp32) and the trainer (masked_token_logprobs) run the same weights, so at every loss_mask
    position the engine logprob in the PolicyBatch must equal the trainer's to fp32 noise; one position off is far off.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspo.engines import HFEngine, SamplingConfig
    from dspo.models.logprobs import masked_token_logprobs
    from dspo.toy.model import build_tiny_model

    model_dir = build_tiny_model(str(QWEN_TOKENIZER), str(tmp_path / "tiny"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = HFEngine(model=model, tokenizer=tokenizer)
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=6, seed=0)
    tool_turn = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nDoc 1 (Title: Paris) capital\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    trajectories = []
    for question in ("Who wrote Hamlet, the play?", "Capital of France?"):
        prompt = tokenizer.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        ids, mask, logprobs = [], [], []
        for turn in range(2):  # appended exactly as the agent's Episode.append does
            (gen,) = engine.generate([prompt + ids], sampling)
            ids, mask, logprobs = ids + gen.token_ids, mask + [1] * len(gen.token_ids), logprobs + gen.logprobs
            if turn == 0:
                ids, mask, logprobs = ids + tool_turn, mask + [0] * len(tool_turn), logprobs + [0.0] * len(tool_turn)
        trajectories.append(Trajectory(prompt, response_ids=ids, response_mask=mask, engine_logprobs=logprobs))
    batch = collate_trajectories(trajectories, [1.0, -1.0], tokenizer.pad_token_id, policy_version=0)
    assert batch.input_ids.shape[1] > min(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)  # padding
    with torch.no_grad():
        trainer, _ = masked_token_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.loss_mask, temperature=sampling.temperature
        )
    keep = batch.loss_mask.bool()
    assert int(keep.sum()) == sum(t.num_generated_tokens for t in trajectories) > 4
    assert batch.engine_logprobs[~keep].eq(0).all()
    torch.testing.assert_close(batch.engine_logprobs[keep], trainer[keep], atol=1e-4, rtol=0)
    _, stats = correction_weights(trainer, batch.engine_logprobs, batch.loss_mask, "seq_mis")
    assert stats["logprob_diff_abs_mean"] < 1e-4 and stats["masked_share"] == 0
    # the check is sharp: engine logprobs one position late disagree by far more than the tolerance
    shifted = torch.zeros_like(batch.engine_logprobs)
    shifted[:, 1:] = batch.engine_logprobs[:, :-1]
    _, off_by_one = correction_weights(trainer, shifted, batch.loss_mask, "none")
    assert off_by_one["logprob_diff_abs_mean"] > 100 * stats["logprob_diff_abs_mean"] + 1e-3


REWARDS = [[1, 0, 0, 1, 1], [0, 0, 1, 0, 0], [1, 1, 0, 1, 0]]


def _named_groups(rewards: list[list[int]]) -> list[RolloutGroup]:
    """Groups whose response tokens name (group, member) as 100 + 10·g + i; lengths differ so bucketing reorders."""
    groups = []
    for g, group_rewards in enumerate(rewards):
        trajectories = [
            _traj(3, [100 + 10 * g + i] * (2 + (7 * g + 3 * i) % 6), [1] * (2 + (7 * g + 3 * i) % 6), float(r))
            for i, r in enumerate(group_rewards)
        ]
        groups.append(RolloutGroup(QAItem(id=str(g), question="q", golden_answers=["a"]), trajectories))
    return groups


def test_advantages_and_rewards_travel_with_their_trajectories():
    """Every padded row carries its own trajectory's advantage (Eq. 10 within its group) and reward, whatever the
    shuffle, split and length bucketing did to the order."""
    groups = _named_groups(REWARDS)
    rewards = REWARDS
    expected = {}
    for g, group_rewards in enumerate(rewards):
        r = torch.tensor(group_rewards, dtype=torch.float32)
        for i, value in enumerate(((r - r.mean()) / (r.std() + 1e-6)).tolist()):
            expected[100 + 10 * g + i] = (value, float(group_rewards[i]))
    seen = {}
    rnd = build_round(groups, num_minibatches=3, micro_batch_size=2, pad_token_id=0, policy_version=0, seed=5)
    for batch in (b for mb in rnd.minibatches for b in mb):
        for row, advantage, reward in zip(batch.input_ids, batch.advantages, batch.rewards):
            seen[int(row[3])] = (float(advantage), float(reward))
    assert seen.keys() == expected.keys()
    for key, (advantage, reward) in expected.items():
        assert seen[key] == pytest.approx((advantage, reward), abs=1e-5), key


def test_the_round_shuffle_is_seeded():
    """Which trajectories form each of the 3 mini-batches depends on the seed only (15 trajectories: a random split
    repeats by chance with probability 1/756756)."""
    groups = _named_groups(REWARDS)

    def split(seed: int) -> list[set[int]]:
        rnd = build_round(groups, 3, 8, 0, 0, seed=seed)
        return [{int(row[3]) for b in mb for row in b.input_ids} for mb in rnd.minibatches]

    assert split(0) == split(0) and split(0) != split(1)


def test_round_fields_versions_and_eps():
    groups = [_group([1, 0, 0, 1], [2, 9, 3, 8]), _group([0, 0, 1, 0], [4, 5, 6, 7])]
    estimator = partial(group_advantages, eps=1.0)  # the configured estimator, as the callback passes it
    rnd = build_round(groups, 2, 3, pad_token_id=0, policy_version=6, seed=0, advantages=estimator)
    assert rnd.groups is groups and rnd.policy_version == 6
    batches = [b for mb in rnd.minibatches for b in mb]
    assert all(b.policy_version == 6 for b in batches)
    # δ = 1 in Eq. 10: group 1 (std sqrt(1/3)) gives ±0.5/(0.577+1); group 2 (std 0.5) gives 0.75/1.5 and -0.25/1.5
    expected = sorted([0.5 / (3**-0.5 + 1)] * 2 + [-0.5 / (3**-0.5 + 1)] * 2 + [0.5] + [-0.25 / 1.5] * 3)
    assert sorted(float(a) for b in batches for a in b.advantages) == pytest.approx(expected, abs=1e-5)


def test_round_errors_and_empty_padding_share():
    assert padding_share([]) == 0.0
    with pytest.raises(ValueError) as err:
        build_round([], 1, 2, 0, 0, 0)
    assert str(err.value) == "build_round got no rollout groups"
    with pytest.raises(ValueError) as err:
        build_round([_group([1, 0], [2, 3])], 3, 2, 0, 0, 0)
    assert str(err.value) == (
        "2 trajectories cannot be split into algorithm.num_minibatches=3 equal mini-batches; choose B*G divisible by it"
    )


def test_collate_dtypes():
    """Token ids and attention are integer tensors, masks and per-sequence values float32 (what the trainer expects)."""
    batch = collate_trajectories([_traj(2, [5, 6], [1, 1], 1.0), _traj(1, [8], [1], 0.0)], [0.5, -0.5], 0, 0)
    assert batch.input_ids.dtype == batch.attention_mask.dtype == torch.long
    assert batch.loss_mask.dtype == batch.engine_logprobs.dtype == torch.float32
    assert batch.advantages.dtype == batch.rewards.dtype == torch.float32


def test_collate_makes_integer_rewards_and_advantages_float():
    trajectory = Trajectory([1], [2], [1], [0.0], reward=1)
    batch = collate_trajectories([trajectory, trajectory], [1, -1], 0, 0)
    assert batch.rewards.dtype == batch.advantages.dtype == torch.float32


def test_turn_credit_gives_each_turns_tokens_its_own_advantage():
    """Per-turn credit (env.reward.credit=turn): a turn's tokens get the trajectory-level advantage (Eq. 10 on outcome
    + shaping) + the group-normalized advantage of its step reward; tool tokens and the prompt get 0. By hand."""
    a = _turn_trajectory(1.0, 0.0, [0.5, None], [(0, 2), (4, 6)], 6)  # search turn, tool tokens 2-3, answer turn
    b = _turn_trajectory(0.0, 0.0, [-0.5, 0.25], [(0, 1), (3, 5)], 5)
    c = _turn_trajectory(0.0, 0.6, [None], [(0, 3)], 3)  # answered at once, wrong, with a shaping term
    group = RolloutGroup(QAItem(id="q", question="q?", golden_answers=["x"]), [a, b, c])
    rnd = build_round([group], 1, 8, pad_token_id=0, policy_version=0, seed=0, credit="turn")
    (batch,) = rnd.minibatches[0]
    assert batch.advantages.shape == batch.loss_mask.shape  # [N, L]
    # trajectory level [1, 0, 0.6]: mean 8/15, unbiased std sqrt(0.76/3) = 0.503322 -> (7/15, -8/15, 1/15) / std
    std = math.sqrt(0.76 / 3) + 1e-6
    level = [7 / 15 / std, -8 / 15 / std, 1 / 15 / std]
    # steps [0.5, -0.5, 0.25] (None elsewhere): mean 1/12, unbiased std sqrt(0.291667) = 0.540062
    sstd = math.sqrt((0.5 - 1 / 12) ** 2 / 2 + (0.5 + 1 / 12) ** 2 / 2 + (0.25 - 1 / 12) ** 2 / 2) + 1e-6
    step = [(0.5 - 1 / 12) / sstd, (-0.5 - 1 / 12) / sstd, (0.25 - 1 / 12) / sstd]
    by_len = {int(batch.attention_mask[i].sum()): i for i in range(3)}
    row_a, row_b, row_c = (batch.advantages[by_len[n]] for n in (8, 7, 5))  # prompt 2 + response
    expected_a = [0, 0] + [level[0] + step[0]] * 2 + [0, 0] + [level[0]] * 2
    expected_b = [0, 0] + [level[1] + step[1]] + [0, 0] + [level[1] + step[2]] * 2
    expected_c = [0, 0] + [level[2]] * 3
    torch.testing.assert_close(row_a, torch.tensor(expected_a, dtype=torch.float32))
    torch.testing.assert_close(row_b[:7], torch.tensor(expected_b, dtype=torch.float32))
    torch.testing.assert_close(row_c[:5], torch.tensor(expected_c, dtype=torch.float32))
    trajectory_credit = build_round([group], 1, 8, pad_token_id=0, policy_version=0, seed=0)
    assert trajectory_credit.minibatches[0][0].advantages.dim() == 1  # the default: one per sequence, from the totals


def _turn_trajectory(outcome, shaping, steps, spans, length):
    mask = [0] * length
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    total = outcome + shaping + sum(s for s in steps if s is not None)
    return Trajectory([1, 2], list(range(3, 3 + length)), mask, [0.0] * length, reward=total, outcome=outcome,
                      step_rewards=steps, turn_spans=spans)  # fmt: skip


# Levels (outcome + shaping) [1, 0, 0.6] and step rewards [0.5, -0.5, 0.25] of the group below, by hand:
# group_norm: levels mean 8/15, unbiased var (49 + 64 + 1) / 225 / 2 = 0.76/3; steps mean 1/12, unbiased var
#     (25 + 49 + 4) / 144 / 2 = 13/48
# group_mean: levels − 8/15 = (7/15, -8/15, 1/15); steps − 1/12 = (5/12, -7/12, 1/6)
# rloo (R_i − mean of the others): levels (1 − 0.3, 0 − 0.8, 0.6 − 0.5) = (0.7, -0.8, 0.1);
#     steps (0.5 + 0.125, -0.5 − 0.375, 0.25 − 0) = (0.625, -0.875, 0.25)
_LSTD, _SSTD = math.sqrt(0.76 / 3) + 1e-6, math.sqrt(13 / 48) + 1e-6
BY_HAND = {
    "group_norm": ([7 / 15 / _LSTD, -8 / 15 / _LSTD, 1 / 15 / _LSTD], [5 / 12 / _SSTD, -7 / 12 / _SSTD, 1 / 6 / _SSTD]),
    "group_mean": ([7 / 15, -8 / 15, 1 / 15], [5 / 12, -7 / 12, 1 / 6]),
    "rloo": ([0.7, -0.8, 0.1], [0.625, -0.875, 0.25]),
}


@pytest.mark.parametrize("estimator", sorted(BY_HAND))
def test_turn_credit_scores_the_step_rewards_with_the_configured_estimator(estimator):
    """Issue 39 (6): with credit=turn, both parts of a token's advantage come from `algorithm.advantage` (the step part
    was always divided by the std, so group_mean / rloo summed two scales)."""
    from dspo.algorithms.config import AlgorithmConfig

    a = _turn_trajectory(1.0, 0.0, [0.5, None], [(0, 2), (4, 6)], 6)
    b = _turn_trajectory(0.0, 0.0, [-0.5, 0.25], [(0, 1), (3, 5)], 5)
    c = _turn_trajectory(0.0, 0.6, [None], [(0, 3)], 3)
    group = RolloutGroup(QAItem(id="q", question="q?", golden_answers=["x"]), [a, b, c])
    advantages = AlgorithmConfig(advantage=estimator, filter="none", group_size=3, batch_groups=1).advantages
    (batch,) = build_round([group], 1, 8, 0, 0, seed=0, advantages=advantages, credit="turn").minibatches[0]
    level, step = BY_HAND[estimator]
    by_len = {int(batch.attention_mask[i].sum()): i for i in range(3)}
    row_a, row_b, row_c = (batch.advantages[by_len[n]] for n in (8, 7, 5))
    expected_a = [0, 0] + [level[0] + step[0]] * 2 + [0, 0] + [level[0]] * 2
    expected_b = [0, 0] + [level[1] + step[1]] + [0, 0] + [level[1] + step[2]] * 2
    torch.testing.assert_close(row_a, torch.tensor(expected_a, dtype=torch.float32))
    torch.testing.assert_close(row_b[:7], torch.tensor(expected_b, dtype=torch.float32))
    torch.testing.assert_close(row_c[:5], torch.tensor([0, 0] + [level[2]] * 3, dtype=torch.float32))


def test_turn_credit_with_ragged_turns_pools_the_groups_step_rewards():
    """Issue 43 (4): turns 1, 3 and 5 in one group, one trajectory without step rewards at all (every turn None).
    Levels (outcome + shaping, the total less the step rewards) [1, 0, 1]: mean 2/3, unbiased std sqrt(1/3) = 0.57735
    -> (1/3, -2/3, 1/3) / 0.57735 = (0.57735, -1.1547, 0.57735). Step rewards pooled over the group: B's 0.2 and 0.6,
    C's 0.2, 0.2 (its 3 other turns None): values 0.2, 0.6, 0.2, 0.2, mean 0.3, deviations (-0.1, 0.3, -0.1, -0.1),
    unbiased var (0.01 * 3 + 0.09) / 3 = 0.04, std 0.2 -> (-0.5, 1.5, -0.5, -0.5); A's one turn gets the level only."""
    from dspo.data.round_builder import turn_credit

    a = _turn_trajectory(1.0, 0.0, [], [(0, 2)], 2)  # one turn, no step rewards recorded
    b = _turn_trajectory(0.0, 0.0, [0.2, None, 0.6], [(0, 1), (2, 3), (4, 5)], 5)
    spans = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    c = _turn_trajectory(1.0, 0.0, [0.2, None, 0.2, None, None], spans, 9)
    group = RolloutGroup(QAItem(id="q", question="q?", golden_answers=["x"]), [a, b, c])
    (rows,) = turn_credit([group], partial(group_advantages, eps=0.0))
    lv = [0.5773503, -1.1547005, 0.5773503]
    assert rows[0] == pytest.approx([lv[0]] * 2)
    assert rows[1] == pytest.approx([lv[1] - 0.5, 0, lv[1], 0, lv[1] + 1.5])
    assert rows[2] == pytest.approx([lv[2] - 0.5, 0, lv[2], 0, lv[2] - 0.5, 0, lv[2], 0, lv[2]])
