"""`DSPOModule.training_step` checked against values computed by hand, sequence by sequence, on a toy Qwen2 model.

Every run goes through a real Lightning `Trainer` with `RolloutCallback` and scripted rollouts (`dspo.testing`),
so micro-batching, padding, bucketing, old/reference logprobs and logging are the code under test; the expected
values are computed from the unpadded trajectories with a freshly loaded model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspo.algorithms.losses import KL_ESTIMATORS
from dspo.models.logprobs import masked_token_logprobs
from dspo.testing import build_toy_lm, toy_run
from dspo.training.module import DSPOModule, NonFiniteTraining


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    return build_toy_lm(str(tmp_path_factory.mktemp("toy_lm")))


class Probe(DSPOModule):
    """Records, per training step: the slot's micro-batches, the policy weights before the step, the gradient before
    clipping, and what was logged."""

    def __init__(self, *args, poison: tuple[int, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.poison, self.slots, self.weights_before, self.grads, self.logged = set(poison), [], [], [], []

    def training_step(self, slot, batch_idx):
        self.slots.append(slot)
        self.weights_before.append({k: v.detach().clone() for k, v in self.policy.state_dict().items()})
        if batch_idx in self.poison:  # a non-finite loss, as a diverged step would give
            for batch in slot.micro_batches:
                batch.advantages = torch.full_like(batch.advantages, float("nan"))
        return super().training_step(slot, batch_idx)

    def _clip_gradients(self):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.policy.named_parameters() if p.grad is not None})
        return super()._clip_gradients()

    def log_dict(self, dictionary, *args, **kwargs):
        self.logged.append(dict(dictionary))
        return super().log_dict(dictionary, *args, **kwargs)

    def log(self, name, value, *args, **kwargs):
        self.scalars = [*getattr(self, "scalars", []), (name, float(value))]  # every single value, log_dict's too
        return super().log(name, value, *args, **kwargs)

    def step_log(self, step: int) -> dict:
        return [d for d in self.logged if "train/loss" in d][step]


def _fit(lm_dir, tmp_path, max_steps, **kwargs):
    run = toy_run(lm_dir, str(tmp_path), max_steps, module_cls=Probe, **kwargs)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return run


def _load(lm_dir, state=None):
    model = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model


def _sequences(slot):
    """(input_ids [1, n], loss_mask [1, n], advantage, old logprobs or None) of every sequence, padding removed."""
    for batch in slot.micro_batches:
        for i in range(len(batch)):
            n = int(batch.attention_mask[i].sum())
            old = None if batch.old_logprobs is None else batch.old_logprobs[i : i + 1, :n]
            yield batch.input_ids[i : i + 1, :n], batch.loss_mask[i : i + 1, :n], float(batch.advantages[i]), old


def _logprobs(model, ids, mask):
    return masked_token_logprobs(model, ids, torch.ones_like(ids), mask, temperature=1.0)[0]


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_name", ["dspo", "dapo"])
def test_several_micro_batches_give_the_whole_minibatch_gradient_and_loss(lm_dir, tmp_path, loss_name):
    """8 sequences in micro-batches of 3 (3 backward passes): gradient and logged loss of the whole mini-batch.

    M = 1, so the ratio is 1 in value and the loss is −Σ_i Â_i·(unit weight): per sequence (1/N · mean over tokens)
    for dspo, per token (1/T over all tokens) for dapo (issue 20 (4): dapo's loss was logged per sequence).
    """
    run = _fit(lm_dir, tmp_path, 1, loss=loss_name)
    slot = run.module.slots[0]
    assert len(slot.micro_batches) == 3
    model = _load(lm_dir)
    seqs = list(_sequences(slot))
    num_tokens = sum(float(m.sum()) for _, m, _, _ in seqs)
    total = torch.zeros(())
    for ids, mask, advantage, _ in seqs:
        summed = _logprobs(model, ids, mask).sum()
        total = total - advantage * (summed / num_tokens if loss_name == "dapo" else summed / mask.sum() / len(seqs))
    value = -sum(a * float(m.sum()) for _, m, a, _ in seqs) / num_tokens if loss_name == "dapo" else 0.0
    expected = _grads(model, total)
    got = run.module.grads[0]
    assert set(got) == {f"{n}" for n in expected}
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4)
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-3  # the comparison is not between zeros
    assert run.module.step_log(0)["train/loss"] == pytest.approx(value, abs=1e-6)
    if loss_name == "dapo":
        assert abs(value) > 1e-3


def test_old_logprobs_come_from_the_weights_before_the_rounds_first_update(lm_dir, tmp_path):
    """M = 2: the second step's ratio compares the once-updated policy with the round's starting weights."""
    run = _fit(lm_dir, tmp_path, 2, num_minibatches=2)
    first, second = run.module.slots
    assert first.round_index == second.round_index == 0 and second.minibatch_index == 1
    start, updated = _load(lm_dir), _load(lm_dir, run.module.weights_before[1])
    ratios = []
    for ids, mask, _, old in _sequences(second):
        torch.testing.assert_close(old, _logprobs(start, ids, mask), atol=1e-5, rtol=1e-5)
        ratios.append(float((_logprobs(updated, ids, mask) - old).abs().max()))
    assert max(ratios) > 1e-3  # the update moved the policy: old ≠ current, so a stale "old" would be caught
    sequence_ratios = []  # dspo: s_i = exp(mean_t(logπ − logπ_old)) over the sequence's trained tokens (Eq. 11)
    for ids, mask, _, old in _sequences(second):
        delta = ((_logprobs(updated, ids, mask) - old) * mask).sum() / mask.sum()
        sequence_ratios.append(float(torch.exp(delta)))
    logged = run.module.step_log(1)
    assert logged["loss/ratio_max"] == pytest.approx(max(sequence_ratios), rel=1e-5)
    assert logged["loss/ratio_min"] == pytest.approx(min(sequence_ratios), rel=1e-5)
    assert logged["loss/ratio_max"] > 1.0 > logged["loss/ratio_min"]


def test_kl_path_with_a_reference_model_and_checkpoints_without_it(lm_dir, tmp_path):
    """β > 0: step 2 (policy updated once, reference = the initial model) has the gradient of
    −(1/N) Σ_i Â_i mean_t logπ + β · Σ k3 / T and logs the mini-batch's KL (issue 20 (4): not divided by micro-batches).
    """
    beta = 0.5
    run = _fit(lm_dir, tmp_path, 2, kl_coef=beta)
    slot = run.module.slots[1]
    policy, reference = _load(lm_dir, run.module.weights_before[1]), _load(lm_dir)
    seqs = list(_sequences(slot))
    num_tokens = sum(float(m.sum()) for _, m, _, _ in seqs)
    total, kl = torch.zeros(()), 0.0
    for ids, mask, advantage, _ in seqs:
        logprobs = _logprobs(policy, ids, mask)
        with torch.no_grad():
            ref = _logprobs(reference, ids, mask)
        k3 = (KL_ESTIMATORS["k3"](ref - logprobs) * mask).sum() / num_tokens
        total = total - advantage * logprobs.sum() / mask.sum() / len(seqs) + beta * k3
        kl += float(k3)
    expected = _grads(policy, total)
    for name, grad in expected.items():
        torch.testing.assert_close(run.module.grads[1][name], grad, atol=1e-6, rtol=1e-4)
    logged = run.module.step_log(1)
    assert kl > 1e-4 and logged["loss/kl"] == pytest.approx(kl, rel=1e-4)
    assert logged["train/loss"] == pytest.approx(beta * kl, rel=1e-4, abs=1e-7)  # Σ Â_i = 0 per group at ratio 1

    path = tmp_path / "kl.ckpt"
    run.trainer.save_checkpoint(str(path))
    checkpoint = torch.load(path, weights_only=True)
    keys = checkpoint["state_dict"].keys()
    assert not any(k.startswith("reference.") for k in keys) and any(k.startswith("policy.") for k in keys)
    assert checkpoint["dspo"]["weights_version"] == 2
    fresh = DSPOModule(run.module.model_cfg, run.module.algo, run.module.optim_cfg)
    fresh.configure_model()
    missing, unexpected = fresh.load_state_dict(checkpoint["state_dict"], strict=False)
    assert not unexpected and missing and all(k.startswith("reference.") for k in missing)
    for name, value in run.module.policy.state_dict().items():
        torch.testing.assert_close(fresh.policy.state_dict()[name], value)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.weights_version == 2


def test_consecutive_non_finite_steps_stop_with_a_checkpoint(lm_dir, tmp_path):
    run = toy_run(lm_dir, str(tmp_path), 5, module_cls=Probe)
    run.module.poison = {0, 1, 2}
    with pytest.raises(NonFiniteTraining, match="3 consecutive non-finite steps"):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    assert (tmp_path / "checkpoints" / "non_finite.ckpt").is_file()
    assert run.trainer.global_step == 0 and run.module.weights_version == 0


def test_policy_is_built_in_train_mode_without_dropout(tmp_path):
    """Hugging Face loads models in eval mode (its gradient checkpointing then never acts, and Lightning warns). The
    policy is put in train mode with every dropout at 0, so the trainer scores exactly what the engine sampled from."""
    import json

    from dspo.models import ModelConfig
    from dspo.testing import build_toy_lm
    from dspo.training.module import DSPOModule, OptimizerConfig

    path = build_toy_lm(str(tmp_path / "lm"))
    config = json.loads((tmp_path / "lm" / "config.json").read_text())
    config["attention_dropout"] = 0.5  # a model that would drop attention weights in train mode
    (tmp_path / "lm" / "config.json").write_text(json.dumps(config))
    from dspo.algorithms.config import AlgorithmConfig

    module = DSPOModule(ModelConfig(path=path), AlgorithmConfig(group_size=2, batch_groups=1), OptimizerConfig())
    module.configure_model()
    policy = module.policy
    assert policy.training and all(m.training for m in policy.modules())
    assert policy.config.attention_dropout == 0.0
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in policy.modules())
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        train_logits = policy(input_ids=ids).logits
        policy.eval()
        eval_logits = policy(input_ids=ids).logits
    assert torch.equal(train_logits, eval_logits)  # no randomness left in train mode
    assert policy.config.use_cache is False and module.reference is None  # β = 0: no reference model is loaded
    assert set(module.hparams) == {"model", "algorithm", "optimizer"} and module.hparams["model"]["path"] == path
    assert module.automatic_optimization is False and module.strict_loading is False
    with_kl = DSPOModule(
        ModelConfig(path=path), AlgorithmConfig(group_size=2, batch_groups=1, kl_coef=0.1), OptimizerConfig()
    )
    with_kl.configure_model()
    assert not with_kl.reference.training and not any(p.requires_grad for p in with_kl.reference.parameters())


def test_logged_step_metrics_are_the_values_of_the_minibatch(lm_dir, tmp_path):
    """Every train/* and rollout/* scalar of a step, recomputed from the step's own data and weights (M = 2, warm-up
    of 2 steps): the lr this step applied, the rewards and lengths of its mini-batch, the round it belongs to, the
    entropy under the weights before the step, the gradient norm before clipping, ratio 1 on a round's first step."""
    lr, warmup = 1e-2, 2
    run = _fit(lm_dir, tmp_path, 4, num_minibatches=2, warmup_steps=warmup)
    rollouts = [d for d in run.module.logged if "rollout/generated_tokens" in d]
    assert [d["rollout/policy_version"] for d in rollouts] == [0.0, 1.0]
    assert all(0.0 <= d["rollout/padding_share"] < 1.0 for d in rollouts)
    totals = [d["rollout/generated_tokens_total"] for d in rollouts]
    assert totals[0] == rollouts[0]["rollout/generated_tokens"] > 0
    assert totals[1] == pytest.approx(totals[0] + rollouts[1]["rollout/generated_tokens"])
    for step, slot in enumerate(run.module.slots):
        logged = run.module.step_log(step)
        rewards = torch.cat([b.rewards for b in slot.micro_batches])
        lengths = torch.cat([b.loss_mask.sum(1) for b in slot.micro_batches])
        assert logged["train/lr"] == pytest.approx(lr * min(1.0, (step + 1) / (warmup + 1)))
        assert logged["train/reward_mean"] == pytest.approx(float(rewards.mean()))
        assert logged["train/response_tokens_mean"] == pytest.approx(float(lengths.mean()))
        assert logged["train/policy_version"] == slot.round_index == step // 2
        grad_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in run.module.grads[step].values()]))
        assert logged["train/grad_norm"] == pytest.approx(float(grad_norm), rel=1e-5)
        model, entropy_sum, tokens = _load(lm_dir, run.module.weights_before[step]), 0.0, 0.0
        for batch in slot.micro_batches:
            _, entropy = masked_token_logprobs(
                model, batch.input_ids, batch.attention_mask, batch.loss_mask, with_entropy=True
            )
            entropy_sum, tokens = entropy_sum + float(entropy.sum()), tokens + float(batch.loss_mask.sum())
        assert logged["train/entropy"] == pytest.approx(entropy_sum / tokens, rel=1e-5)
        if step % 2 == 0:  # a round's first mini-batch is on-policy
            assert logged["loss/ratio_min"] == logged["loss/ratio_max"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"lr": 0.0}, "optimizer.lr must be > 0"),
        ({"lr": -1e-6}, "optimizer.lr must be > 0"),
        ({"warmup_steps": -1}, "optimizer.warmup_steps must be >= 0"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips >= 1"),
    ],
)
def test_optimizer_config_is_validated_when_built(bad, message):
    from dspo.training.module import OptimizerConfig

    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**bad)
    assert OptimizerConfig(lr=1e-6, warmup_steps=0, max_consecutive_skips=1, betas=[0.9, 0.95]).betas == (0.9, 0.95)


def test_error_messages_name_the_cause_and_the_fix(lm_dir, tmp_path, caplog):
    """The module's errors, word for word: each names what is missing and where to fix it."""
    import logging
    from types import SimpleNamespace

    from dspo.algorithms.config import AlgorithmConfig
    from dspo.models import ModelConfig
    from dspo.training.module import OptimizerConfig

    with pytest.raises(ValueError) as bad_lr:
        OptimizerConfig(lr=0.0)
    assert str(bad_lr.value) == "optimizer.lr must be > 0, got 0.0"
    with pytest.raises(ValueError) as bad_warmup:
        OptimizerConfig(warmup_steps=-1)
    assert str(bad_warmup.value) == "optimizer.warmup_steps must be >= 0 and optimizer.max_consecutive_skips >= 1"
    module = DSPOModule(ModelConfig(path=lm_dir), AlgorithmConfig(group_size=2, batch_groups=1), OptimizerConfig())
    with pytest.raises(RuntimeError) as empty:
        module.training_step(SimpleNamespace(micro_batches=[], round_batches=[]), 0)
    assert str(empty.value) == "empty train batch: RolloutCallback must be in trainer.callbacks (conf/callbacks)"
    with pytest.raises(RuntimeError) as missing:
        module._rollout_correction(torch.zeros(1, 2), SimpleNamespace(engine_logprobs=None))
    assert str(missing.value) == (
        "PolicyBatch.engine_logprobs is missing: build train batches with dspo.data.round_builder.collate_trajectories"
    )
    with pytest.raises(RuntimeError) as detached:
        module.test_step([], 0)  # a plain list: not a RolloutDataModule batch, and nobody answered it
    assert str(detached.value) == (
        "test: the batch carries no predictions; RolloutCallback (conf/callbacks) makes them at "
        "on_test_batch_start from the RolloutDataModule's EvalSlot"
    )

    run = toy_run(lm_dir, str(tmp_path), 5, module_cls=Probe)
    run.module.poison = {0, 1}
    run.module.optim_cfg.max_consecutive_skips = 2
    with caplog.at_level(logging.WARNING, logger="dspo.training.module"), pytest.raises(NonFiniteTraining) as stopped:
        run.trainer.fit(run.module, datamodule=run.datamodule)
    path = tmp_path / "checkpoints" / "non_finite.ckpt"
    assert str(stopped.value) == (
        f"2 consecutive non-finite steps (optimizer.max_consecutive_skips); checkpoint saved to {path}. "
        "Lower optimizer.lr or check the data of round 1."
    )
    assert [r.getMessage() for r in caplog.records if r.name == "dspo.training.module"] == [
        "non-finite loss or gradient at round 0 mini-batch 0: step skipped (1 in a row)",
        "non-finite loss or gradient at round 1 mini-batch 0: step skipped (2 in a row)",
    ]
    assert [v for k, v in run.module.scalars if k == "train/skipped_steps"] == [1.0, 2.0]
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == 0 and "optimizer_states" in saved  # a full checkpoint, resumable


def test_rollout_correction_weights_the_gradient_and_mismatch_is_the_minibatch_token_mean(lm_dir, tmp_path):
    """seq_tis with engine logprobs that differ from the trainer's (the scripted engine reports -1 per token): the
    step's gradient is that of the objective weighted by the correction of each sequence, over all 3 micro-batches,
    and `mismatch/logprob_diff_abs_mean` is the token mean over the whole mini-batch (not a mean of micro-batches)."""
    from dspo.algorithms.blocks import loss_normalizer
    from dspo.algorithms.losses import policy_loss
    from dspo.algorithms.rollout_correction import correction_weights

    correction = {"mode": "seq_tis", "low": 0.5, "high": 1.5}
    run = _fit(lm_dir, tmp_path, 1, rollout_correction=correction)
    slot, model = run.module.slots[0], _load(lm_dir)
    assert len(slot.micro_batches) == 3
    rows = [(b, i) for b in slot.micro_batches for i in range(len(b))]
    num_tokens = float(sum(b.loss_mask.sum() for b in slot.micro_batches))
    normalizer = loss_normalizer("sequence", len(rows), num_tokens)  # dspo averages over sequences
    total, diff, weights_seen = torch.zeros(()), 0.0, set()
    for batch, i in rows:
        n = int(batch.attention_mask[i].sum())
        ids, mask, engine = (
            batch.input_ids[i : i + 1, :n],
            batch.loss_mask[i : i + 1, :n],
            batch.engine_logprobs[i : i + 1, :n],
        )
        logprobs = _logprobs(model, ids, mask)
        weights, _ = correction_weights(logprobs.detach(), engine, mask, "seq_tis", 0.5, 1.5)
        weights_seen.add(round(float(weights[mask.bool()].max()), 6))
        advantage, clip = batch.advantages[i : i + 1], {"clip_low": 0.2, "clip_high": 0.3}
        loss, _ = policy_loss("dspo", logprobs, logprobs.detach(), advantage, mask, clip, normalizer, weights=weights)
        total = total + loss
        diff += float(((logprobs.detach() - engine).abs() * mask).sum())
    assert len(weights_seen) > 1  # the weights differ between sequences: a dropped weighting would show
    expected = _grads(model, total)
    for name, grad in expected.items():
        torch.testing.assert_close(run.module.grads[0][name], grad, atol=1e-6, rtol=1e-4)
    logged = run.module.step_log(0)
    assert logged["mismatch/logprob_diff_abs_mean"] == pytest.approx(diff / num_tokens, rel=1e-5)
    assert logged["loss/ratio_mean"] == pytest.approx(1.0) and logged["loss/clipfrac"] == 0.0


def _episodes_group(lengths, rewards, item):
    """A group of episodes with one environment token each (position 2 of the response, never trained)."""
    from dspo.types import QAItem, RolloutGroup, Trajectory

    trajectories = []
    for k, (n, reward) in enumerate(zip(lengths, rewards)):
        response = [3 + (5 * k + 3 * i) % 40 for i in range(n)]
        mask = [0 if i == 2 else 1 for i in range(n)]
        trajectories.append(Trajectory([1, 4, 5], response, mask, [-1.0 if m else 0.0 for m in mask], reward))
    return RolloutGroup(QAItem(item, "question", ["a"]), trajectories)


def _off_policy_step(lm_dir, groups, loss_name):
    """The mini-batch's loss, gradient and counts through `micro_batch_loss`, with old logprobs off the current ones:
    token t of episode e moved by ∓d_e (+ before response position 4, − after: a sample cut there has a ratio of its
    own above or below the clip range), and engine logprobs off the old ones (per-episode seq_tis weights). Both depend
    on the episode and the token's position only, which a split keeps (each sample's context is the earlier one
    extended). Also returns how many rows a per-sample ratio would clip differently from their episode's."""
    from dspo.algorithms.blocks import clipped_surrogate, episode_ratio, masked_log_ratio, sequence_ratio
    from dspo.algorithms.config import AlgorithmConfig
    from dspo.data.round_builder import build_round
    from dspo.models import ModelConfig
    from dspo.training.module import OptimizerConfig

    clip = {"clip_low": 3e-4, "clip_high": 4e-4}  # dspo's, for all four: grpo's and dapo's tokens clip too
    algo = AlgorithmConfig(group_size=4, batch_groups=len(groups), loss=loss_name, loss_kwargs=clip, micro_batch_size=3)
    module = DSPOModule(ModelConfig(path=lm_dir), algo, OptimizerConfig())
    module.configure_model()
    micro = build_round(groups, 1, 3, pad_token_id=0, policy_version=0, seed=0).minibatches[0]
    counts = module._counts(micro)
    total, differ = 0.0, 0
    for batch in micro:
        with torch.no_grad():
            current = module._logprobs(module.policy, batch)[0]
        position = torch.arange(batch.input_ids.shape[1]).float()
        size = 1e-3 * (1 + 0.25 * (batch.episode_ids % 4)).float()[:, None]
        batch.old_logprobs = (current - torch.where(position < 7, size, -size)) * batch.loss_mask
        wobble = 0.05 * torch.cos(position + 3 * batch.episode_ids[:, None])
        batch.engine_logprobs = (batch.old_logprobs + wobble) * batch.loss_mask
        delta, mask = masked_log_ratio(current, batch.old_logprobs, batch.loss_mask)
        per_row = clipped_surrogate(sequence_ratio(delta, mask)[0], batch.advantages, 3e-4, 4e-4)[1]
        per_episode = clipped_surrogate(episode_ratio(delta, mask, batch.episode_ids)[0], batch.advantages, 3e-4, 4e-4)
        differ += int((per_row != per_episode[1]).sum())
        value, _ = module.micro_batch_loss(batch, counts)
        value.backward()
        total += float(value.detach())
    grads = {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}
    return grads, total, counts, differ


@pytest.mark.parametrize("loss_name", ["dspo", "gspo", "grpo", "dapo"])
def test_split_episodes_train_as_unsplit_off_policy_through_the_module(lm_dir, loss_name):
    """Issue 70, item 3: episodes cut into 2 to 4 samples (`Trajectory.segments`, expanded by `build_round` and
    collated by `collate_trajectories`) give the parameters the gradient and the loss of the same episodes unsplit,
    with old logprobs off the current ones (an off-policy mini-batch) and per-episode correction weights. Per-sample
    ratios (before issue 70) clipped the samples on their own: dspo's and gspo's gradients differed."""
    from dspo.testing import split_episode

    groups = [_episodes_group((9, 6, 7, 5), (1, 1, 0, 0), "q"), _episodes_group((4, 8, 6, 7), (0, 1, 0, 1), "r")]
    whole, whole_loss, whole_counts, _ = _off_policy_step(lm_dir, groups, loss_name)
    for group, pieces in zip(groups, ({0: 3, 3: 2}, {1: 2, 2: 4})):
        group.trajectories = [split_episode(t, pieces.get(i, 1)) for i, t in enumerate(group.trajectories)]
    split, split_loss, split_counts, differ = _off_policy_step(lm_dir, groups, loss_name)
    assert whole_counts.episodes == split_counts.episodes == 8 and split_counts.sequences == 8 + 2 + 1 + 1 + 3
    assert differ > 0  # some sample's own ratio would be clipped where its episode's is not, or the reverse
    assert split_loss == pytest.approx(whole_loss, abs=1e-6)
    assert max(float(g.abs().max()) for g in whole.values()) > 1e-3  # the comparison is not between zeros
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_token_means_use_the_token_count_of_all_ranks(lm_dir, tmp_path, monkeypatch):
    """dapo with a world of 2 ranks that hold the same data (strategy.reduce sums the two counts): the token count is
    reduced once per step with "sum", and the gradient equals the single-process one (global tokens / ranks, which
    DDP's gradient averaging then undoes), not twice or half of it."""
    import lightning.pytorch as pl

    single = _fit(lm_dir, tmp_path / "single", 1, loss="dapo")
    run = toy_run(lm_dir, str(tmp_path / "two"), 1, module_cls=Probe, loss="dapo")
    reduced = []

    def reduce(value, reduce_op):
        reduced.append((value.tolist(), reduce_op))
        return value * 2

    monkeypatch.setattr(pl.Trainer, "world_size", property(lambda self: 2))
    run.trainer.strategy.reduce = reduce
    run.trainer.fit(run.module, datamodule=run.datamodule)
    micro = run.module.slots[0].micro_batches
    tokens, episodes = float(sum(b.loss_mask.sum() for b in micro)), float(sum(len(b) for b in micro))
    assert reduced == [([tokens, episodes], "sum")]  # one collective: tokens and episodes
    for name, grad in single.module.grads[0].items():
        torch.testing.assert_close(run.module.grads[0][name], grad, atol=1e-7, rtol=1e-5)


class GradientPoison(Probe):
    """Makes the gradient (not the loss) of the listed steps non-finite."""

    def __init__(self, *args, grad_poison: tuple[int, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.grad_poison, self._hook = set(grad_poison), None

    def training_step(self, slot, batch_idx):
        if batch_idx in self.grad_poison:
            self._hook = self.policy.lm_head.weight.register_hook(lambda g: g * float("nan"))
        try:
            return super().training_step(slot, batch_idx)
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None


def test_a_finite_loss_with_a_non_finite_gradient_is_skipped(lm_dir, tmp_path):
    run = toy_run(lm_dir, str(tmp_path), 1, module_cls=GradientPoison)
    run.module.grad_poison = {0}
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.module.weights_version == 1 and len(run.module.slots) == 2  # step 0 skipped, step 1 applied
    before, after = run.module.weights_before
    for name, value in before.items():
        assert torch.equal(after[name], value), name  # nothing of the poisoned step reached the weights


def test_the_skip_counter_restarts_after_an_applied_step(lm_dir, tmp_path):
    """Skips at batches 0, 2 and 3 with max_consecutive_skips = 3: never 3 in a row, so the run ends normally."""
    run = toy_run(lm_dir, str(tmp_path), 3, module_cls=Probe)
    run.module.poison = {0, 2, 3}
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert run.trainer.global_step == 3 and run.module.weights_version == 3
    assert [v for k, v in run.module.scalars if k == "train/skipped_steps"] == [1.0, 1.0, 2.0]


def test_resume_through_lightning_with_a_reference_model(lm_dir, tmp_path):
    """β > 0: the checkpoint has no `reference.*` weights, and Lightning's resume must load it anyway."""
    first = toy_run(lm_dir, str(tmp_path / "a"), 1, kl_coef=0.1)
    first.trainer.fit(first.module, datamodule=first.datamodule)
    path = str(tmp_path / "kl.ckpt")
    first.trainer.save_checkpoint(path)
    resumed = toy_run(lm_dir, str(tmp_path / "b"), 2, kl_coef=0.1)
    resumed.trainer.fit(resumed.module, datamodule=resumed.datamodule, ckpt_path=path)
    assert resumed.trainer.global_step == 2 and resumed.module.weights_version == 2
