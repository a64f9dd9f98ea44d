"""Two sources (env=two_sources): the world split in two corpora, the right-tool share by hand, scripted demonstrations
through the real agent loop with both tools, the YAML's tools and instruction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from dspo.data.qa import load_qa
from dspo.env.rewards import EpisodeRecord, TurnRecord
from dspo.search.corpus import load_corpus
from dspo.toy import sources
from dspo.toy.render import render_demonstrations, toy_retriever
from dspo.toy.tokenizer import load_tokenizer
from dspo.toy.warmstart import WarmStartConfig, config_key
from dspo.toy.world import load_world_meta
from dspo.train import CONF_DIR
from dspo.types import QAItem

SEARCHR1 = {"tag_format": "searchr1", "topk": 1, "max_turns": 3}


def test_every_passage_is_in_exactly_one_source_by_its_entity_type(toy) -> None:
    world, _ = toy
    meta, passages = load_world_meta(world), load_corpus(world.corpus)
    split = sources.split_passages(passages, meta)
    assert sorted(p.id for kept in split.values() for p in kept) == sorted(p.id for p in passages)
    for tool, kept in split.items():
        assert {meta[p.title]["type"] for p in kept} <= set(sources.SOURCES[tool])
    with pytest.raises(ValueError, match="'city' is held by both 'a' and 'b'"):
        sources.check_sources({"a": ["city"], "b": ["city", "person"]})
    everything = sources.SOURCES["search_people"] + sources.SOURCES["search_places"]
    with pytest.raises(ValueError, match=r"sources \['b'\] hold no passage"):
        sources.split_passages(passages, meta, {"a": everything, "b": ["moon"]})


def test_chain_types_follow_the_relations() -> None:
    meta = {"chain": ["Acme Corp", "Ada Lin"], "relations": ["founded_by", "born_in"], "entity_type": "company"}
    assert sources.chain_types(meta) == ["company", "person"]
    assert [sources.source_of(kind) for kind in sources.chain_types(meta)] == ["search_people", "search_people"]
    river = {"chain": ["Oda River", "Lipton"], "relations": ["city", "country"], "entity_type": "river"}
    assert [sources.source_of(kind) for kind in sources.chain_types(river)] == ["search_places", "search_places"]
    born = {"chain": ["Ada Lin", "Lipton"], "relations": ["born_in", "country"], "entity_type": "person"}
    assert [sources.source_of(kind) for kind in sources.chain_types(born)] == ["search_people", "search_places"]


def _episode(calls: list[tuple[str, str]], answer: str | None = "Lipton") -> EpisodeRecord:
    meta = {"chain": ["Ada Lin", "Lipton"], "relations": ["born_in", "country"], "entity_type": "person", "hops": 2}
    item = QAItem("q", "In which country was Ada Lin born?", ["Oskaria"], metadata=meta)
    turns = [TurnRecord(f"<{tool}> {query} </{tool}>", call=(tool, {"query_list": [query]})) for tool, query in calls]
    return EpisodeRecord(item, turns + [TurnRecord(f"<answer>{answer}</answer>")], answer)


def test_right_tool_share_by_hand() -> None:
    reward = sources.SourceAwareSubEM()
    episodes = [
        _episode([("search_people", "Ada Lin"), ("search_places", "Lipton")], "Oskaria"),  # 2 of 2 right
        _episode([("search_places", "Ada Lin"), ("search_places", "lipton")]),  # the person in places: 1 of 2
        _episode([("search_people", "where was she born"), ("search_people", "its country")]),  # by position: 1 of 2
        _episode([("search_places", "Ada Lin"), ("search_people", "Ada Lin"), ("search_places", "x")]),  # 2 of 3
        _episode([], "Oskaria"),  # no search: no right_tool
    ]
    results = reward.score(episodes)
    assert [r.outcome for r in results] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert [r.components.get("right_tool") for r in results] == [1.0, 0.5, 0.5, pytest.approx(2 / 3), None]
    assert all(r.total == r.outcome for r in results)  # logged, not paid


@pytest.mark.parametrize("share", [1.0, 0.0])
def test_demonstrations_call_the_source_of_each_hop_through_the_agent_loop(toy, share) -> None:
    world, tok_dir = toy
    meta, items = load_world_meta(world), load_qa(world.demo, benchmark="toy", limit=24)
    config = WarmStartConfig(agent=SEARCHR1, sources={k: list(v) for k, v in sources.SOURCES.items()},
                             right_tool_share=share)  # fmt: skip
    env = sources.source_environment(load_corpus(world.corpus), meta, topk=1)
    demos = render_demonstrations(
        items, meta, load_tokenizer(tok_dir), env, 0.0, agent_overrides=SEARCHR1, sources=config.sources,
        right_tool_share=share,
    )  # fmt: skip
    searched = [d for d in demos if d.num_tool_calls]
    assert len(searched) == len(items)
    right = [d.reward_components["right_tool"] for d in searched]
    if share == 1.0:  # every hop asks its source, which holds the page: all correct, as with one search tool
        assert right == [1.0] * len(items) and all(d.reward == 1.0 for d in demos)
        assert {tool for d in demos for tool in d.tool_calls} == {"search_people", "search_places"}
    else:  # the first hop asks the other source, whose results lack the fact: the script guesses
        assert max(right) < 1.0 and sum(d.reward for d in demos) <= 2


def test_source_tools_from_the_yaml_cache_their_corpus_and_index(toy, tmp_path: Path) -> None:
    world, _ = toy
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["env=two_sources", f"paths.toy_root={Path(world.root).parent}"])
    assert cfg.env.instruction == sources.INSTRUCTION  # the YAML's copy of the prompt is the warm start's
    assert config_key(instantiate(cfg.prepare.toyworld.config, _convert_="all")) != config_key(WarmStartConfig())
    env = instantiate(cfg.env, _convert_="all")
    assert sorted(env.tools) == ["search_people", "search_places"]
    corpus = Path(world.corpus)
    people = corpus.with_name("corpus.search_people.jsonl")
    lines = [json.loads(line) for line in people.read_text().splitlines()]
    meta = load_world_meta(world)
    assert lines and all(meta[c["contents"].split("\n")[0].strip('"')]["type"] in ("person", "company") for c in lines)
    modified = people.stat().st_mtime_ns
    instantiate(cfg.env.tools.search_people)  # unchanged world: the corpus file is not rewritten
    assert people.stat().st_mtime_ns == modified
    person = next(name for name, e in meta.items() if e["type"] == "person")
    hit = env.tools["search_people"].retriever.search([person], 1)[0][0]
    assert hit.title == person
    assert env.tools["search_places"].retriever.search([person], 1)[0][0].title != person
    assert toy_retriever(world) is not None  # the one-source index still builds beside them


def test_a_warm_start_from_another_model_with_the_two_sources(toy, tmp_path: Path) -> None:
    """env=two_sources fine-tunes the shipped warm start (`init_model`) on demonstrations with both tools; a model of
    another tokenizer is refused by name."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from dspo.testing import build_toy_lm
    from dspo.toy.warmstart import warm_start

    world, tok_dir = toy
    small = WarmStartConfig(
        num_demos=8, hidden_size=64, num_layers=1, num_heads=1, intermediate_size=128, steps=2, batch_size=4,
        recall_curriculum=[], warmup_steps=1, demo_renamings=0, agent=SEARCHR1,
    )  # fmt: skip
    base = warm_start(str(tmp_path / "base"), world, tok_dir, small)
    tuned_config = replace(small, init_model=base, sources={k: list(v) for k, v in sources.SOURCES.items()})
    tuned = warm_start(str(tmp_path / "tuned"), world, tok_dir, tuned_config)
    before, after = load_file(f"{base}/model.safetensors"), load_file(f"{tuned}/model.safetensors")
    assert before.keys() == after.keys() and any(not before[k].equal(after[k]) for k in before)
    assert config_key(tuned_config) != config_key(replace(tuned_config, init_model=None))
    manifest = json.loads((Path(tuned) / "warmstart_manifest.json").read_text())
    assert manifest["stats"]["demos"] == 8
    other = build_toy_lm(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="init_model: .* was trained with another tokenizer"):
        warm_start(str(tmp_path / "bad"), world, tok_dir, replace(tuned_config, init_model=other))
