"""DSPOModule.configure_model and configure_optimizers: how the policy and its optimizer are prepared for training (the
rest of the module: test_module*.py)."""

from __future__ import annotations

import pytest
import torch


def test_gradient_checkpointing_is_non_reentrant_whatever_transformers_defaults_to(tmp_path, monkeypatch):
    """transformers 4.x checkpoints reentrantly unless told otherwise (5.x does not); dspo's docs promise the
    non-reentrant kind (needed with FSDP2 and with inputs that do not require grad), so the call says so."""
    from transformers import Qwen2ForCausalLM

    from dspo.algorithms.config import AlgorithmConfig
    from dspo.models import ModelConfig
    from dspo.testing import build_toy_lm
    from dspo.training.module import DSPOModule, OptimizerConfig

    calls: list[dict] = []
    real = Qwen2ForCausalLM.gradient_checkpointing_enable

    def spy(self, *args, **kwargs):
        calls.append({"args": args, **kwargs})
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Qwen2ForCausalLM, "gradient_checkpointing_enable", spy)
    path = build_toy_lm(str(tmp_path / "lm"))
    config = ModelConfig(path=path, gradient_checkpointing=True)
    module = DSPOModule(config, AlgorithmConfig(group_size=2, batch_groups=1), OptimizerConfig())
    module.configure_model()
    assert calls == [{"args": (), "gradient_checkpointing_kwargs": {"use_reentrant": False}}]
    assert module.policy.is_gradient_checkpointing


def test_gradient_checkpointing_stays_off_unless_asked(tmp_path):
    from dspo.algorithms.config import AlgorithmConfig
    from dspo.models import ModelConfig
    from dspo.testing import build_toy_lm
    from dspo.training.module import DSPOModule, OptimizerConfig

    path = build_toy_lm(str(tmp_path / "lm"))
    module = DSPOModule(ModelConfig(path=path), AlgorithmConfig(group_size=2, batch_groups=1), OptimizerConfig())
    module.configure_model()
    assert not module.policy.is_gradient_checkpointing


def test_dropout_modules_are_zeroed_in_any_model():
    from dspo.training.module import train_mode_without_dropout

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))  # no `config` attribute
    model.eval()
    train_mode_without_dropout(model)
    assert model.training and model[1].p == 0.0


def test_adamw_is_fused_where_torch_supports_it_and_falls_back_or_refuses(monkeypatch):
    from dspo.training.module import OptimizerConfig, build_adamw

    params = [torch.nn.Parameter(torch.zeros(3))]
    cfg = OptimizerConfig(lr=3e-4, betas=(0.8, 0.9), weight_decay=0.05)
    fused = build_adamw(params, cfg).defaults
    assert fused["fused"] is True  # CPU float32: fused
    multi = build_adamw(params, OptimizerConfig(lr=3e-4, betas=(0.8, 0.9), weight_decay=0.05, fused=False)).defaults
    assert multi["foreach"] is True and not multi["fused"]
    for defaults in (fused, multi):
        assert (defaults["lr"], defaults["betas"], defaults["weight_decay"]) == (3e-4, (0.8, 0.9), 0.05)
    real = torch.optim.AdamW

    def no_fused_kernel(*args, fused=None, **kwargs):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused_kernel)
    fallback = build_adamw(params, cfg).defaults
    assert fallback["foreach"] is True and fallback["lr"] == 3e-4  # auto: falls back
    with pytest.raises(ValueError, match="optimizer.fused=true"):
        build_adamw(params, OptimizerConfig(fused=True))
