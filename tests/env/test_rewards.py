"""Rewards on whole episodes (issue 27): subEM, StepSearch's step rewards and IKEA's knowledge-boundary term, against
hand computations on hand-made episodes."""

from __future__ import annotations

import pytest

from dspo.env.rewards import EpisodeRecord, RewardResult, SubEMReward, TurnRecord, gold_titles
from dspo.env.search_rewards import IkeaReward, StepSearchReward
from dspo.env.tools import ToolResult
from dspo.types import Passage, QAItem

ITEM = QAItem(
    "q", "In which country was Zapun Steles born?", ["Matosia"], metadata={"chain": ["Zapun Steles", "Trelaholm"]}
)


def page(title: str) -> Passage:
    return Passage(id=title, title=title, text=f"{title} ...")


def search(*titles: str, error: str | None = None) -> TurnRecord:
    return TurnRecord(
        "<search> x </search>",
        call=("search", {"query_list": ["x"]}),
        result=ToolResult("obs", [page(t) for t in titles], error),
    )


ANSWER = TurnRecord("<answer> Matosia </answer>")


def test_subem_is_the_outcome_and_a_component():
    (right, wrong, none) = SubEMReward().score(
        [EpisodeRecord(ITEM, [ANSWER], "Matosia"), EpisodeRecord(ITEM, [ANSWER], "Lyon"), EpisodeRecord(ITEM, [], None)]
    )
    assert (right.outcome, right.total, right.components) == (1.0, 1.0, {"subem": 1.0})
    assert (wrong.total, none.total) == (0.0, 0.0)
    assert SubEMReward(max_answer_words=1).score([EpisodeRecord(ITEM, [], "Matosia it is")])[0].outcome == 0.0
    with pytest.raises(ValueError, match="env.reward.credit='step'"):
        SubEMReward(credit="step")


def test_total_is_outcome_plus_shaping_plus_the_turns_that_have_a_step_reward():
    assert RewardResult(1.0, shaping=0.25, step_rewards=[0.5, None, -0.125]).total == 1.625


def test_stepsearch_gain_and_redundancy_by_hand():
    """Gold = {zapun steles, trelaholm}. Turn 1 retrieves Zapun Steles (new gold: gain 1/2, nothing seen: redundancy 0);
    turn 2 retrieves Zapun Steles again + a distractor (no new gold; 1 of 2 already seen: redundancy 1/2); turn 3
    retrieves Trelaholm (gain 1/2); a failed call and the answer turn have no step reward."""
    episode = EpisodeRecord(
        ITEM,
        [
            search("Zapun Steles"),
            search("Zapun Steles", "Lipindale"),
            search(error="timeout"),
            search("Trelaholm"),
            ANSWER,
        ],
        "Matosia",
    )
    (result,) = StepSearchReward(gold_key="chain", gain_weight=0.5, redundancy_weight=0.5).score([episode])
    assert result.step_rewards == [0.25, -0.25, None, 0.25, None]
    assert result.outcome == 1.0 and result.total == pytest.approx(1.25)
    assert result.components == {"subem": 1.0, "info_gain": 1.0, "redundancy": pytest.approx(1 / 6), "step_total": 0.25}
    assert gold_titles(
        QAItem("h", "q", ["a"], metadata={"supporting_titles": ["Kiss and Tell (1945 film)"]}), "supporting_titles"
    ) == {"kiss and tell 1945 film"}


def test_ikea_knowledge_boundary_by_hand():
    reward = IkeaReward(positive=0.6, negative=0.1, max_retrievals=3)
    episodes = [
        EpisodeRecord(ITEM, [ANSWER], "Matosia"),  # right, no retrieval: 0.6
        EpisodeRecord(ITEM, [search("Zapun Steles"), search("Trelaholm"), ANSWER], "Matosia"),  # right, 2: 0.6 / 3
        EpisodeRecord(ITEM, [search("Zapun Steles"), ANSWER], "Lyon"),  # wrong after searching: 0.1
        EpisodeRecord(ITEM, [ANSWER], "Lyon"),  # wrong without searching: 0
    ]
    results = reward.score(episodes)
    assert [r.shaping for r in results] == pytest.approx([0.6, 0.2, 0.1, 0.0])
    assert [r.outcome for r in results] == [1.0, 1.0, 0.0, 0.0]  # the filter still sees 0/1
    assert [r.total for r in results] == pytest.approx([1.6, 1.2, 0.1, 0.0])
    assert results[1].components == {"subem": 1.0, "knowledge_boundary": pytest.approx(0.2), "retrievals": 2.0}
    with pytest.raises(ValueError, match="trajectory-level"):
        IkeaReward(credit="turn")
    with pytest.raises(ValueError, match="max_retrievals must be >= 1"):
        IkeaReward(max_retrievals=0)
