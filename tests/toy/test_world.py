"""Toy world: determinism, split disjointness, answers stated in the corpus, retrievability, caching."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dspo.search.bm25 import BM25Index
from dspo.search.corpus import load_corpus
from dspo.toy.world import (
    SPLITS,
    ToyWorldConfig,
    answer_in_text,
    build_toyworld,
    generate_world,
    load_name_words,
    load_world_meta,
)

SMALL = ToyWorldConfig(
    seed=3, num_countries=12, num_people=120, num_companies=60, num_rivers=12, num_distractors=40,
    num_train=80, num_val=30, num_test=30, num_demo=80,
)  # fmt: skip


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_toyworld(str(tmp_path_factory.mktemp("toy")), SMALL)


def test_deterministic_in_seed() -> None:
    assert generate_world(SMALL) == generate_world(SMALL)
    assert generate_world(SMALL)[1] != generate_world(replace(SMALL, seed=4))[1]


def test_formats_and_sizes(world) -> None:
    for split, n in (("train", 80), ("val", 30), ("test", 30), ("demo", 80)):
        rows = _rows(getattr(world, split))
        assert len(rows) == n and len({r["id"] for r in rows}) == n
        for r in rows:
            assert set(r) == {"id", "question", "golden_answers", "metadata"}
            assert r["metadata"]["hops"] in (1, 2) and len(r["metadata"]["chain"]) == r["metadata"]["hops"]
            assert r["metadata"]["chain"][0] in r["question"]  # BM25 can find the first passage from the question
        assert sum(r["metadata"]["hops"] == 2 for r in rows) == round(n * SMALL.hop2_fraction)
    corpus = _rows(world.corpus)
    assert all(set(c) == {"id", "contents"} and c["contents"].startswith('"') for c in corpus)


def test_val_and_test_are_split_by_question_type(world) -> None:
    for split in ("val", "test"):
        rows = _rows(getattr(world, split))
        one, two = (_rows(world.extra[f"{split}_{hops}hop"]) for hops in (1, 2))
        assert {r["metadata"]["hops"] for r in one} == {1} and {r["metadata"]["hops"] for r in two} == {2}
        assert sorted(r["id"] for r in one + two) == sorted(r["id"] for r in rows)  # the same questions, regrouped


def test_splits_use_disjoint_entities(world) -> None:
    meta = load_world_meta(world)
    used = {s: set() for s in SPLITS}
    for split in SPLITS:
        for r in _rows(getattr(world, split)):
            names = set(r["metadata"]["chain"]) | set(r["golden_answers"])
            assert {meta[n]["split"] for n in names} == {split}
            used[split] |= names
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1 :]:
            assert not used[a] & used[b], (a, b)  # demo entities (the warm start's) never reach RL or evaluation


@pytest.mark.parametrize("fractions", [(0.7, 0.15, 0.15), (0.5, 0.5, 0.0, 0.0), (0.4, 0.2, 0.2, 0.3)])
def test_split_fractions_are_validated(fractions) -> None:
    with pytest.raises(ValueError, match="split_fractions"):
        ToyWorldConfig(split_fractions=fractions)


def test_each_hop_is_stated_in_its_passage(world) -> None:
    passages = {p.title: p.text for p in load_corpus(world.corpus)}
    for split in SPLITS:
        for r in _rows(getattr(world, split)):
            chain, answer = r["metadata"]["chain"], r["golden_answers"][0]
            nxt = [*chain[1:], answer]
            for entity, value in zip(chain, nxt):
                assert answer_in_text(value, passages[entity]), (entity, value)


def test_no_name_contains_another(world) -> None:
    """Names share pool words, but no full name is a substring of another, so subEM never credits a wrong entity."""
    names = [n.lower() for n in load_world_meta(world)]
    assert len(set(names)) == len(names)
    for name in names:
        assert not any(name != other and name in other for other in names), name


def test_val_names_reuse_train_words_but_not_train_entities(world) -> None:
    meta = load_world_meta(world)
    train = {n for n, e in meta.items() if e["split"] == "train"}
    val = {n for n, e in meta.items() if e["split"] == "val"}
    assert not train & val
    train_words = {w for n in train for w in n.split()}
    assert any(w in train_words for n in val for w in n.split())


def test_name_words_belong_to_one_entity_type(world) -> None:
    """Every name word is used by names of one entity type only, so its (single) token id says the type."""
    meta = load_world_meta(world)
    words = load_name_words(world)
    types: dict[str, set[str]] = {w: set() for w in words}
    for name, e in meta.items():
        pieces = [w for w in words if w in name]
        assert pieces, name  # every name is built from pool words
        for w in pieces:
            types[w].add(e["type"])
    assert all(len(t) <= 1 for t in types.values()), {w: t for w, t in types.items() if len(t) > 1}


def test_passages_name_at_most_one_entity_per_type_besides_their_subject(world) -> None:
    meta = load_world_meta(world)
    for passage in load_corpus(world.corpus):
        mentioned = [n for n in meta if n != passage.title and n in passage.text]
        kinds = [meta[n]["type"] for n in mentioned]
        assert len(kinds) == len(set(kinds)), (passage.title, mentioned)


def test_gold_passages_retrievable(world) -> None:
    index = BM25Index.build(load_corpus(world.corpus), show_progress=False)
    rows = _rows(world.val)
    hits = index.search([r["question"] for r in rows], 3)
    rate = sum(r["metadata"]["chain"][0] in {p.title for p in h} for r, h in zip(rows, hits)) / len(rows)
    assert rate >= 0.9


def test_cached_and_rebuilt_on_config_change(world) -> None:
    before = Path(world.train).stat().st_mtime_ns
    assert build_toyworld(world.root, SMALL) == world
    assert Path(world.train).stat().st_mtime_ns == before
    build_toyworld(world.root, replace(SMALL, num_train=60))
    assert len(_rows(world.train)) == 60
    build_toyworld(world.root, SMALL)  # restore for the module's other tests


def test_too_many_questions_names_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match="num_val"):
        generate_world(replace(SMALL, num_val=5000))
