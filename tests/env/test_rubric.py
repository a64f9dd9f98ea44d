"""The rubric reward (issue 73): a weighted sum of named criteria, against hand computations, over generated weights and
episodes; its outcome choice; its refusals; its layering over other rewards (dspo.env.build)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspo.env.build import build_environment, reward_layers
from dspo.env.rewards import EpisodeRecord, RewardResult, SubEMReward, TurnRecord
from dspo.env.rubric import CRITERIA, RubricReward
from dspo.env.search_rewards import IkeaReward
from dspo.env.tools import ToolResult
from dspo.types import Passage, QAItem

ITEM = QAItem("q", "In which country was Zapun Steles born?", ["Matosia"], metadata={"chain": ["Zapun Steles"]})


def search(title: str = "Zapun Steles") -> TurnRecord:
    passage = Passage(id=title, title=title, text=f"{title} ...")
    return TurnRecord("<search> x </search>", call=("search", {"query_list": ["x"]}), result=ToolResult("o", [passage]))


BAD_CALL = TurnRecord("<search> x", invalid="unclosed")
FINAL = TurnRecord("<answer> Matosia </answer>")


def episode(answer: str | None, *turns: TurnRecord) -> EpisodeRecord:
    return EpisodeRecord(ITEM, [*turns, FINAL] if answer is not None else list(turns), answer)


def test_hand_computed_sum_components_and_total():
    rubric = RubricReward(SubEMReward(), {"subem": 1.0, "f1": 0.5, "format": 0.1, "searches": -0.05})
    right, wordy, bad = rubric.score(
        [
            episode("Matosia", search(), search()),  # subem 1, f1 1, format 1, 2 searches
            episode("Matosia or Lyon", search()),  # subem 1, f1 2*(1/3*1)/(1/3+1) = 0.5, format 1, 1 search
            episode("Lyon", BAD_CALL),  # subem 0, f1 0, a malformed call: format 0, 0 searches
        ]
    )
    assert right.components["rubric"] == pytest.approx(1 + 0.5 + 0.1 - 0.1)
    assert wordy.components["f1"] == pytest.approx(0.5)
    assert wordy.components["rubric"] == pytest.approx(1 + 0.25 + 0.1 - 0.05)
    assert (bad.components["format"], bad.components["searches"], bad.components["rubric"]) == (0.0, 0.0, 0.0)
    for result in (right, wordy, bad):  # outcome=total: the filter tests the sum, and the advantage uses it
        assert result.outcome == pytest.approx(result.components["rubric"]) and result.total == pytest.approx(
            result.components["rubric"]
        )


def test_a_named_outcome_keeps_the_filter_on_it_and_the_sum_in_the_total():
    rubric = RubricReward(SubEMReward(), {"subem": 1.0, "format": 0.1}, outcome="subem")
    (wrong,) = rubric.score([episode("Lyon")])
    assert (wrong.outcome, wrong.shaping, wrong.total) == (0.0, pytest.approx(0.1), pytest.approx(0.1))


def test_length_cap_and_no_answer():
    rubric = RubricReward(SubEMReward(), {"length": 1.0}, length_cap=2)
    short, long, none = rubric.score([episode("Matosia"), episode("it is Matosia"), episode(None)])
    assert (short.outcome, long.outcome, none.outcome) == (1.0, 0.0, 0.0)


def test_the_env_rewards_own_terms_are_criteria():
    ikea = IkeaReward()
    rubric = RubricReward(ikea, {"outcome": 1.0, "shaping": 1.0, "searches": -0.1})
    episodes = [episode("Matosia", search()), episode("Matosia"), episode("Lyon", search())]
    for base, result in zip(ikea.score(episodes), rubric.score(episodes), strict=True):
        searches = result.components["searches"]
        assert result.total == pytest.approx(base.outcome + base.shaping - 0.1 * searches)
        assert {k: v for k, v in result.components.items() if k in base.components} == base.components


class Planned:
    """A reward that names the answer scored (env=planner: the answerer's) and gives a component of its own."""

    name, credit = "planned", "turn"
    answerer = "the frozen answerer"

    def extract_answer(self, text: str) -> str | None:
        return None

    def score(self, episodes):
        return [RewardResult(0.0, 0.0, [0.25], {"plan_quality": 0.5}, answer="Matosia") for _ in episodes]


def test_the_base_rewards_answer_components_step_rewards_and_attributes_carry_through():
    rubric = RubricReward(Planned(), {"subem": 1.0, "plan_quality": 2.0})
    (result,) = rubric.score([episode("Lyon")])  # the policy said Lyon; the answerer's Matosia is scored
    assert result.components["subem"] == 1.0 and result.outcome == 2.0 and result.step_rewards == [0.25]
    assert result.answer == "Matosia" and result.total == 2.25
    assert (rubric.credit, rubric.answerer) == ("turn", "the frozen answerer")


@pytest.mark.parametrize(
    ("criteria", "outcome", "length_cap", "message"),
    [
        ({}, "total", None, "criteria is empty"),
        ({"subem": "one"}, "total", None, r"criteria.subem='one': a weight must be a number"),
        ({"subem": True}, "total", None, "a weight must be a number"),
        ({"subem": 1.0}, "f1", None, r"outcome='f1': choose `total` or one of"),
        ({"subem": 1.0}, "total", 0, "length_cap=0"),
        ({"judge": 1.0}, "total", None, r"env.reward.judge, which this run does not select.*\[judge,rubric\]"),
    ],
)
def test_refusals_name_the_key(criteria, outcome, length_cap, message):
    with pytest.raises(ValueError, match=message):
        RubricReward(SubEMReward(), criteria, outcome=outcome, length_cap=length_cap)


def test_an_unknown_criterion_fails_naming_it_and_what_exists():
    rubric = RubricReward(SubEMReward(), {"novelty": 1.0})
    with pytest.raises(ValueError, match=r"criteria.novelty: no such criterion.*it gives \['subem'\]"):
        rubric.score([episode("Matosia")])


WORDS = st.sampled_from(["Matosia", "Lyon", "the", "of", "Zapun", "Steles", "born"])
ANSWERS = st.one_of(st.none(), st.lists(WORDS, min_size=1, max_size=5).map(" ".join))
TURNS = st.lists(st.sampled_from([search(), BAD_CALL]), max_size=4)


@settings(max_examples=150, deadline=None)
@given(
    weights=st.dictionaries(
        st.sampled_from(sorted(CRITERIA)), st.floats(-2, 2, allow_nan=False), min_size=1, max_size=len(CRITERIA)
    ),
    answers=st.lists(st.tuples(ANSWERS, TURNS), min_size=1, max_size=6),
    named=st.booleans(),
)
def test_total_is_the_weighted_sum_and_the_outcome_what_was_named(weights, answers, named):
    """Over generated weights and episodes: total = Σ w·criterion (+ step rewards), each criterion a component, the
    outcome the named criterion's value (or the sum), and every criterion within its range."""
    outcome = sorted(weights)[0] if named else "total"
    rubric = RubricReward(IkeaReward(), weights, outcome=outcome, length_cap=3)
    episodes = [episode(answer, *turns) for answer, turns in answers]
    for ep, result in zip(episodes, rubric.score(episodes), strict=True):
        values = {name: result.components[name] for name in weights}
        total = sum(weights[name] * value for name, value in values.items())
        assert math.isclose(result.total, total, abs_tol=1e-9)
        assert math.isclose(result.outcome, total if outcome == "total" else values[outcome], abs_tol=1e-9)
        for name in {"subem", "em", "f1", "format", "length"} & set(values):
            assert 0.0 <= values[name] <= 1.0
        if ep.answer is None:
            assert all(values.get(name, 0.0) == 0.0 for name in ("subem", "em", "f1", "format", "length"))


def test_build_environment_puts_the_layer_on_the_envs_own_reward():
    from dspo.testing import compose_config

    cfg = compose_config("train", ["env/reward=rubric", "env.reward.max_answer_words=4"])
    assert reward_layers(cfg.env) == ["rubric"]
    env = build_environment(cfg.env, tools={})  # the tools are not what this test builds
    assert isinstance(env.reward, RubricReward) and isinstance(env.reward.base, SubEMReward)
    assert env.reward.base.max_answer_words == 4 and env.reward.criteria == {"subem": 1.0, "format": 0.1}
    assert "rubric" in cfg.env.reward, "the composed config is left as it was"
    assert reward_layers(compose_config("train", []).env) == []


def test_build_environment_refuses_a_layer_that_is_no_partial_call():
    from omegaconf import OmegaConf

    config = OmegaConf.create(
        {"_target_": "dspo.env.Environment", "tools": {}, "reward": {"_target_": "dspo.env.SubEMReward", "rubric": 3}}
    )
    with pytest.raises(TypeError, match=r"env.reward.rubric: expected a partial constructor call"):
        build_environment(config)
