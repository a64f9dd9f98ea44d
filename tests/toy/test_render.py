"""Demonstrations rendered through the real agent loop (dspo.toy.render)."""

from __future__ import annotations

import random

from dspo.data.qa import load_qa
from dspo.toy.demos import CORRECT, make_script
from dspo.toy.render import demo_environment, observations_in, render_demonstrations, toy_retriever
from dspo.toy.tokenizer import load_tokenizer
from dspo.toy.world import load_world_meta


def test_demonstrations_are_exact_agent_trajectories(toy) -> None:
    world, tok_dir = toy
    tokenizer = load_tokenizer(tok_dir)
    items = load_qa(world.demo, benchmark="toy", limit=30)
    meta = load_world_meta(world)
    demos = render_demonstrations(items, meta, tokenizer, toy_retriever(world), imperfect_share=0.0)
    rng = random.Random(0)
    assert [make_script(i, meta, rng, 0.0).kind for i in items] == [CORRECT] * len(items)
    assert all(d.reward == 1.0 for d in demos)  # BM25 finds every hop in this world, and the script reads it
    for item, demo in zip(items, demos):
        generated = tokenizer.decode([t for t, m in zip(demo.response_ids, demo.response_mask) if m])
        assert generated.endswith("</answer>") and "<tool_response>" not in generated
        assert demo.num_tool_calls == item.metadata["hops"]
        full = tokenizer.decode(demo.prompt_ids + demo.response_ids)
        assert len(observations_in(full)) == item.metadata["hops"]


def test_demonstrations_follow_the_configured_imperfect_kinds(toy) -> None:
    world, tok_dir = toy
    items = load_qa(world.demo, benchmark="toy", limit=12)
    demos = render_demonstrations(
        items, load_world_meta(world), load_tokenizer(tok_dir), toy_retriever(world), imperfect_share=1.0,
        imperfect_kinds=["no_search"],
    )  # fmt: skip
    assert [d.num_tool_calls for d in demos] == [0] * len(items)


def test_demo_environment_is_the_index_unless_sources_are_asked(toy) -> None:
    world, _ = toy
    index, meta = toy_retriever(world), load_world_meta(world)
    assert demo_environment(index, meta) is index
    assert demo_environment(index, meta, sources=None, agent={"topk": 2}) is index
