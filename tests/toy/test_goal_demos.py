"""Demonstrations of goal and reflection for env=goal_reflect's warm start (dspo.toy.goal_demos), rendered through the
real agent loop in both tag formats, scored by env=goal_reflect's reward."""

from __future__ import annotations

import random

import pytest

from dspo.data.qa import load_qa
from dspo.env.goal_reflect import goal_of, verdict_of
from dspo.toy.demos import make_script
from dspo.toy.goal_demos import GoalReflectScript
from dspo.toy.render import demo_environment, render_demonstrations, toy_retriever
from dspo.toy.tokenizer import load_tokenizer
from dspo.toy.warmstart import WarmStartConfig, config_key
from dspo.toy.world import load_world_meta


def _render(toy, tag_format: str, noise: float, limit: int = 16, **kwargs):
    world, tok_dir = toy
    items = load_qa(world.demo, benchmark="toy", limit=limit)
    agent = {"tag_format": tag_format, "max_turns": 3, "topk": 1}
    env = demo_environment(toy_retriever(world), load_world_meta(world), None, agent, goal_reflect=True, noise=noise)
    demos = render_demonstrations(
        items, load_world_meta(world), load_tokenizer(tok_dir), env, 0.0, 0, agent, goal_reflect=True, **kwargs
    )
    return items, demos


@pytest.mark.parametrize("tag_format", ["searchr1", "qwen"])
def test_clean_demonstrations_state_a_goal_per_search_and_reflect_rightly(toy, tag_format) -> None:
    items, demos = _render(toy, tag_format, noise=0.0)
    for item, demo in zip(items, demos):
        components = demo.reward_components
        assert demo.num_tool_calls == item.metadata["hops"] and demo.outcome == 1.0  # BM25 finds every hop here
        assert components["goal_share"] == components["reflect_share"] == components["reflect_right"] == 1.0
        assert demo.reward == pytest.approx(1.2)  # subEM + reflection_weight 0.2
        assert demo.response_text.count("<reflect> yes") == item.metadata["hops"]
        assert "<goal> the " in demo.response_text


def test_noisy_results_are_reflected_on_as_missing_and_a_hop_is_searched_again_within_the_budget(toy) -> None:
    items, demos = _render(toy, "searchr1", noise=1.0)
    for item, demo in zip(items, demos):
        hops = item.metadata["hops"]
        assert demo.reward_components["held_share"] == 0.0  # every page a distractor
        assert demo.reward_components["reflect_right"] == 1.0  # every reflection says no, rightly
        # 3 turns = 2 searches: a 1-hop question searches its hop again; a 2-hop one has no room to
        assert demo.num_tool_calls == (2 if hops == 1 else 1)
        assert "<reflect> no" in demo.response_text and "<reflect> yes" not in demo.response_text


def test_the_wrapper_adds_the_format_and_leaves_the_wrapped_policys_choices(toy) -> None:
    world, _ = toy
    meta, item = load_world_meta(world), load_qa(world.demo, benchmark="toy", limit=1)[0]
    plain = make_script(item, meta, random.Random(3), 1.0, "searchr1", imperfect_kinds=["no_search"])
    wrapped = GoalReflectScript(
        make_script(item, meta, random.Random(3), 1.0, "searchr1", imperfect_kinds=["no_search"])
    )
    assert wrapped([]) == plain([]) and wrapped.kind == "no_search"  # an answer: nothing to add, the same guess
    correct = GoalReflectScript(make_script(item, meta, random.Random(0), 0.0, "searchr1"), max_searches=2)
    first = correct([])
    assert goal_of(first) is not None and verdict_of(first) is None and correct([]) == first  # asked again: the same
    assert verdict_of(correct([f"Doc 1 (Title: {item.metadata['chain'][0]}) ..."])) is True


def test_the_warm_start_key_moves_only_when_goal_reflection_is_asked() -> None:
    assert config_key(WarmStartConfig()) == config_key(WarmStartConfig(goal_reflect=False, goal_reflect_noise=0.0))
    assert config_key(WarmStartConfig(goal_reflect=True)) != config_key(WarmStartConfig())
    with pytest.raises(ValueError, match="goal_reflect and sources"):
        WarmStartConfig(goal_reflect=True, sources={"search_people": ["person"]})
    with pytest.raises(ValueError, match="goal_reflect_noise"):
        WarmStartConfig(goal_reflect_noise=2.0)
