"""The tiny random Qwen2 model: sized to the tokenizer, loadable by transformers, steerable for multi-turn tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspo.process.resources import data_dir
from dspo.toy.model import build_tiny_model, steer_tiny_model

QWEN_TOKENIZER = data_dir() / "tokenizers" / "qwen2.5"


@pytest.mark.slow
def test_build_and_steer_tiny_model(tmp_path):
    out = build_tiny_model(str(QWEN_TOKENIZER), str(tmp_path / "tiny"), hidden_size=64, num_layers=1, seed=1)
    config = json.loads((Path(out) / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config["vocab_size"] == 151680 and config["vocab_size"] >= len(tokenizer)
    assert config["head_dim"] == 64 and config["architectures"] == ["Qwen2ForCausalLM"]
    generation = json.loads((Path(out) / "generation_config.json").read_text())
    assert "top_k" not in generation and generation["eos_token_id"] == tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    close = tokenizer.convert_tokens_to_ids("</tool_call>")
    steer_tiny_model(model, {close: 0.25, tokenizer.eos_token_id: 0.05})
    with torch.no_grad():
        probs = model(torch.tensor([tokenizer.encode("any context at all, really")])).logits[0].softmax(-1)
    assert torch.allclose(probs[:, close], torch.tensor(0.25), atol=0.02)
    assert torch.allclose(probs[:, tokenizer.eos_token_id], torch.tensor(0.05), atol=0.01)
    with pytest.raises(ValueError, match="sum to < 1"):
        steer_tiny_model(model, {close: 0.7, 1: 0.4})
    with pytest.raises(FileNotFoundError, match="not a directory"):
        build_tiny_model(str(tmp_path / "missing"), str(tmp_path / "x"))
