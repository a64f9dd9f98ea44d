"""`DSPOModule.training_step` checked against values computed by hand, sequence by sequence, on a toy Qwen2 model.

Every run goes through a real Lightning `Trainer` with `EnvironmentCallback` and scripted rollouts (`dspo.testing`),
so micro-batching, padding, bucketing, old/reference logprobs and logging are the code under test; the expected
values are computed from the unpadded trajectories with a freshly loaded model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspo.algorithms.losses import KL_ESTIMATORS
from dspo.models.logprobs import masked_token_logprobs
from dspo.module import DSPOModule, NonFiniteTraining
from dspo.testing import build_toy_lm, toy_run


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
    assert run.module.step_log(1)["loss/ratio_max"] > 1.0 > run.module.step_log(1)["loss/ratio_min"]


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
    from dspo.module import DSPOModule, OptimizerConfig
    from dspo.testing import build_toy_lm

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
