"""The tool interface (issue 27): schema checks, the rendered schema, `run` under a timeout, the environment's own
validation and the credit check."""

from __future__ import annotations

import time

import pytest

from dspo.agent.prompts import SEARCH_TOOL_SCHEMA
from dspo.agent.tool_calling import run_with_timeout
from dspo.env import Environment, SearchTool, SubEMReward, check_credit_fits
from dspo.env.tools import InvalidCall, Tool, ToolResult, check_arguments

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "names": {"type": "array", "items": {"type": "string"}},
        "x": {"type": "number"},
    },
    "required": ["n"],
}


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ({"n": 1, "names": ["a"], "x": 2.5}, None),
        ({"n": 1, "x": 2}, None),  # an integer is a number
        ("n=1", "must be a JSON object"),
        ({}, "missing ['n']"),
        ({"n": 1, "y": 2}, "unknown ['y']"),
        ({"n": True}, "'n' of 'calc' must be a integer"),  # a bool is not an integer (JSON has both)
        ({"n": 1.5}, "must be a integer"),
        ({"n": 1, "names": ["a", 2]}, "'names' of 'calc' must be a array"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments, reason):
    if reason is None:
        check_arguments(SCHEMA, arguments, "calc", "USAGE")
        return
    with pytest.raises(InvalidCall) as error:
        check_arguments(SCHEMA, arguments, "calc", "USAGE")
    assert (
        error.value.kind == "bad_arguments"
        and reason in error.value.message
        and error.value.message.endswith("Use USAGE.")
    )


class Sleepy(Tool):
    name, timeout_s = "sleepy", 0.2

    def run(self, calls, contexts):
        time.sleep(1.0)
        return [ToolResult("late") for _ in calls]


def test_the_search_tool_renders_the_schema_the_prompt_always_had_and_a_tool_times_out():
    assert SearchTool(retriever=None).schema() == SEARCH_TOOL_SCHEMA
    people = SearchTool(retriever=None, name="search_people", description="People and companies.").schema()
    assert (
        people["function"]["name"] == "search_people" and people["function"]["description"] == "People and companies."
    )
    assert Tool().usage() == '{"name": "tool", "arguments": {}}'
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="the sleepy tool took longer than its timeout_s=0.2"):
        run_with_timeout(Sleepy(), [{}], [None])
    assert time.perf_counter() - start < 0.9
    with pytest.raises(ValueError, match="search tool 'search': topk, max_queries_per_call"):
        SearchTool(retriever=None, topk=0)


def test_the_environment_checks_its_tools_and_settings():
    with pytest.raises(ValueError, match="env.tools.web: the tool is named 'search'"):
        Environment({"web": SearchTool(retriever=None)}, SubEMReward())
    with pytest.raises(ValueError, match="env.max_tool_error_share must be within"):
        Environment({}, SubEMReward(), max_tool_error_share=1.5)
    with pytest.raises(ValueError, match="env.instruction must contain {question}"):
        Environment({}, SubEMReward(), instruction="Answer.")
    env = Environment.search(retriever=None, topk=2, max_answer_words=3)
    assert list(env.tools) == ["search"] and env.tools["search"].topk == 2 and env.reward.max_answer_words == 3


def test_per_turn_credit_needs_an_objective_that_weighs_tokens():
    from dspo.algorithms import OBJECTIVES

    turn = Environment({}, SubEMReward(credit="turn"))
    for name in ("dapo", "grpo"):
        check_credit_fits(turn, OBJECTIVES[name])
    for name in ("dspo", "gspo"):
        with pytest.raises(ValueError, match=f"env.reward.credit=turn .* objective '{name}' takes one advantage per"):
            check_credit_fits(turn, OBJECTIVES[name])
    check_credit_fits(Environment({}, SubEMReward()), OBJECTIVES["dspo"])
