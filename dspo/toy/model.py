"""A tiny random-init Qwen2 model built locally (no downloads), for tests, benchmarks and the embedded CPU default.

The model uses the real Qwen2 architecture (so vLLM and transformers run the same code paths as for Qwen2.5) with
the vocabulary of whatever tokenizer it is given. `head_dim` defaults to 64 because vLLM's CPU attention does not
support 16. The directory written by `build_tiny_model` holds config, weights (safetensors), generation config and
the tokenizer, so `vllm.LLM(dir)` and `AutoModelForCausalLM.from_pretrained(dir)` both load it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM


def _round_up(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


def build_tiny_model(
    tokenizer_path: str,
    output_dir: str,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    head_dim: int = 64,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> str:
    """Write a random-init `Qwen2ForCausalLM` sized to the tokenizer's vocabulary, plus the tokenizer, to `output_dir`.

    The vocabulary is `len(tokenizer)` rounded up to a multiple of 64 (as Qwen does, so ids of added special tokens
    fit). Weights are float32. Returns `output_dir`.
    """
    if not Path(tokenizer_path).is_dir():
        raise FileNotFoundError(f"build_tiny_model: tokenizer_path={tokenizer_path!r} is not a directory")
    if num_heads % num_kv_heads:
        raise ValueError(f"build_tiny_model: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    config = Qwen2Config(
        vocab_size=_round_up(len(tokenizer), 64),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    # A plain generation config: vLLM applies a model's generation_config.json as default sampling parameters, so
    # Qwen's (top_k=20, repetition_penalty=1.05, ...) must not leak in.
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=config.bos_token_id
    )
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@torch.no_grad()
def steer_tiny_model(model: Qwen2ForCausalLM, token_probs: dict[int, float], scale: float = 100.0) -> None:
    """Make a random tiny model emit each token of `token_probs` with about that probability at every step.

    For tests and benchmarks: a random model almost never closes a tool call, so multi-turn loops would never run.
    The last layer's value projection is set to a large constant (weight 0, bias `scale`·noise), so attention adds
    the same vector at every position and the final hidden state points in one fixed direction `u`; the output
    embedding rows of the chosen tokens are then set along `u` with the logit that gives each its probability.
    Works on tied and untied models (tied: the input embedding of those tokens changes too). In place.
    """
    if sum(token_probs.values()) >= 1.0:
        raise ValueError(f"steer_tiny_model: probabilities {token_probs} must sum to < 1")
    attn = model.model.layers[-1].self_attn
    generator = torch.Generator().manual_seed(0)
    attn.v_proj.weight.zero_()
    attn.v_proj.bias.copy_(scale * torch.randn(attn.v_proj.bias.shape, generator=generator))
    probe = torch.arange(1, 17)[None]
    hidden = model.model(input_ids=probe).last_hidden_state[0]  # [16, H], after the final norm
    direction = hidden.mean(dim=0)
    head = model.get_output_embeddings().weight
    logits = head @ direction
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[list(token_probs)] = False
    rest = torch.logsumexp(logits[keep], dim=0)
    others = 1.0 - sum(token_probs.values())
    for token, prob in token_probs.items():
        target = rest + torch.log(torch.tensor(prob / others))
        head[token] = direction * (target / direction.dot(direction))
