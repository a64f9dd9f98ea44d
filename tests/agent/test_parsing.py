"""Tool-call parsing: valid calls, and every malformed kind yields an error (never an exception)."""

from __future__ import annotations

import json

from dspo.agent import parsing
from dspo.env import SearchTool
from dspo.env.tools import Tool

SEARCH = {"search": SearchTool(retriever=None, max_queries_per_call=3, max_query_chars=20)}


def parse(text: str, tools=None) -> parsing.ParsedCall:
    return parsing.parse_call(text, tools or SEARCH, "qwen", parsing.QWEN_CLOSE)


def test_valid_query_list_and_plain_query():
    ok = parse('<think>x</think><tool_call>\n{"name": "search", "arguments": {"query_list": [" a ", "b"]}}</tool_call>')
    assert ok.ok and ok.tool == "search" and ok.arguments == {"query_list": ["a", "b"]}
    assert parse('<tool_call>{"name": "search", "arguments": {"query": "c"}}</tool_call>').arguments["query_list"] == [
        "c"
    ]
    # arguments encoded as a JSON string (some models do this)
    text = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"d\\"}"}</tool_call>'
    assert parse(text).arguments == {"query_list": ["d"]}


def test_last_block_wins():
    text = '<tool_call>{"name": "x"}</tool_call> <tool_call>{"name": "search", "arguments": {"query": "e"}}</tool_call>'
    assert parse(text).arguments == {"query_list": ["e"]}


def test_every_error_kind_and_the_tool_it_is_counted_for():
    cases = {
        parsing.MISSING_OPEN_TAG: ('{"name": "search"}</tool_call>', parsing.NO_TOOL),
        parsing.INVALID_JSON: ("<tool_call>{name: search}</tool_call>", parsing.NO_TOOL),
        parsing.NOT_AN_OBJECT: ("<tool_call>[1, 2]</tool_call>", parsing.NO_TOOL),
        parsing.UNKNOWN_TOOL: ('<tool_call>{"name": "calc", "arguments": {}}</tool_call>', parsing.NO_TOOL),
        parsing.BAD_ARGUMENTS: ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "search"),
        parsing.EMPTY_QUERY: (
            '<tool_call>{"name": "search", "arguments": {"query_list": ["a", " "]}}</tool_call>',
            "search",
        ),
        parsing.TOO_MANY_QUERIES: (
            '<tool_call>{"name": "search", "arguments": {"query": ["a","b","c","e"]}}</tool_call>',
            "search",
        ),  # noqa: E501
        parsing.QUERY_TOO_LONG: (
            '<tool_call>{"name": "search", "arguments": {"query": "' + "y" * 21 + '"}}</tool_call>',
            "search",
        ),  # noqa: E501
    }
    for kind, (text, tool) in cases.items():
        result = parse(text)
        assert not result.ok and result.error_kind == kind and result.tool == tool, (kind, result)
        assert result.error.startswith("Error: ") and result.arguments == {}
    # the messages of the single search tool are the ones the model saw before tools were plug-ins
    usage = '{"name": "search", "arguments": {"query_list": ["first query", "second query"]}}'
    assert (
        parse("<tool_call>[1]</tool_call>").error
        == f"Error: the tool call must be a JSON object. Call the tool as {usage}."
    )
    assert parse(cases[parsing.UNKNOWN_TOOL][0]).error == "Error: unknown tool 'calc'; the only tool is 'search'."


def test_searchr1_query():
    def tag(text):
        return parsing.parse_call(text, SEARCH, "searchr1", "</search>")

    assert tag("<think/> <search> who </search>").arguments == {"query_list": ["who"]}
    assert tag("<search></search>").error_kind == parsing.EMPTY_QUERY
    missing = tag("who </search>")
    assert missing.error_kind == parsing.MISSING_OPEN_TAG and missing.tool == "search"
    assert missing.error == "Error: found </search> without <search>. Search with <search> query </search>."
    assert tag("<search>" + "z" * 30 + "</search>").error_kind == parsing.QUERY_TOO_LONG


class Calculator(Tool):
    """A second tool with a schema of its own: the default `prepare` checks arguments against it."""

    name = "calc"
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    tag_argument = "expression"


def test_several_tools_name_each_other_and_are_validated_against_their_schemas():
    tools = {**SEARCH, "calc": Calculator()}
    assert parsing.call_closes(tools, "searchr1") == ["</search>", "</calc>"]
    assert parsing.call_closes(tools, "qwen") == ["</tool_call>"] and parsing.call_closes({}, "qwen") == []
    ok = parse('<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>', tools)
    assert ok.ok and ok.tool == "calc" and ok.arguments == {"expression": "1+1"}
    unknown = parse('<tool_call>{"name": "web", "arguments": {}}</tool_call>', tools)
    assert unknown.error == "Error: unknown tool 'web'; the tools are 'search', 'calc'."
    for arguments, reason in (({"expression": 2}, "must be a string"), ({}, "missing ['expression']"), ([], "object")):
        bad = parse(calc_call(arguments), tools)
        assert bad.error_kind == parsing.BAD_ARGUMENTS and bad.tool == "calc" and reason in bad.error
    tag = parsing.parse_call("<calc> 2*3 </calc>", tools, "searchr1", "</calc>")
    assert tag.ok and tag.arguments == {"expression": "2*3"}  # the text between the tags, stripped


def test_enum_arguments_are_checked():
    class Judge(Calculator):
        name, tag_argument = "judge", "verdict"
        parameters = {"type": "object", "properties": {"verdict": {"type": "string", "enum": ["yes", "no"]}}}

    tools = {**SEARCH, "judge": Judge()}
    assert parsing.parse_call("<judge>\nyes </judge>", tools, "searchr1", "</judge>").arguments == {"verdict": "yes"}
    bad = parsing.parse_call("<judge> maybe </judge>", tools, "searchr1", "</judge>")
    assert (
        bad.error_kind == parsing.BAD_ARGUMENTS
        and bad.error == "Error: argument 'verdict' of 'judge' must be one of ['yes', 'no']."
    )


def test_unknown_arguments_are_refused():
    bad = parse(calc_call({"expression": "1", "unit": "m"}), {"calc": Calculator()})
    assert bad.error_kind == parsing.BAD_ARGUMENTS and "unknown ['unit']" in bad.error


def calc_call(arguments) -> str:
    return "<tool_call>" + json.dumps({"name": "calc", "arguments": arguments}) + "</tool_call>"
