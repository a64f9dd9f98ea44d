"""`dspo.models.lora`: the config, the injected adapters, the base forward with adapters off, the merged weights the
engine gets (and the merge from a checkpoint's adapters), and the adapter folder peft loads."""

from __future__ import annotations

import json

import pytest
import torch

from dspo.models import ModelConfig, load_causal_lm
from dspo.models.lora import (
    QWEN2_TARGETS,
    LoraConfig,
    adapter_dir,
    adapters_disabled,
    add_adapters,
    has_adapters,
    lora_config,
    lora_scalings,
    merge_adapters,
    merge_into_base,
    save_adapter,
)
from dspo.models.weights import policy_weights
from dspo.testing import build_toy_lm

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    return build_toy_lm(str(tmp_path_factory.mktemp("toy_lm")))


class Holder(torch.nn.Module):
    """Stands for DSPOModule: the policy under `policy.`."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy


def _adapted(lm_dir: str, cfg: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """The toy LM with adapters whose B is random (peft starts it at 0, which would make every check trivial)."""
    model = add_adapters(load_causal_lm(ModelConfig(path=lm_dir)), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_the_config_is_validated_with_the_key_and_converted_from_what_hydra_gives():
    assert lora_config(None) is None
    assert lora_config({"r": None, "alpha": 32}) is None  # conf/model/'s "off" (r: null)
    cfg = lora_config({"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj"]})
    assert cfg == LoraConfig(r=8, alpha=16, target_modules=["q_proj"]) and cfg.scaling == 2.0
    assert LoraConfig(r=16).target_modules == list(QWEN2_TARGETS) and LoraConfig(r=16).scaling == 2.0
    assert ModelConfig(path="x", lora={"r": 4}).lora == LoraConfig(r=4)
    with pytest.raises(ValueError, match=r"model.lora: unknown keys \['rank'\]"):
        lora_config({"r": 4, "rank": 4})
    with pytest.raises(ValueError, match="model.lora.r must be an integer >= 1"):
        LoraConfig(r=0)
    with pytest.raises(ValueError, match="model.lora.alpha must be > 0"):
        LoraConfig(r=4, alpha=0)
    with pytest.raises(ValueError, match=r"model.lora.dropout must be in \[0, 1\)"):
        LoraConfig(r=4, dropout=1.0)
    with pytest.raises(ValueError, match="model.lora.target_modules must be a non-empty list"):
        LoraConfig(r=4, target_modules="q_proj")
    with pytest.raises(ValueError, match="model.lora must be null"):
        lora_config(8)


def test_adapters_go_on_every_projection_and_only_they_train(lm_dir):
    model = add_adapters(load_causal_lm(ModelConfig(path=lm_dir)), LoraConfig(r=4))
    assert has_adapters(model) and type(model).__name__ == "Qwen2ForCausalLM"  # still the Hugging Face class
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    adapted = {n.partition(".lora_")[0].rpartition(".")[2] for n in trainable}
    assert adapted == set(QWEN2_TARGETS)
    # q_proj of the toy (hidden 16, 2 heads of 8): A [4, 16], B [16, 4]
    q = model.model.layers[0].self_attn.q_proj
    assert q.lora_A["default"].weight.shape == (4, 16) and q.lora_B["default"].weight.shape == (16, 4)
    assert not q.lora_B["default"].weight.any()  # B = 0: the adapted model starts as the base model
    torch.testing.assert_close(_logits(model), _logits(load_causal_lm(ModelConfig(path=lm_dir))), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"model.lora.target_modules=\['wq'\]"):
        add_adapters(load_causal_lm(ModelConfig(path=lm_dir)), LoraConfig(r=4, target_modules=["wq"]))


def test_adapters_disabled_is_the_base_model_and_switches_back(lm_dir):
    model = _adapted(lm_dir, LoraConfig(r=4))
    base = _logits(load_causal_lm(ModelConfig(path=lm_dir)))
    adapted = _logits(model)
    assert float((adapted - base).abs().max()) > 1e-2
    with adapters_disabled(model):
        torch.testing.assert_close(_logits(model), base, rtol=0, atol=0)
    torch.testing.assert_close(_logits(model), adapted, rtol=0, atol=0)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # grads are left as they were


@pytest.mark.parametrize("targets", [list(QWEN2_TARGETS), ["q_proj", "down_proj"]])
def test_merged_weights_have_the_base_names_and_compute_the_adapted_model(lm_dir, targets):
    cfg = LoraConfig(r=4, alpha=8, target_modules=targets)
    model = _adapted(lm_dir, cfg)
    holder = Holder(model)
    assert set(lora_scalings(holder, "policy.").values()) == {2.0}
    assert len(lora_scalings(holder, "policy.")) == len(targets)
    merged = dict(policy_weights(holder))
    plain = load_causal_lm(ModelConfig(path=lm_dir))
    assert set(merged) == set(plain.state_dict())  # names as the engine's checkpoint has them
    plain.load_state_dict(merged)
    torch.testing.assert_close(_logits(plain), _logits(model), rtol=1e-5, atol=1e-5)
    # by hand for q_proj: W + (alpha / r) * B @ A
    q = model.model.layers[0].self_attn.q_proj
    want = q.base_layer.weight + 2.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], want)
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.bias"], q.base_layer.bias)
    # from the base on disk and the adapters alone (a LoRA checkpoint), the same
    adapters = {n: t for n, t in policy_weights(holder, merged=False) if ".lora_" in n}
    from_base = merge_into_base(load_causal_lm(ModelConfig(path=lm_dir)).state_dict(), adapters, cfg.scaling)
    assert from_base.keys() == merged.keys()
    assert all(torch.equal(from_base[k], merged[k]) for k in merged)


def test_merge_is_the_identity_without_adapters_and_refuses_incomplete_ones():
    weights = [("a.weight", torch.ones(2, 2)), ("b.bias", torch.zeros(2))]
    assert merge_adapters(weights, {}) == weights
    incomplete = [("m.base_layer.weight", torch.ones(2, 2)), ("m.lora_A.default.weight", torch.ones(1, 2))]
    with pytest.raises(ValueError, match=r"LoRA weights of m are incomplete: found \['A', 'base.weight'\]"):
        merge_adapters(incomplete, {"m": 1.0})


def test_a_conv1d_target_is_refused_when_the_adapters_are_added():
    """Issue 52 (7): peft adapts a GPT-2 Conv1D (weight [in, out]) with fan_in_fan_out, and merge_adapters adds B @ A in
    nn.Linear's [out, in] layout: for the square attn.c_proj the engine would get W + s (B A) where the policy computes
    with W + s (B A)^T, without an error. Refused when the adapters are added, naming the key."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, n_positions=16))
    assert model.transformer.h[0].attn.c_proj.weight.shape == (8, 8)
    with pytest.raises(ValueError) as refused:
        add_adapters(model, LoraConfig(r=2, alpha=4, target_modules=["attn.c_proj"]))
    message = str(refused.value)
    assert "model.lora.target_modules=['attn.c_proj'] matches ['transformer.h.0.attn.c_proj']" in message
    assert "fan_in_fan_out" in message and "Name nn.Linear modules" in message


def test_merge_by_hand_and_a_base_weight_of_another_layout_is_refused():
    w, a, b = torch.eye(2), torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0]])  # W [2, 2], A [1, 2], B [2, 1]
    weights = [("m.base_layer.weight", w), ("m.lora_A.default.weight", a), ("m.lora_B.default.weight", b)]
    merged = dict(merge_adapters(weights, {"m": 0.5}))
    assert torch.equal(merged["m.weight"], torch.tensor([[1.5, 1.0], [0.0, 1.0]]))  # W + 0.5 [[1, 2], [0, 0]]
    stored_in_out = [("m.base_layer.weight", torch.zeros(3, 2)), *weights[1:]]  # B @ A is [2, 2]: not this layout
    stored_in_out[1] = ("m.lora_A.default.weight", torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"B @ A is \[2, 3\], the base weight \[3, 2\]"):
        merge_adapters(stored_in_out, {"m": 1.0})


def test_the_base_digest_samples_the_weight_files_only(tmp_path):
    """Issue 52 (7): the digest a LoRA checkpoint stores of its base: the weight files' names, sizes and sampled bytes
    (a large file is read in 64 blocks spread over it), not the other files of the folder."""
    from dspo.models.lora import DIGEST_BLOCK, DIGEST_BLOCKS, base_digest

    size = 3 * DIGEST_BLOCKS * DIGEST_BLOCK
    (tmp_path / "model.safetensors").write_bytes(bytes(size))
    (tmp_path / "config.json").write_text("{}")
    first = base_digest(tmp_path)
    (tmp_path / "config.json").write_text('{"changed": true}')
    assert base_digest(tmp_path) == first
    data = bytearray(size)
    data[(DIGEST_BLOCKS // 2) * (size - DIGEST_BLOCK) // (DIGEST_BLOCKS - 1)] = 1  # a byte of a sampled block
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    changed = base_digest(tmp_path)
    assert changed != first
    (tmp_path / "model.safetensors").rename(tmp_path / "other.safetensors")
    assert base_digest(tmp_path) not in (first, changed)


def test_the_adapter_folder_is_what_peft_loads(lm_dir, tmp_path):
    import peft

    cfg = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = _adapted(lm_dir, cfg)
    folder = save_adapter(adapter_dir(tmp_path / "model"), cfg, model.state_dict().items(), base_model=lm_dir)
    assert folder == tmp_path / "model_adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == lm_dir
    loaded = peft.PeftModel.from_pretrained(load_causal_lm(ModelConfig(path=lm_dir)), str(folder))
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        save_adapter(tmp_path / "none", cfg, load_causal_lm(ModelConfig(path=lm_dir)).state_dict().items(), lm_dir)


def test_over_a_bf16_base_the_adapters_train_in_fp32_and_the_merge_is_bf16(lm_dir):
    """docs/scaling.md's LoRA plan: the frozen base in bf16 (no update to round away), adapters in fp32."""
    model = add_adapters(load_causal_lm(ModelConfig(path=lm_dir, dtype="bfloat16")), LoraConfig(r=4))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    merged = dict(policy_weights(Holder(model)))
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    logits = model(input_ids=IDS).logits
    logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
