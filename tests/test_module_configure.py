"""DSPOModule.configure_model: how the policy is prepared for training (the rest of the module: test_module*.py)."""

from __future__ import annotations


def test_gradient_checkpointing_is_non_reentrant_whatever_transformers_defaults_to(tmp_path, monkeypatch):
    """transformers 4.x checkpoints reentrantly unless told otherwise (5.x does not); dspo's docs promise the
    non-reentrant kind (needed with FSDP2 and with inputs that do not require grad), so the call says so."""
    from transformers import Qwen2ForCausalLM

    from dspo.algorithms.config import AlgorithmConfig
    from dspo.models import ModelConfig
    from dspo.module import DSPOModule, OptimizerConfig
    from dspo.testing import build_toy_lm

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
    from dspo.module import DSPOModule, OptimizerConfig
    from dspo.testing import build_toy_lm

    path = build_toy_lm(str(tmp_path / "lm"))
    module = DSPOModule(ModelConfig(path=path), AlgorithmConfig(group_size=2, batch_groups=1), OptimizerConfig())
    module.configure_model()
    assert not module.policy.is_gradient_checkpointing
