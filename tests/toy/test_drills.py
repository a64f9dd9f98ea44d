"""Recall drills: each asks for a name listed before its cue, built fresh from demo-split name pieces."""

from __future__ import annotations

import pytest

from dspo.toy.drills import recall_examples
from dspo.toy.tokenizer import load_tokenizer
from dspo.toy.world import load_name_words, load_world_meta


def test_recall_drills_ask_for_a_listed_fresh_name(toy) -> None:
    world, tok_dir = toy
    tokenizer = load_tokenizer(tok_dir)
    meta = load_world_meta(world)
    words = load_name_words(world)
    other_splits = {n for n, e in meta.items() if e["split"] != "demo"}
    demo_words = {w for n, e in meta.items() if e["split"] == "demo" for w in words if w in n}
    drills = recall_examples(tokenizer, meta, words, 200, seed=0)
    assert len(drills) == 200 and drills != recall_examples(tokenizer, meta, words, 200, seed=1)
    asked = set()
    for ids, weights in drills:
        start = weights.index(1.0)
        assert all(w == 1.0 for w in weights[start:]) and not any(weights[:start])
        answer = tokenizer.decode(ids[start:]).strip()
        context = tokenizer.decode(ids[:start])
        assert answer in context  # the asked name was listed before the cue
        assert context.split()[-1] in {"person", "city", "country", "company", "river"}  # ... and a cue asks for it
        assert answer not in other_splits  # never an RL-training or evaluation entity
        assert any(answer.startswith(w) for w in demo_words)  # built from the demo split's name pieces
        asked.add(answer)
    # fresh combinations: many drilled names are no entity at all (a stem with another suffix, ...)
    assert sum(name not in meta for name in asked) > len(asked) / 2


def test_drills_need_two_entity_types(toy) -> None:
    world, tok_dir = toy
    meta = {n: e for n, e in load_world_meta(world).items() if e["type"] == "person"}
    with pytest.raises(ValueError, match="at least two types"):
        recall_examples(load_tokenizer(tok_dir), meta, load_name_words(world), 5, seed=0)
