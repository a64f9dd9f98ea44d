"""Recall drills: each asks for a name listed before its cue, a random combination of the world's name pieces."""

from __future__ import annotations

import pytest

from dspo.toy.drills import recall_examples
from dspo.toy.tokenizer import load_tokenizer
from dspo.toy.world import load_world_meta, name_pieces

CUES = {"person", "city", "country", "company", "river"}


def test_recall_drills_ask_for_a_listed_name_built_from_the_pieces(toy) -> None:
    world, tok_dir = toy
    tokenizer = load_tokenizer(tok_dir)
    pieces = name_pieces(world)
    drills = recall_examples(tokenizer, pieces, 200, seed=0)
    assert len(drills) == 200 and drills != recall_examples(tokenizer, pieces, 200, seed=1)
    asked = set()
    for ids, weights in drills:
        start = weights.index(1.0)
        assert all(w == 1.0 for w in weights[start:]) and not any(weights[:start])
        answer = tokenizer.decode(ids[start:]).strip()
        context = tokenizer.decode(ids[:start])
        assert answer in context  # the asked name was listed before the cue
        cue = context.split()[-1]
        assert cue in CUES  # ... and a cue asks for it
        heads, rests = pieces[cue]
        assert any(answer.startswith(h) and answer[len(h) :] in rests for h in heads)  # a well-formed name of that type
        asked.add(answer)
    # random combinations: most drilled names are no entity at all (a stem with another suffix, ...)
    assert sum(name not in load_world_meta(world) for name in asked) > len(asked) / 2


def test_name_pieces_cover_every_entity_name(toy) -> None:
    world, _ = toy
    pieces = name_pieces(world)
    for name, entity in load_world_meta(world).items():
        heads, rests = pieces[entity["type"]]
        assert any(name.startswith(h) and name[len(h) :] in rests for h in heads), name


def test_names_per_drill_sets_how_many_names_compete(toy) -> None:
    world, tok_dir = toy
    tokenizer = load_tokenizer(tok_dir)
    pieces = name_pieces(world)
    heads = sorted({h for kind in CUES for h in pieces[kind][0]} | {r.strip() for r in pieces["person"][1]})
    for names in (1, 2, 4):
        for ids, weights in recall_examples(tokenizer, pieces, 50, seed=0, names_per_drill=names):
            context = tokenizer.decode(ids[: weights.index(1.0)])
            listed = [h for h in heads if h in context]
            assert names <= len(listed) <= 2 * names  # a person has two pool words, the other names one
    with pytest.raises(ValueError, match="names_per_drill"):
        recall_examples(tokenizer, pieces, 5, seed=0, names_per_drill=9)


def test_drills_need_two_entity_types(toy) -> None:
    world, tok_dir = toy
    only_people = {"person": name_pieces(world)["person"]}
    with pytest.raises(ValueError, match="at least two types"):
        recall_examples(load_tokenizer(tok_dir), only_people, 5, seed=0)
