"""Messages -> token ids and completions -> OpenAI messages, on the real Qwen2.5 chat template."""

from __future__ import annotations

import json

from dspo.agent.endpoint import chat
from dspo.env.search_tool import SEARCH_TOOL_SCHEMA

CALL = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["capital of France"]}}\n</tool_call>'


def test_continuation_is_what_the_template_puts_after_the_assistant_turn(qwen_tokenizer):
    returned = {"role": "assistant", "content": "<think>x</think>", "tool_calls": [_call()]}
    messages = [
        {"role": "user", "content": "Q?"},
        returned,
        {"role": "tool", "tool_call_id": "call_0", "content": "Doc 1 (Title: Paris) Paris."},
    ]
    following = chat.continuation_text(qwen_tokenizer, messages, [SEARCH_TOOL_SCHEMA], at=1)
    assert following == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nDoc 1 (Title: Paris) Paris.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_extends_compares_turns_not_ids_or_spelling():
    previous = [{"role": "user", "content": "Q?"}]
    returned = {"role": "assistant", "content": None, "tool_calls": [_call()]}
    echoed = {
        "role": "assistant",
        "content": "",  # a client that sends "" for None, another id, arguments re-serialized
        "tool_calls": [
            {
                "id": "x",
                "type": "function",
                "function": {"name": "search", "arguments": '{"query_list": ["capital of France"]}'},
            }
        ],
    }
    tool = {"role": "tool", "tool_call_id": "x", "content": "r"}
    assert chat.extends([*previous, echoed, tool], previous, returned)
    assert not chat.extends([*previous, echoed], previous, returned)  # nothing new after the assistant turn
    rewritten = {"role": "user", "content": "Q (rephrased)?"}
    assert not chat.extends([rewritten, echoed, tool], previous, returned)
    other_call = json.loads(json.dumps(echoed))
    other_call["tool_calls"][0]["function"]["arguments"] = '{"query_list": ["Paris"]}'
    assert not chat.extends([*previous, other_call, tool], previous, returned)


def test_assistant_message_parses_tool_calls_and_drops_the_end_of_turn():
    text = "<think>x</think>\n" + CALL + "<|im_end|>"
    message, has_calls, invalid = chat.assistant_message(text, "<|im_end|>", ["search"])
    assert has_calls and not invalid and message["content"] == "<think>x</think>"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"] == "call_0"
    assert call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"]) == {"query_list": ["capital of France"]}


def test_a_malformed_call_is_still_a_call_with_the_models_raw_text_and_counted():
    broken = '<tool_call>\n{"name": "search", "arguments": {"query_list": [}\n</tool_call>'
    message, has_calls, invalid = chat.assistant_message(broken, "<|im_end|>", ["search"])
    assert has_calls and invalid == [("search", "invalid_json")]
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "search", "arguments": '{"name": "search", "arguments": {"query_list": [}'}
    message, _, invalid = chat.assistant_message("<tool_call>[1, 2]</tool_call>", None, ["search"])
    assert message["tool_calls"][0]["function"]["name"] == "unknown" and invalid == [("call", "not_an_object")]
    message, has_calls, invalid = chat.assistant_message("search Paris</tool_call>", None, ["search"])
    assert has_calls and invalid == [("call", "missing_open_tag")]
    assert message["tool_calls"][0]["function"] == {"name": "unknown", "arguments": "search Paris"}
    unclosed = "<think>x</think><tool_call>\n{"
    assert chat.assistant_message(unclosed, None, ["search"]) == ({"role": "assistant", "content": unclosed}, False, [])


def test_tool_less_requests_and_several_calls():
    message, has_calls, _ = chat.assistant_message(CALL, "<|im_end|>", None)  # the request sent no tools
    assert not has_calls and message["content"] == CALL
    two = CALL + "\n" + CALL.replace("capital of France", "Paris")
    message, _, _ = chat.assistant_message(two, None, ["search"])
    assert [json.loads(c["function"]["arguments"])["query_list"] for c in message["tool_calls"]] == [
        ["capital of France"],
        ["Paris"],
    ]
    assert message["content"] is None


def test_searchr1_calls_and_a_missing_open_tag(qwen_tokenizer):
    from dspo.agent.endpoint.formats import SearchR1Format
    from dspo.env import SearchTool

    fmt = SearchR1Format(qwen_tokenizer, {"search": SearchTool(retriever=None, topk=1)})
    message, has_calls, invalid = fmt.message("<think>x</think>\n<search> Paris </search>", None, ["search"])
    assert has_calls and not invalid and message["content"] == "<think>x</think>\n"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"query": "Paris"}
    message, has_calls, invalid = fmt.message("Paris </search>", None, ["search"])
    assert has_calls and invalid == [("search", "missing_open_tag")]
    assert message["tool_calls"][0]["function"]["arguments"] == "Paris"
    following = fmt.following_ids(
        [{"role": "user", "content": "q"}, message, {"role": "tool", "content": "Doc"}], None, 1
    )
    assert qwen_tokenizer.decode(following) == "\n\n<information>Doc</information>\n\n"


def _call() -> dict:
    arguments = json.dumps({"query_list": ["capital of France"]})
    return {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": arguments}}
