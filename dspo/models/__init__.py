"""Model loading for the policy and the frozen reference model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspo.models.lora import LoraConfig, lora_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """A Hugging Face causal LM directory (local; dspo never downloads at run time unless you pass a hub name)."""

    path: str
    tokenizer: str | None = None  # defaults to `path`
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    attn_implementation: str | None = None  # e.g. "sdpa", "flash_attention_2"
    # FSDP wrapping / activation-checkpointing unit (dotted class names), see conf/trainer/fsdp.yaml
    decoder_layers: list[str] = field(
        default_factory=lambda: ["transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer"]
    )
    lora: LoraConfig | None = None  # null: full fine-tuning; e.g. {r: 8}: LoRA adapters on a frozen base

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got '{self.dtype}'")
        self.lora = lora_config(self.lora)  # Hydra and checkpoint hyperparameters hand over a mapping

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def load_causal_lm(config: ModelConfig) -> torch.nn.Module:
    """Load the model directory in `config.path`; a clear error when it is missing."""
    from transformers import AutoModelForCausalLM

    path = Path(config.path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={config.path}: no config.json there. Point model.path at a Hugging Face model directory "
            "(e.g. a local Qwen2.5-7B-Instruct download, or the toy model built by `dspo-train` on first run)."
        )
    kwargs = {"dtype": config.torch_dtype, "trust_remote_code": config.trust_remote_code}
    if config.attn_implementation:
        kwargs["attn_implementation"] = config.attn_implementation
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)


def load_tokenizer(config: ModelConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path, trust_remote_code=config.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
