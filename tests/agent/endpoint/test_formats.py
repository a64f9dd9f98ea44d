"""The searchr1 format on histories a framework rewrote: a user message after the assistant's turn (smolagents sends
each tool result as "Observation: ..." from the user) is rendered as the chat template renders a multi-turn chat,
earlier assistant turns written in the format's own text, and the request is a new sample, never a refused one."""

from __future__ import annotations

from dspo.agent.endpoint.formats import SearchR1Format
from dspo.env import SearchTool

CALL = {"id": "call_a", "type": "function", "function": {"name": "search", "arguments": '{"query": "France"}'}}


def searchr1(qwen_tokenizer, retriever) -> SearchR1Format:
    return SearchR1Format(qwen_tokenizer, {"search": SearchTool(retriever, topk=1)})


def test_an_unbroken_episode_renders_as_before(qwen_tokenizer, retriever):
    fmt = searchr1(qwen_tokenizer, retriever)
    messages = [
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "<think>x</think>\n", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_a", "content": "Doc 1 (Title: Paris) Paris."},
    ]
    text = qwen_tokenizer.decode(fmt.prompt_ids(messages, None))
    assert text.endswith(
        "<|im_start|>assistant\n<think>x</think>\n<search> France </search>\n\n<information>Doc 1 (Title: Paris) "
        "Paris.</information>\n\n"
    )
    assert fmt.following_ids(messages, None, at=1) is not None


def test_a_user_message_after_the_assistant_turn_is_rendered_not_refused(qwen_tokenizer, retriever):
    fmt = searchr1(qwen_tokenizer, retriever)
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "<think>x</think>\n", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_a", "content": "Doc 1 (Title: Paris) Paris."},
        {"role": "user", "content": [{"type": "text", "text": "Observation: more"}]},
    ]
    text = qwen_tokenizer.decode(fmt.prompt_ids(messages, None))
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
        "<|im_start|>assistant\n<think>x</think>\n<search> France </search>\n\n<information>Doc 1 (Title: Paris) "
        "Paris.</information>\n\n<|im_end|>\n<|im_start|>user\nObservation: more<|im_end|>\n<|im_start|>assistant\n"
    )
    assert fmt.following_ids(messages, None, at=3) is None  # the episode's turn ended: a new sample, rendered whole
    then = [*messages, {"role": "assistant", "content": "<search> Paris </search>"}]
    assert qwen_tokenizer.decode(fmt.prompt_ids(then, None)) == text + "<search> Paris </search>"
