"""Warm start: its config's checks, the SFT loss, a short SFT run, a loadable cached model (the demonstrations
themselves: test_render.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspo.toy.render import render_demonstrations
from dspo.toy.sft import sft_loss
from dspo.toy.warmstart import MANIFEST, WarmStartConfig, warm_start
from dspo.toy.world import load_world_meta

SMALL = WarmStartConfig(
    num_demos=16, hidden_size=64, num_layers=1, num_heads=1, intermediate_size=128, steps=3, batch_size=4,
    recall_curriculum=[[1, 2], [2, 1]], recall_batch_size=4, warmup_steps=1, hop2_renamings=1,
)  # fmt: skip


def test_config_refuses_unknown_imperfect_kinds_and_shares_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"imperfect_kinds: unknown \['misread'\]"):
        WarmStartConfig(imperfect_kinds=["no_search", "misread"])
    with pytest.raises(ValueError, match=r"WarmStartConfig.hop2_imperfect_share must be in \[0, 1\], got 1.5"):
        WarmStartConfig(hop2_imperfect_share=1.5)


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
def test_warm_start_writes_loadable_cached_model(toy, tmp_path, monkeypatch) -> None:
    world, tok_dir = toy
    calls = []

    def spy(items, world_meta, *args, **kwargs):
        calls.append((items, world_meta))
        return render_demonstrations(items, world_meta, *args, **kwargs)

    monkeypatch.setattr("dspo.toy.warmstart.render_demonstrations", spy)
    out = warm_start(str(tmp_path / "model"), world, tok_dir, SMALL)
    meta = load_world_meta(world)
    # the demo split as built, its renamed copies, then renamed copies of its 2-hop questions only
    assert len(calls) == 1 + SMALL.demo_renamings + SMALL.hop2_renamings
    two_hop = [item for item in calls[0][0] if item.metadata["hops"] == 2]
    assert two_hop and all(len(items) == len(two_hop) for items, _ in calls[1 + SMALL.demo_renamings :])
    assert all(item.metadata["hops"] == 2 for items, _ in calls[1 + SMALL.demo_renamings :] for item in items)
    unseen = {name for name, entity in meta.items() if entity["split"] != "demo"}
    for items, call_meta in calls:
        chains = {name for item in items for name in item.metadata["chain"]}
        # the demonstrations only ever name demo-split entities: RL's training questions stay unseen
        assert chains and {call_meta[name]["split"] for name in chains} == {"demo"} and not chains & unseen
    renamed = {name for items, _ in calls[1:] for item in items for name in item.metadata["chain"]}
    assert len(renamed - set(meta)) > len(renamed) / 2  # the copies mostly use names no entity of the world has
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.head_dim == 64 and model.config.vocab_size >= len(tokenizer)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    stats = json.loads((Path(out) / MANIFEST).read_text())["stats"]
    expected_demos = 16 * (1 + SMALL.demo_renamings) + len(two_hop) * SMALL.hop2_renamings
    assert stats["demos"] == expected_demos and stats["final_loss"] < stats["first_loss"]
    weights = Path(out) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert warm_start(out, world, tok_dir, SMALL) == out and weights.stat().st_mtime_ns == stamp  # cached


def test_the_sft_thread_count_is_left_out_of_the_key_and_does_not_outlive_the_sft() -> None:
    """1 and 2 threads build the same weights bit for bit (measured: 60 + 60 SFT steps), so the shipped key holds for
    `torch_threads=1` (the suite's background rebuild); the count is torch's again afterwards, where the rebuild's
    in-process engine takes its threads from. In a fresh process: an in-process vLLM engine, which other tests of the
    session start, pins torch's thread count for good."""
    import subprocess
    import sys

    from dspo.toy.warmstart import WarmStartConfig, config_key

    assert config_key(WarmStartConfig(torch_threads=1)) == config_key(WarmStartConfig())
    code = (
        "import torch\n"
        "from dspo.toy.warmstart import _torch_threads\n"
        "torch.set_num_threads(2)\n"
        "with _torch_threads(1):\n"
        "    inside = torch.get_num_threads()\n"
        "print(inside, torch.get_num_threads())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1", "2"]
