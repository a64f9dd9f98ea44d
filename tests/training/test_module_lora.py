"""`DSPOModule` with `model.lora` (issue 44), through a real Lightning `Trainer` with scripted rollouts: the KL
reference is the base (no second model), only the adapters train, the engine gets merged weights, checkpoints hold
the adapters and their AdamW state, resume continues exactly, gradient checkpointing changes nothing, and the export
is a plain merged model with the adapter folder beside it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dspo.training.module
from dspo.algorithms.losses import KL_ESTIMATORS
from dspo.models import ModelConfig, load_causal_lm
from dspo.models.logprobs import masked_token_logprobs
from dspo.models.lora import LoraConfig, add_adapters
from dspo.testing import build_toy_lm, toy_run
from dspo.training.module import DSPOModule

LORA = {"r": 4, "alpha": 8}


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    return build_toy_lm(str(tmp_path_factory.mktemp("toy_lm")))


class Probe(DSPOModule):
    """Records per step: the slot, the policy's state before the step, the gradients before clipping, the logs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slots, self.weights_before, self.grads, self.logged = [], [], [], []

    def training_step(self, slot, batch_idx):
        self.slots.append(slot)
        self.weights_before.append({k: v.detach().clone() for k, v in self.policy.state_dict().items()})
        return super().training_step(slot, batch_idx)

    def _clip_gradients(self):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.policy.named_parameters() if p.grad is not None})
        return super()._clip_gradients()

    def log_dict(self, dictionary, *args, **kwargs):
        if "train/loss" in dictionary:
            self.logged.append(dict(dictionary))
        return super().log_dict(dictionary, *args, **kwargs)


def _fit(lm_dir, root, max_steps, ckpt_path=None, callbacks=(), **kwargs):
    run = toy_run(lm_dir, str(root), max_steps, module_cls=Probe, callbacks=callbacks, **kwargs)
    torch.manual_seed(0)  # peft draws A at random when the model is built, in fit (dspo-train seeds everything first)
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)
    return run


def _adapted(lm_dir, state):
    model = add_adapters(load_causal_lm(ModelConfig(path=lm_dir)), LoraConfig(**LORA))
    model.load_state_dict(state)
    return model


def _sequences(slot):
    for batch in slot.micro_batches:
        for i in range(len(batch)):
            n = int(batch.attention_mask[i].sum())
            yield batch.input_ids[i : i + 1, :n], batch.loss_mask[i : i + 1, :n], float(batch.advantages[i])


def _logprobs(model, ids, mask):
    return masked_token_logprobs(model, ids, torch.ones_like(ids), mask, temperature=1.0)[0]


def test_the_kl_reference_is_the_base_model_without_a_second_copy(lm_dir, tmp_path, monkeypatch):
    """β > 0 with LoRA: one model is loaded; step 2's gradient (adapters only) is that of
    −(1/N) Σ_i Â_i mean_t logπ + β · Σ k3(logπ_base − logπ) / T, with the base model as the reference."""
    loads = []
    monkeypatch.setattr(dspo.training.module, "load_causal_lm", lambda cfg: loads.append(cfg) or load_causal_lm(cfg))
    beta = 0.5
    run = _fit(lm_dir, tmp_path, 2, kl_coef=beta, lora=LORA)
    assert len(loads) == 1 and run.module.reference is None  # no second model
    assert run.module.has_reference
    policy, reference = _adapted(lm_dir, run.module.weights_before[1]), load_causal_lm(ModelConfig(path=lm_dir))
    seqs = list(_sequences(run.module.slots[1]))
    num_tokens = sum(float(m.sum()) for _, m, _ in seqs)
    total, kl = torch.zeros(()), 0.0
    for ids, mask, advantage in seqs:
        logprobs = _logprobs(policy, ids, mask)
        with torch.no_grad():
            ref = _logprobs(reference, ids, mask)
        k3 = (KL_ESTIMATORS["k3"](ref - logprobs) * mask).sum() / num_tokens
        total = total - advantage * logprobs.sum() / mask.sum() / len(seqs) + beta * k3
        kl += float(k3.detach())
    total.backward()
    expected = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    got = run.module.grads[1]
    assert set(got) == set(expected) and all(".lora_" in n for n in got)  # only the adapters have gradients
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4)
    assert kl > 1e-5 and run.module.logged[1]["loss/kl"] == pytest.approx(kl, rel=1e-4)
    assert run.module.logged[0]["loss/kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: step 1's policy is the base


def test_the_engine_gets_merged_weights_under_the_base_names(lm_dir, tmp_path):
    run = _fit(lm_dir, tmp_path, 2, lora=LORA)
    base = load_causal_lm(ModelConfig(path=lm_dir)).state_dict()
    pushes = run.engine.pushes
    assert [version for version, _ in pushes] == [1]  # the engine starts with the base (version 0): nothing to push
    assert pushes[0][1].keys() == base.keys()
    # after a step: the adapted policy's function, as one plain model (what vLLM loads in place)
    plain = load_causal_lm(ModelConfig(path=lm_dir))
    plain.load_state_dict(pushes[0][1])
    policy = _adapted(lm_dir, run.module.weights_before[1])
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, policy(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    moved = [k for k in base if not torch.equal(pushes[0][1][k], base[k])]
    assert moved and all("proj" in k for k in moved)  # only adapted projections change; embeddings, norms do not


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_and_resume_exactly(lm_dir, tmp_path):
    """2 steps, a checkpoint, a fresh run resumed to 4 steps: the same logged scalars and weights as 4 steps in one
    go (seeded scripted rollouts), from a checkpoint without the frozen base."""
    whole = _fit(lm_dir, tmp_path / "whole", 4, kl_coef=0.1, lora=LORA)
    first = _fit(lm_dir, tmp_path / "first", 2, kl_coef=0.1, lora=LORA)
    path = tmp_path / "lora.ckpt"
    first.trainer.save_checkpoint(str(path))
    checkpoint = torch.load(path, weights_only=True)
    keys = set(checkpoint["state_dict"])
    adapters = {f"policy.{n}" for n, p in first.module.policy.named_parameters() if p.requires_grad}
    assert keys == adapters  # no frozen base, no reference
    (optimizer,) = checkpoint["optimizer_states"]
    assert len(optimizer["state"]) == len(adapters)
    assert all(set(s) >= {"exp_avg", "exp_avg_sq"} and int(s["step"]) == 2 for s in optimizer["state"].values())
    assert checkpoint["hyper_parameters"]["model"]["lora"] == {**LoraConfig(**LORA).__dict__}
    resumed = _fit(lm_dir, tmp_path / "resumed", 4, ckpt_path=str(path), kl_coef=0.1, lora=LORA)
    assert resumed.trainer.global_step == 4 and resumed.module.weights_version == 4
    for step in (2, 3):
        want, got = whole.module.logged[step], resumed.module.logged[step - 2]
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (step, key)
    end_whole, end_resumed = whole.module.policy.state_dict(), resumed.module.policy.state_dict()
    for name, tensor in end_whole.items():
        torch.testing.assert_close(end_resumed[name], tensor, rtol=1e-6, atol=1e-8)


def test_gradient_checkpointing_gives_the_same_adapter_gradients(lm_dir, tmp_path):
    runs = []
    for checkpointing in (False, True):
        run = toy_run(lm_dir, str(tmp_path / str(checkpointing)), 1, module_cls=Probe, lora=LORA, kl_coef=0.1)
        run.module.model_cfg.gradient_checkpointing = checkpointing
        torch.manual_seed(0)  # the same adapters' A in both runs
        run.trainer.fit(run.module, datamodule=run.datamodule)
        runs.append(run.module)
    assert runs[1].policy.is_gradient_checkpointing and not runs[0].policy.is_gradient_checkpointing
    plain, checkpointed = runs[0].grads[0], runs[1].grads[0]
    assert plain.keys() == checkpointed.keys() and all(".lora_" in n for n in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7)
    assert max(float(g.abs().max()) for g in plain.values()) > 1e-4


def test_the_export_is_a_plain_merged_model_with_the_adapter_beside_it(lm_dir, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    from dspo.eval.cli import export_checkpoint

    run = _fit(lm_dir, tmp_path, 2, lora=LORA)
    model_dir = Path(run.callback.exported_to)
    merged = AutoModelForCausalLM.from_pretrained(str(model_dir))  # plain Hugging Face, no peft involved
    assert not any(".lora_" in n or "base_layer" in n for n in merged.state_dict())
    policy = run.module.policy
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
        adapter = model_dir.with_name("model_adapter")
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == LORA["r"]
        with_adapter = peft.PeftModel.from_pretrained(load_causal_lm(ModelConfig(path=lm_dir)), str(adapter))
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    # dspo-eval's export of the adapters-only checkpoint: the same merged model, and the adapter folder beside it
    path = tmp_path / "lora.ckpt"
    run.trainer.save_checkpoint(str(path))
    out, step = export_checkpoint(str(path), str(tmp_path / "exported"))
    assert step == 2 and (tmp_path / "exported_adapter" / "adapter_model.safetensors").is_file()
    from_ckpt, from_train = load_file(f"{out}/model.safetensors"), load_file(str(model_dir / "model.safetensors"))
    assert from_ckpt.keys() == from_train.keys()
    for name, tensor in from_train.items():
        torch.testing.assert_close(from_ckpt[name], tensor, rtol=0, atol=0)


def test_a_checkpoint_resumes_only_into_the_same_kind_of_training(lm_dir):
    """The state dict loads non-strictly (the frozen parts are not stored): a LoRA checkpoint resumed as full
    fine-tuning (or the reverse, or another rank) must fail with the key, not train on from the base in silence."""
    from dspo.algorithms.config import AlgorithmConfig
    from dspo.training.module import OptimizerConfig

    def module(lora):
        return DSPOModule(ModelConfig(path=lm_dir, lora=lora), AlgorithmConfig(group_size=2, batch_groups=1),
                          OptimizerConfig())  # fmt: skip

    lora_ckpt = {"hyper_parameters": {"model": {"path": lm_dir, "lora": LORA}}, "global_step": 3}
    full_ckpt = {"hyper_parameters": {"model": {"path": lm_dir, "lora": None}}, "global_step": 3}
    same = module(LORA)
    same.on_load_checkpoint(lora_ckpt)
    assert same.weights_version == 3
    module({**LORA, "dropout": 0.1}).on_load_checkpoint(lora_ckpt)  # the dropout may change
    module(None).on_load_checkpoint(full_ckpt)
    with pytest.raises(ValueError, match=r"trained with model.lora=.*this run is set to full fine-tuning"):
        module(None).on_load_checkpoint(lora_ckpt)
    with pytest.raises(ValueError, match=r"trained with full fine-tuning \(model.lora=null\), this run is set to"):
        module(LORA).on_load_checkpoint(full_ckpt)
    with pytest.raises(ValueError, match="resume with the checkpoint's model.lora"):
        module({"r": 8}).on_load_checkpoint(lora_ckpt)


def test_a_lora_checkpoint_resumes_only_on_the_base_it_was_trained_on(lm_dir, tmp_path, caplog):
    """Issue 52 (7): the frozen base is not in the checkpoint, it is reloaded from model.path: another base there would
    carry the adapters (and be the KL reference) without a word. The checkpoint stores the base's weight digest; a
    copy of the same base resumes, other weights are refused with model.path and the way out named."""
    from dspo.algorithms.config import AlgorithmConfig
    from dspo.models.lora import base_digest
    from dspo.training.module import OptimizerConfig

    def module(path):
        return DSPOModule(ModelConfig(path=path, lora=LORA), AlgorithmConfig(group_size=2, batch_groups=1),
                          OptimizerConfig())  # fmt: skip

    checkpoint = {"state_dict": {}, "hyper_parameters": {"model": {"path": lm_dir, "lora": LORA}}, "global_step": 3}
    module(lm_dir).on_save_checkpoint(checkpoint)
    assert checkpoint["dspo"]["base_digest"] == base_digest(lm_dir)
    module(str(shutil.copytree(lm_dir, tmp_path / "moved"))).on_load_checkpoint(checkpoint)
    other = build_toy_lm(str(tmp_path / "other"), seed=1)  # the same architecture, other weights
    assert base_digest(other) != base_digest(lm_dir)
    with pytest.raises(ValueError) as refused:
        module(other).on_load_checkpoint(checkpoint)
    message = str(refused.value)
    assert f"trained on the base model at {lm_dir}" in message and f"model.path={other} holds other weights" in message
    assert f"Resume with model.path={lm_dir}" in message and "ckpt_path=null" in message
    del checkpoint["dspo"]["base_digest"]  # written before digests: the path differs, which is all that is known
    with caplog.at_level(logging.WARNING, logger="dspo.models.lora"):
        module(other).on_load_checkpoint(checkpoint)
    assert "it has no weight digest" in caplog.text
