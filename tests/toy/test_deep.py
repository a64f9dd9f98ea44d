"""Deep toy questions (issue 43, dspo/toy/deep.py): 3- and 4-hop chains that need one search per hop, written beside
the default's 1-/2-hop files without changing a byte of them, and experiment=toy_deep."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from dspo.metrics import normalize_answer
from dspo.search.corpus import load_corpus
from dspo.toy.deep import has_shortcut
from dspo.toy.world import ToyWorldConfig, answer_in_text, build_toyworld, load_world_meta

# md5 of the default world's files before the deep questions existed (commit 3ce72d7): `dspo-train` with no arguments
# must read exactly these
DEFAULT_MD5 = {
    "corpus.jsonl": "e250f292ab9502e5dc52bb5808b825e2",
    "demo.jsonl": "7554f64af1d39bbcc25e5d93c8e2194c",
    "train.jsonl": "a2d7bfd30377ec744fa78912f0431d00",
    "val.jsonl": "e73aa9ea5bd17bec2eec0969639d62b2",
    "test.jsonl": "f2115c9aa7dece47f3b5f934e0d9710b",
    "val_1hop.jsonl": "71594cc3836bb94b4956c3786db2faaf",
    "val_2hop.jsonl": "826842183ef0bf8b7cb32213052c9bd5",
    "test_1hop.jsonl": "f3504d2c3d9bff7fbee1e728da8f9530",
    "test_2hop.jsonl": "10a0ab8dd2d99a094f12bdb6072a57f8",
    "world.json": "16d76a9aa269efb83b748fa8a9a2d817",
}
# md5 of the deep files as the shipped-warm-start study read them (commit 7dcb685), and of the deep demonstrations'
# chains added after it (demo_deep.jsonl, on a stream of their own)
DEEP_MD5 = {
    "val_3hop.jsonl": "4ed667d1720d6a2e368db102439b68dd",
    "val_4hop.jsonl": "ecc5670abd212f6f2c6c9b2e6b380611",
    "test_3hop.jsonl": "9b7aa49902b75b5f8ff69091941977f3",
    "test_4hop.jsonl": "39c7c2906af5782e1638ce3a3af0d9aa",
    "train_deep.jsonl": "6d36fb01e8683fc0bf97e63cb5dfde10",
    "demo_deep.jsonl": "8cb1f914f89b4b6d87e9ecaf2a3c0c78",
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_toyworld(str(tmp_path_factory.mktemp("deep") / "world"), ToyWorldConfig())


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_default_worlds_files_are_unchanged(world):
    for name, digest in (DEFAULT_MD5 | DEEP_MD5).items():
        assert hashlib.md5((Path(world.root) / name).read_bytes()).hexdigest() == digest, name


def test_deep_demonstration_chains_stay_inside_the_demo_split(world):
    """demo_deep.jsonl (the deep warm start's demonstrations): every entity of a chain and its answer are demo
    entities, which RL and evaluation never see, and no chain has a shortcut."""
    ents = load_world_meta(world)
    rows = _rows(world.extra["demo_deep"])
    for row in rows:
        chain = [*row["metadata"]["chain"], row["golden_answers"][0]]
        assert {ents[name]["split"] for name in chain} == {"demo"}, row["id"]
        assert len(set(chain)) == len(chain) == row["metadata"]["hops"] + 1
    hops = [row["metadata"]["hops"] for row in rows]
    assert {h: hops.count(h) for h in (3, 4)} == {3: 300, 4: 112}


def test_every_hop_needs_a_search_for_the_previous_hops_answer(world):
    ents = load_world_meta(world)
    passages = {row.title: row.text for row in load_corpus(world.corpus)}
    counts = {}
    for split in ("val", "test"):
        for hops in (3, 4):
            rows = _rows(world.extra[f"{split}_{hops}hop"])
            counts[f"{split}_{hops}hop"] = len(rows)
            for row in rows:
                meta = row["metadata"]
                chain = [*meta["chain"], row["golden_answers"][0]]
                assert meta["hops"] == hops == len(meta["relations"]) == len(chain) - 1
                assert len(set(chain)) == len(chain)  # no hop's answer repeats an earlier entity
                for k, rel in enumerate(meta["relations"]):
                    assert ents[chain[k]][rel] == chain[k + 1]  # the graph's fact ...
                    assert answer_in_text(chain[k + 1], passages[chain[k]])  # ... stated in chain[k]'s passage
                assert chain[0] in row["question"] and not any(c in row["question"] for c in chain[1:])
    assert counts == {"val_3hop": 100, "val_4hop": 41, "test_3hop": 100, "test_4hop": 44}


def test_no_passage_lets_a_search_skip_a_hop(world):
    """chain[k] never shares a passage with chain[0..k-2]: only chain[k-1]'s passage (or another that names chain[k-1]
    but nothing earlier) leads to it, so a 4-hop question takes 4 searches."""
    texts = [normalize_answer(f"{p.title} {p.text}") for p in load_corpus(world.corpus)]
    for split in ("val", "test"):
        for hops in (3, 4):
            for row in _rows(world.extra[f"{split}_{hops}hop"]):
                chain = [normalize_answer(c) for c in [*row["metadata"]["chain"], row["golden_answers"][0]]]
                for k in range(2, len(chain)):
                    naming = [t for t in texts if chain[k] in t]
                    assert not any(c in t for t in naming for c in chain[: k - 1]), (row["id"], k)


def test_has_shortcut_by_hand():
    mentions = {"A": frozenset({0, 5}), "B": frozenset({0, 1}), "C": frozenset({1, 2}), "D": frozenset({2})}
    assert not has_shortcut(["A", "B", "C", "D"], mentions)  # each passage links only neighbours
    assert has_shortcut(["A", "B", "C", "D"], mentions | {"D": frozenset({2, 5})})  # passage 5 names A and D
    assert has_shortcut(["A", "B", "A"], mentions)  # the answer repeats the start


def test_train_deep_is_the_default_train_split_plus_deep_chains(world):
    train = _rows(world.train)
    mixed = _rows(world.extra["train_deep"])
    assert {r["id"] for r in train} <= {r["id"] for r in mixed} and len({r["id"] for r in mixed}) == len(mixed)
    hops = [r["metadata"]["hops"] for r in mixed]
    assert {h: hops.count(h) for h in (1, 2, 3, 4)} == {1: 300, 2: 300, 3: 300, 4: 82}


def test_toy_deep_composes_with_deep_validation_and_a_warm_start_of_its_own():
    """experiment=toy_deep: four validation benchmarks, its own toy root, and a warm start fine-tuned from the shipped
    one on deep demonstrations whose episode limits are the run's (demonstrations look like its rollouts)."""
    from omegaconf import OmegaConf

    from dspo.testing import compose_config

    deep = compose_config("train", ["experiment=toy_deep", "output_dir=/tmp/run", "paths.cache=/c"])
    assert list(deep.data.val_files) == list(deep.data.test_files) == [f"toy_{h}hop" for h in (1, 2, 3, 4)]
    assert (
        deep.rollout.agent.max_turns >= 8 and deep.rollout.agent.max_total_tokens <= deep.rollout.engine.max_model_len
    )
    agent = OmegaConf.to_container(deep.prepare.toyworld.config.agent, resolve=True)
    run = OmegaConf.to_container(deep.rollout.agent, resolve=True)
    assert {key: agent[key] for key in ("max_turns", "max_total_tokens")} == {"max_turns": 8, "max_total_tokens": 2560}
    assert all(agent[key] == run[key] for key in agent if key in run)
    toyworld = deep.prepare.toyworld
    assert deep.paths.toy_root == "/c/toyworld/toy_deep" and deep.data.train_files[0].endswith("train_deep.jsonl")
    assert toyworld.config.init_model.endswith("toy_warmstart/model") and toyworld.config.deep_demos > 0
    assert toyworld.shipped_model.endswith("toy_deep_warmstart/model")


def test_dspo_eval_lists_the_deep_benchmarks():
    """`dspo-eval data=toy_deep ...` composes (no run seed there: the data seed falls back to 0), four benchmarks."""
    from omegaconf import OmegaConf

    from dspo.testing import compose_config

    cfg = compose_config("eval", ["data=toy_deep", "paths.cache=/c"])
    data = OmegaConf.to_container(cfg.data, resolve=True)
    assert list(data["test_files"]) == ["toy_1hop", "toy_2hop", "toy_3hop", "toy_4hop"] and data["seed"] == 0
    assert data["test_files"]["toy_4hop"] == "/c/toyworld/default/world/test_4hop.jsonl"


def test_dspo_eval_composes_the_default_toy_data_too():
    """`dspo-eval data=toyworld` failed on `${seed}` (no run seed in eval.yaml); it falls back to 0 as toy_deep's."""
    from omegaconf import OmegaConf

    from dspo.testing import compose_config

    data = OmegaConf.to_container(compose_config("eval", ["data=toyworld", "paths.cache=/c"]).data, resolve=True)
    assert list(data["test_files"]) == ["toy_1hop", "toy_2hop"] and data["seed"] == 0
