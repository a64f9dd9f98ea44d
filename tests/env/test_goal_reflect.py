"""env=goal_reflect (RE-Searcher; issue 57, part 4): goals and reflections parsed from model turns in both tag formats,
the reflection reward's rule (a yes/no that agrees with whether the results held the page the goal names), the noise
key, and the config."""

from __future__ import annotations

import json

import pytest

from dspo.agent.tool_calling import ToolCallingAgent
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment
from dspo.env.goal_reflect import (
    QWEN_INSTRUCTION,
    SEARCHR1_INSTRUCTION,
    GoalReflectReward,
    goal_of,
    verdict_of,
)
from dspo.env.simulated import ScriptedSimulator, SimulatedSearchTool
from dspo.testing import compose_config
from dspo.types import Passage, QAItem

PAGES = [
    Passage("p0", "Brikor Corp", "Brikor Corp was founded by Tares Brumin in 1998."),
    Passage("p1", "Zelto Corp", "Zelto Corp was founded by Mira Kosh in 2001."),
    Passage("p2", "Tares Brumin", "Tares Brumin was born in Lipindale."),
    Passage("p3", "Gorn Corp", "Gorn Corp was founded by Ula Trent in 1990."),
]


class RankedRetriever:
    """Pages ranked by the number of query words they contain (a BM25 stand-in)."""

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        out = []
        for query in queries:
            words = set(query.lower().split())
            scored = [(len(words & set(f"{p.title} {p.text}".lower().split())), i, p) for i, p in enumerate(PAGES)]
            out.append([p for s, i, p in sorted(scored, key=lambda t: (-t[0], t[1])) if s > 0][:k])
        return out


BRIKOR = QAItem("toy-1", "Who founded Brikor Corp?", ["Tares Brumin"], metadata={"chain": ["Brikor Corp"]})
HOP2 = QAItem(
    "toy-2", "In which city was the founder of Brikor Corp born?", ["Lipindale"],
    metadata={"chain": ["Brikor Corp", "Tares Brumin"]},
)  # fmt: skip


def test_goals_and_verdicts_are_read_from_a_turns_text():
    assert goal_of("<think>x</think>\n<goal> the founder of Brikor Corp </goal>\n<search> Brikor Corp </search>") == (
        "the founder of Brikor Corp"
    )
    assert goal_of("<search> Brikor Corp </search>") is None
    assert goal_of("<goal> a </goal> then <goal> b </goal>") == "b"  # the last one counts
    assert verdict_of("<reflect> Yes, it says who founded it. </reflect>") is True
    assert verdict_of("<reflect>no: another company</reflect><answer> x </answer>") is False
    assert verdict_of("<reflect> maybe </reflect>") is None and verdict_of("<reflect></reflect>") is None
    assert verdict_of("yes, no reflection tag") is None


def call(query: str, tag_format: str) -> str:
    if tag_format == "searchr1":
        return f"<search> {query} </search>"
    return "<tool_call>\n" + json.dumps({"name": "search", "arguments": {"query_list": [query]}}) + "\n</tool_call>"


def agent(tokenizer, scripts, tag_format: str, noise: float, weight: float = 0.2) -> ToolCallingAgent:
    tool = SimulatedSearchTool(ScriptedSimulator(RankedRetriever()), topk=1, noise=noise)
    instruction = SEARCHR1_INSTRUCTION if tag_format == "searchr1" else QWEN_INSTRUCTION
    env = Environment({"search": tool}, GoalReflectReward(reflection_weight=weight), instruction=instruction)
    return ToolCallingAgent(ScriptedEngine(tokenizer, scripts), tokenizer, env, tag_format=tag_format, max_turns=3)


@pytest.mark.parametrize("tag_format", ["searchr1", "qwen"])
@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_a_reflection_is_paid_when_its_verdict_says_whether_the_results_held_the_goals_page(
    qwen_tokenizer, tag_format, noise
):
    search = (
        f"<think>I need the founder.</think>\n<goal> the founder of Brikor Corp </goal>\n{call('Brikor', tag_format)}"
    )
    answer = "\n<answer> Tares Brumin </answer>"
    scripts = [
        [search, "<reflect> yes, it names the founder </reflect>" + answer],
        [search, "<reflect> No. </reflect>" + answer],
        [search, "<reflect> perhaps </reflect>" + answer],  # no verdict: never paid
        [call("Brikor", tag_format), answer],  # no goal, no reflection
    ]
    trajectories = agent(qwen_tokenizer, scripts, tag_format, noise).rollout([BRIKOR], 4, 0).groups[0].trajectories
    held = noise == 0.0  # at noise 1 the page is a distractor (another company), never Brikor Corp's
    right_yes, right_no = (0.2, 0.0) if held else (0.0, 0.2)
    assert [t.step_rewards for t in trajectories] == [[None, right_yes], [None, right_no], [None, None], [None, None]]
    assert [t.reward_components["reflect_right"] for t in trajectories] == [float(held), float(not held), 0.0, 0.0]
    assert [t.reward_components["goal_share"] for t in trajectories] == [1.0, 1.0, 1.0, 0.0]
    assert [t.reward_components["reflect_share"] for t in trajectories] == [1.0, 1.0, 0.0, 0.0]
    assert all(t.reward_components["held_share"] == float(held) for t in trajectories)
    outcomes = [t.outcome for t in trajectories]
    assert outcomes == ([1.0] * 4 if held else outcomes)  # the outcome stays subEM, the filter tests it
    assert trajectories[0].reward == pytest.approx(trajectories[0].outcome + right_yes)


def test_the_target_is_the_gold_page_the_goal_names_else_the_searchs_position(qwen_tokenizer):
    """A 2-hop question: the second search's goal names the founder (the chain's second page), whose page the results
    hold; a goal naming no gold page targets the page of the search's position; weight 0 pays nothing."""
    first = "<goal> find it </goal>\n<search> Brikor Corp </search>"  # names no page: the 1st search, the 1st page
    second = "<reflect> yes </reflect><goal> where Tares Brumin was born </goal>\n<search> Tares Brumin born </search>"
    last = "<reflect> yes </reflect>\n<answer> Lipindale </answer>"
    wrong = "<reflect> yes </reflect><goal> the birthplace of Brikor Corp </goal>\n<search> Tares Brumin born </search>"
    scripts = [[first, second, last], [first, wrong, last]]
    trajectories = agent(qwen_tokenizer, scripts, "searchr1", 0.0).rollout([HOP2], 2, 0).groups[0].trajectories
    assert trajectories[0].step_rewards == [None, 0.1, 0.1]  # weight 0.2 over two searches, both right
    assert trajectories[1].step_rewards == [None, 0.1, 0.0]  # asked for Brikor Corp's page, got Tares Brumin's
    assert trajectories[1].reward_components["held_share"] == 0.5
    unpaid = agent(qwen_tokenizer, scripts, "searchr1", 0.0, weight=0.0).rollout([HOP2], 2, 0).groups[0].trajectories
    assert [t.step_rewards for t in unpaid] == [[], []] and unpaid[0].reward_components["reflect_right"] == 1.0


def test_mistakes_name_the_key():
    with pytest.raises(ValueError, match="env.reward.reflection_weight=-1"):
        GoalReflectReward(reflection_weight=-1)
    with pytest.raises(ValueError, match=r"env.tools.search.noise=1.5: a probability"):
        SimulatedSearchTool(ScriptedSimulator(RankedRetriever()), noise=1.5)


@pytest.mark.parametrize("env", ["goal_reflect", "simulated"])
def test_the_noise_key_composes_with_and_without_goal_reflection(env):
    from hydra.utils import instantiate

    cfg = compose_config("train", [f"env={env}", "env.tools.search.noise=0.3", "output_dir=/tmp/x"])
    node = cfg.env.tools.search
    retriever = RankedRetriever()  # the toy's BM25 index is not built in unit tests
    tool = instantiate(node, simulator=instantiate(node.simulator, retriever=retriever))
    for step in (0, 50, 100):  # constant: no curriculum
        tool.on_progress(step, 100)
        assert tool.noise_probability == 0.3
    built = instantiate(cfg.env, tools={"search": tool})
    assert isinstance(built.reward, GoalReflectReward) == (env == "goal_reflect")
    if env == "goal_reflect":
        assert built.instruction == SEARCHR1_INSTRUCTION  # the YAML's copy of the module's instruction
        assert built.reward.reflection_weight == 0.2 and cfg.rollout.agent.tag_format == "searchr1"
        default = compose_config("train", ["env=goal_reflect", "output_dir=/tmp/x"])
        assert default.env.tools.search.noise == 0.0
    else:  # env=simulated keeps its curriculum unless the key is set
        assert compose_config("train", ["env=simulated", "output_dir=/tmp/x"]).env.tools.search.noise is None


def test_goal_reflect_brings_its_toy_warm_start_and_none_outside_the_toy(caplog):
    """In the toy, env=goal_reflect has a toy root and a warm start of its own (demonstrations of the format); under
    prepare=none (the paper's data) its prepare keys name no constructor and the step is skipped, not failed."""
    import logging

    from dspo.train import prepare

    toy = compose_config("train", ["env=goal_reflect", "output_dir=/tmp/x"])
    assert toy.paths.toy_root.endswith("toyworld/goal_reflect")
    assert toy.prepare.toyworld.config.goal_reflect and toy.prepare.toyworld.config.goal_reflect_noise == 0.15
    assert toy.prepare.toyworld.shipped_model.endswith("toy_goal_reflect_warmstart/model")
    paper = compose_config("train", ["experiment=paper_qwen2.5_3b", "env=goal_reflect", "output_dir=/tmp/x"])
    assert "_target_" not in paper.prepare.toyworld
    with caplog.at_level(logging.INFO, logger="dspo.train"):
        prepare(paper)
    assert "prepare: toyworld names no _target_" in caplog.text
