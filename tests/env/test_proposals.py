"""Proposals of a question with its answer (search self-play's proposer, issue 57 part 2): parsed from the final turn,
refused by reason, and the proposer's placeholder reward."""

from __future__ import annotations

import pytest

from dspo.env.proposals import (
    SEARCHR1_PROPOSER_INSTRUCTION,
    Proposal,
    ProposalReward,
    parse_proposal,
    proposer_environment,
)
from dspo.env.rewards import EpisodeRecord, TurnRecord
from dspo.types import QAItem


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "<think>x</think>\n<question> Where was Ana born? </question>\n<answer> Lima </answer>",
            (Proposal("Where was Ana born?", "Lima"), ""),
        ),
        ("<answer> Lima </answer>", (None, "no_question")),
        ("<question>   </question> <answer> Lima </answer>", (None, "no_question")),
        ("<question> Where was Ana born? </question>", (None, "no_answer")),
        ("<question> Where was Ana born? </question> <answer> * </answer>", (None, "no_answer")),
        ("<question> Was Ana born in Lima? </question> <answer> lima </answer>", (None, "answer_in_question")),
        ("<question> " + "x" * 600 + " </question> <answer> Lima </answer>", (None, "no_question")),
        (  # the last complete question block counts
            "<question> a? </question> <question> Where was Ana born? </question> <answer> Lima </answer>",
            (Proposal("Where was Ana born?", "Lima"), ""),
        ),
    ],
)
def test_a_final_turn_is_a_proposal_or_a_reason(text, expected):
    assert parse_proposal(text) == expected


def test_the_proposers_reward_is_a_placeholder_that_logs_whether_a_proposal_was_written():
    item = QAItem("t", "Ana", ["Ana"])
    formed = EpisodeRecord(
        item, [TurnRecord("<question> Where was Ana born? </question> <answer> Lima </answer>")], "Lima"
    )
    loose = EpisodeRecord(item, [TurnRecord("<answer> Ana </answer>")], "Ana")  # the topic itself: never paid
    results = ProposalReward().score([formed, loose, EpisodeRecord(item, [], None)])
    assert [r.outcome for r in results] == [0.0, 0.0, 0.0]
    assert [r.components["proposal_formed"] for r in results] == [1.0, 0.0, 0.0]


def test_the_proposers_environment_has_the_proposer_instruction_for_its_tag_format(retriever):
    from dspo.env import SearchTool

    env = proposer_environment({"search": SearchTool(retriever)}, "searchr1")
    assert env.instruction == SEARCHR1_PROPOSER_INSTRUCTION and isinstance(env.reward, ProposalReward)
    assert "<question>" in proposer_environment({"search": SearchTool(retriever)}, "qwen").instruction
    own = proposer_environment({"search": SearchTool(retriever)}, "qwen", instruction="Ask about {question}.")
    assert own.instruction == "Ask about {question}."
    with pytest.raises(ValueError, match="tag_format='json'"):
        proposer_environment({"search": SearchTool(retriever)}, "json")
