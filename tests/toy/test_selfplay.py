"""experiment=toy_selfplay's toy side (issue 57, part 2): the topics (train-split pages, no questions), the proposer
demonstrations rendered through the real agent loop and read back by the self-play parser, the warm-start key, and the
experiment's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspo.data.qa import load_qa
from dspo.env.proposals import parse_proposal
from dspo.toy.render import toy_retriever
from dspo.toy.selfplay import PROPOSED, proposer_items, render_proposer_demonstrations
from dspo.toy.tokenizer import load_tokenizer
from dspo.toy.warmstart import WarmStartConfig, config_key
from dspo.toy.world import load_world_meta


def test_topics_are_the_train_splits_askable_pages_and_carry_no_question(toy):
    world, _ = toy
    meta = load_world_meta(world)
    rows = [json.loads(line) for line in Path(world.extra["seeds"]).read_text().splitlines()]
    topics = [row["question"] for row in rows]
    assert len(set(topics)) == len(topics) > 0
    assert all(meta[t]["split"] == "train" and meta[t]["type"] != "landmark" for t in topics)
    asked = {t for t, e in meta.items() if e["split"] == "train" and e["type"] != "landmark"}
    assert set(topics) == asked
    train_questions = {item.question for item in load_qa(world.train, benchmark="toy")}
    assert not set(topics) & train_questions  # a topic is a page title, never a QA question
    assert all(row["golden_answers"] == [row["question"]] for row in rows)
    assert [item.question for item in load_qa(world.extra["seeds"], benchmark="selfplay")] == topics


@pytest.mark.parametrize("tag_format", ["searchr1", "qwen"])
def test_proposer_demonstrations_search_each_hop_and_end_in_the_worlds_question(toy, tag_format):
    world, tok_dir = toy
    tokenizer = load_tokenizer(tok_dir)
    items = load_qa(world.demo, benchmark="toy", limit=12)
    agent = {"tag_format": tag_format, "max_turns": 3, "topk": 1}
    demos = render_proposer_demonstrations(items, load_world_meta(world), tokenizer, toy_retriever(world), 0, agent)
    assert {item.metadata["hops"] for item in items} == {1, 2}
    for item, proposal_item, demo in zip(items, proposer_items(items), demos, strict=True):
        assert proposal_item.question == item.metadata["chain"][0] and proposal_item.metadata[PROPOSED] == item.question
        prompt = tokenizer.decode(demo.prompt_ids)
        assert (
            "Write a question about the topic" in prompt and item.question not in prompt
        )  # the topic, not the question
        start, end = demo.turn_spans[-1]
        proposal, reason = parse_proposal(tokenizer.decode(demo.response_ids[start:end], skip_special_tokens=True))
        assert reason == "" and proposal.question == item.question and proposal.answer == item.golden_answers[0]
        assert demo.num_tool_calls == item.metadata["hops"]  # one search per hop of the chain it asks about
        assert demo.reward_components == {"proposal_formed": 1.0} and demo.reward == 0.0


def test_proposer_demonstrations_change_the_warm_start_key_only_when_asked():
    assert config_key(WarmStartConfig()) == config_key(WarmStartConfig(proposer_demos=False, proposer_renamings=0))
    assert config_key(WarmStartConfig(proposer_demos=True)) != config_key(WarmStartConfig())
    with pytest.raises(ValueError, match="proposer_renamings"):
        WarmStartConfig(proposer_renamings=-1)


def test_toy_selfplay_composes_with_topics_for_training_and_the_toys_questions_for_validation():
    from omegaconf import OmegaConf

    from dspo.testing import compose_config

    cfg = compose_config("train", ["experiment=toy_selfplay", "output_dir=/tmp/run", "paths.cache=/c"])
    assert list(cfg.data.train_files) == ["/c/toyworld/toy_selfplay/world/seeds.jsonl"]
    assert list(cfg.data.val_files) == ["toy_1hop", "toy_2hop"]
    agent = OmegaConf.to_container(cfg.rollout.agent, resolve=True)
    assert agent["_target_"] == "dspo.agent.roles.RoleAgent" and agent["answer_role"] == "solver"
    assert [role["name"] for role in agent["roles"]] == ["proposer", "solver"]
    assert agent["max_turns"] == 3 and agent["tag_format"] == "searchr1"  # the toy's limits reach both roles
    warm = cfg.prepare.toyworld
    assert warm.config.proposer_demos and warm.shipped_model.endswith("toy_selfplay_warmstart/model")
    assert {key: warm.config.agent[key] for key in ("max_turns", "max_total_tokens")} == {
        "max_turns": agent["max_turns"],
        "max_total_tokens": agent["max_total_tokens"],
    }
