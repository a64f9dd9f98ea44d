"""Warm start: demonstrations rendered through the real agent loop, a short SFT run, a loadable cached model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspo.data.demos import CORRECT, make_script
from dspo.data.qa import load_qa
from dspo.data.toyworld import ToyWorldConfig, build_toyworld, load_world_meta
from dspo.models.tokenizer import load_tokenizer
from dspo.warmstart import (
    MANIFEST,
    WarmStartConfig,
    build_toy_tokenizer,
    observations_in,
    recall_examples,
    render_demonstrations,
    sft_loss,
    toy_retriever,
    warm_start,
)

WORLD = ToyWorldConfig(
    seed=5, num_countries=8, num_people=80, num_companies=40, num_rivers=8, num_distractors=20,
    num_train=60, num_val=20, num_test=20,
)  # fmt: skip
SMALL = WarmStartConfig(
    num_demos=16, hidden_size=64, num_layers=1, num_heads=1, intermediate_size=128, steps=3, batch_size=4,
    recall_steps=3, recall_batch_size=4, warmup_steps=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    world = build_toyworld(str(root / "world"), WORLD)
    return world, build_toy_tokenizer(world, str(root / "tok"), vocab_size=1024)


def test_demonstrations_are_exact_agent_trajectories(toy) -> None:
    world, tok_dir = toy
    tokenizer = load_tokenizer(tok_dir)
    items = load_qa(world.train, benchmark="toy", limit=30)
    meta = load_world_meta(world)
    demos = render_demonstrations(items, meta, tokenizer, toy_retriever(world), imperfect_share=0.0)
    rng = random.Random(0)
    assert [make_script(i, meta, rng, 0.0).kind for i in items] == [CORRECT] * len(items)
    assert all(d.reward == 1.0 for d in demos)  # BM25 finds every hop in this world, and the script reads it
    for item, demo in zip(items, demos):
        generated = tokenizer.decode([t for t, m in zip(demo.response_ids, demo.response_mask) if m])
        assert generated.endswith("</answer>") and "<tool_response>" not in generated
        assert demo.num_search_calls == item.metadata["hops"]
        full = tokenizer.decode(demo.prompt_ids + demo.response_ids)
        assert len(observations_in(full)) == item.metadata["hops"]


def test_recall_drills_ask_for_one_listed_train_name(toy) -> None:
    world, tok_dir = toy
    tokenizer = load_tokenizer(tok_dir)
    meta = load_world_meta(world)
    train_names = {n for n, e in meta.items() if e["split"] == "train"}
    drills = recall_examples(tokenizer, meta, 50, seed=0)
    assert len(drills) == 50 and drills != recall_examples(tokenizer, meta, 50, seed=1)
    for ids, weights in drills:
        start = weights.index(1.0)
        assert all(w == 1.0 for w in weights[start:]) and not any(weights[:start])
        answer = tokenizer.decode(ids[start:]).strip()
        context = tokenizer.decode(ids[:start])
        assert answer in train_names and answer in context  # the asked name was listed before the cue
        assert context.endswith(meta[answer]["type"])  # ... and the cue names its type


def test_sft_loss_covers_only_masked_targets() -> None:
    torch.manual_seed(0)
    model = torch.nn.Module()
    vocab = 7
    logits = torch.randn(1, 4, vocab)
    model.forward = lambda input_ids, attention_mask: type("O", (), {"logits": logits})()
    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    expected = torch.nn.functional.cross_entropy(logits[0, 1:3], ids[0, 2:4])
    assert torch.allclose(sft_loss(model, ids, torch.ones_like(ids), mask), expected)


@pytest.mark.slow
def test_warm_start_writes_loadable_cached_model(toy, tmp_path) -> None:
    world, tok_dir = toy
    out = warm_start(str(tmp_path / "model"), world, tok_dir, SMALL)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.head_dim == 64 and model.config.vocab_size >= len(tokenizer)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    stats = json.loads((Path(out) / MANIFEST).read_text())["stats"]
    assert stats["demos"] == 16 and stats["final_loss"] < stats["first_loss"]
    weights = Path(out) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert warm_start(out, world, tok_dir, SMALL) == out and weights.stat().st_mtime_ns == stamp  # cached
