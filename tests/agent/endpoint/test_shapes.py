"""Messages and tools as OpenAI defines them, checked field by field: each shape an outside review sent (and that
once reached the chat template and ended the round) is either normalized or refused naming its field."""

from __future__ import annotations

import pytest

from dspo.agent.endpoint.episodes import RequestError
from dspo.agent.endpoint.requests import MAX_N, SamplingPolicy, parse_request
from dspo.agent.endpoint.shapes import check_messages, check_tool_choice, check_tools
from dspo.env.search_tool import SEARCH_TOOL_SCHEMA

Q = {"role": "user", "content": "Q?"}
A = {"role": "assistant", "content": "<answer> Paris </answer>"}


def refused(messages) -> str:
    with pytest.raises(RequestError) as error:
        check_messages(messages)
    assert error.value.status == 400
    return error.value.message


def test_content_parts_are_joined_text_and_developer_is_system():
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    assert check_messages([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi\nthere"},
    ]


def test_assistant_content_may_be_null_or_missing_with_tool_calls():
    call = {"id": "c", "type": "function", "function": {"name": "search", "arguments": '{"query_list": ["x"]}'}}
    for message in (
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "tool_calls": [call]},
    ):
        (out,) = check_messages([message])
        assert out == {"role": "assistant", "content": "", "tool_calls": [call]}
    (out,) = check_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "s", "arguments": {"a": 1}}}]}])
    assert out["tool_calls"][0] == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "s", "arguments": '{"a": 1}'},
    }


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([{"role": "user", "content": None}], "messages[0].content: required for a user message"),
        ([{"role": "user", "content": 5}], "messages[0].content: a string or a list of content parts, got int"),
        ([{"role": "user"}], "messages[0].content: required"),
        ([Q, A, {"role": "user", "content": [{"text": 5}]}], "messages[2].content[0].type=None"),
        ([Q, A, {"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[2].content[0].text=5"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "content[0].type='image_url'"),
        ([Q, A | {"tool_calls": [{"function": "x"}]}], "messages[1].tool_calls[0].function: an object"),
        ([Q, A | {"tool_calls": 5}], "messages[1].tool_calls: a list of tool calls, got int"),
        ([Q, {"role": "assistant", "content": None}], "messages[1].content: an assistant message needs content"),
        ([{"role": "function", "content": "x"}], "messages[0].role='function'"),
        ([{"role": "robot", "content": "x"}], "messages[0].role='robot'"),
        ([Q, {"role": "user", "content": "x", "tool_calls": []}], "messages[1].tool_calls: only an assistant"),
        ([5], "messages[0]: an object"),
        ([], "messages: a non-empty list"),
        ("hi", "messages: a non-empty list"),
    ],
)
def test_a_wrong_shape_is_refused_naming_its_field(messages, field):
    assert field in refused(messages)


def test_tools_and_tool_choice():
    assert check_tools([SEARCH_TOOL_SCHEMA]) == [SEARCH_TOOL_SCHEMA]
    with pytest.raises(RequestError, match=r"tools\[0\]\.function\.name=5"):
        check_tools([{"type": "function", "function": {"name": 5}}])
    with pytest.raises(RequestError, match=r"tools\[0\]\.function\.parameters='x': a dict"):
        check_tools([{"type": "function", "function": {"name": "s", "parameters": "x"}}])
    assert [check_tool_choice(c, [SEARCH_TOOL_SCHEMA]) for c in (None, "auto", "required", "none")] == [
        "auto",
        "auto",
        "auto",
        "none",
    ]
    named = {"type": "function", "function": {"name": "search"}}
    assert check_tool_choice(named, [SEARCH_TOOL_SCHEMA]) == "auto"
    with pytest.raises(RequestError, match="tool_choice names 'other', which is not in tools"):
        check_tool_choice({"type": "function", "function": {"name": "other"}}, [SEARCH_TOOL_SCHEMA])


def test_request_fields_are_accepted_or_refused_by_name():
    request = parse_request(
        {"messages": [Q], "tool_choice": "required", "parallel_tool_calls": False, "response_format": {"type": "text"}}
    )
    assert request.tool_choice == "auto"
    for body, field in [
        ({"messages": [Q], "response_format": {"type": "json_object"}}, "response_format='json_object'"),
        ({"messages": [Q], "parallel_tool_calls": "yes"}, "parallel_tool_calls='yes'"),
        ({"messages": [Q], "functions": []}, "functions (the API's deprecated form)"),
        ({"messages": [Q], "seed": "x"}, "seed=x"),
        ({"messages": [Q], "n": 0}, "n=0"),
        ({"messages": [Q], "top_logprobs": 50}, "top_logprobs=50"),
    ]:
        with pytest.raises(RequestError, match=field.replace("(", r"\(").replace(")", r"\)")):
            parse_request(body)


def test_sampling_settings_are_replaced_and_reported():
    policy = SamplingPolicy(temperature=0.0, top_p=1.0, max_new_tokens=64)
    request = parse_request(
        {"messages": [Q], "temperature": 1.0, "seed": 7, "n": MAX_N + 1, "max_tokens": 100, "presence_penalty": 0.5}
    )
    assert [name for name, _, _ in policy.overrides(request)] == [
        "temperature",
        "seed",
        "presence_penalty",
        "n",
        "max_tokens",
    ]
    assert request.n == MAX_N
    same = parse_request({"messages": [Q], "temperature": 0.0, "top_p": 1.0, "n": 2, "max_tokens": 10})
    assert policy.overrides(same) == [] and same.n == 2
