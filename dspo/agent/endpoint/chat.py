"""The chat side of the endpoint, as pure functions: a request's messages -> prompt token ids (continuing the
episode's token history when the messages extend it), a completion -> an OpenAI assistant message with `tool_calls`.

Token in, token out: the policy's chat template renders `messages` + `tools`, but a request whose messages are the
previous request's messages + the assistant message the endpoint returned + new messages is *not* re-rendered from the
start. Its prompt is the previous prompt + the completion's token ids exactly as sampled + the ids of what the template
puts after that assistant message (`continuation_text`: the conversation rendered with the returned assistant message
replaced by a sentinel, cut after the sentinel, as `dspo.env.prompting.ToolTurnTemplate` cuts a tool turn). So a
conversation that only appends stays one token sequence, whatever the template does to an assistant message's text
(JSON re-serialized tool calls, stripped thinking). Anything else (a rewritten or truncated history) is rendered from
scratch and becomes a new training sample (`dspo.agent.endpoint.episodes`).

Tool calls are parsed as vLLM's `hermes` parser does for Qwen2.5: each `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` block becomes one entry of `tool_calls`; the text before the first block is `content`. A block that
is not valid JSON stays in `content` (the agent sees what the model wrote; nothing is evaluated).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from dspo.agent import parsing

SENTINEL = "\u2983DSPO-COMPLETION\u2984"
CALL_OPEN, CALL_CLOSE = parsing.QWEN_OPEN, parsing.QWEN_CLOSE


def render(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None) -> str:
    """The chat template's text of `messages` + `tools`, ending with the assistant header."""
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=False
    )


def normalized(message: dict) -> tuple:
    """What must agree for two messages to be the same turn: role, text content, and the calls (name + parsed
    arguments); ids, `refusal`, `annotations` and the like do not matter."""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: the text parts, joined as `shapes` joins them
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            decoded, error = parsing.load_json(arguments)
            arguments = arguments if error is not None else decoded
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return (message.get("role"), content or "", tuple(calls))


def extends(messages: Sequence[dict], previous: Sequence[dict], returned: dict) -> bool:
    """Whether `messages` starts with `previous` + `returned` (the assistant message the endpoint answered with) and
    adds at least one message after them."""
    head = [*previous, returned]
    if len(messages) <= len(head):
        return False
    return all(normalized(a) == normalized(b) for a, b in zip(messages, head))


def continuation_text(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None, at: int) -> str:
    """What the template renders after the assistant message at index `at` of `messages`, through the final
    assistant header: the conversation rendered with that message's content replaced by a sentinel (and its calls
    dropped: the model's own tokens already hold them), cut after the sentinel."""
    replaced = [dict(m) for m in messages]
    replaced[at] = {"role": "assistant", "content": SENTINEL}
    text = render(tokenizer, replaced, tools)
    if text.count(SENTINEL) != 1:
        raise ValueError(
            "the tokenizer's chat template does not render an assistant message's content verbatim, so the endpoint "
            "cannot continue an episode's token sequence; use a Qwen2.5-style template"
        )
    return text.split(SENTINEL, 1)[1]


def assistant_message(
    text: str, eos_text: str | None, tool_names: Sequence[str] | None
) -> tuple[dict, bool, list[tuple[str, str]]]:
    """The OpenAI assistant message of a completion's text, whether it holds tool calls, and the malformed calls as
    (tool, error kind). The end-of-turn token is dropped from the content; with `tool_names` (the request's tools),
    every complete `<tool_call>…</tool_call>` block becomes an entry of `tool_calls` (ids `call_<k>`). A block that is
    not a JSON object with a name is still a call, with the model's raw text as its `arguments` (as OpenAI's API can
    return arguments that are not valid JSON): the agent gets to see its model's mistake, as the built-in loop shows
    one, and it is counted."""
    if eos_text and text.endswith(eos_text):
        text = text[: -len(eos_text)]
    if tool_names is None:
        return {"role": "assistant", "content": text}, False, []
    if CALL_OPEN not in text:
        if not text.rstrip().endswith(CALL_CLOSE):
            return {"role": "assistant", "content": text}, False, []
        raw = text.rstrip()[: -len(CALL_CLOSE)].strip()  # a call closed but never opened: still the model's call
        call = {"id": "call_0", "type": "function", "function": {"name": "unknown", "arguments": raw}}
        return (
            {"role": "assistant", "content": None, "tool_calls": [call]},
            True,
            [(parsing.NO_TOOL, parsing.MISSING_OPEN_TAG)],
        )
    content = text[: text.index(CALL_OPEN)]
    calls, kept, invalid = [], [], []
    for block in _blocks(text[len(content) :]):
        if not (block.startswith(CALL_OPEN) and block.endswith(CALL_CLOSE)):
            kept.append(block)  # text between blocks, or a block the model never closed
            continue
        name, arguments, error = _parse_block(block)
        calls.append({"name": name, "arguments": arguments})
        if error is not None:
            invalid.append((name if name in tool_names else parsing.NO_TOOL, error))
    if not calls:
        return {"role": "assistant", "content": text}, False, []
    message = {"role": "assistant", "content": (content + "".join(kept)).strip() or None}
    message["tool_calls"] = [{"id": f"call_{k}", "type": "function", "function": call} for k, call in enumerate(calls)]
    return message, True, invalid


def _blocks(text: str) -> list[str]:
    """`text` (starting at a `<tool_call>`) cut into `<tool_call>…</tool_call>` blocks and the text between them."""
    out, position = [], 0
    while position < len(text):
        start = text.find(CALL_OPEN, position)
        if start < 0:
            out.append(text[position:])
            break
        if start > position:
            out.append(text[position:start])
        end = text.find(CALL_CLOSE, start)
        end = len(text) if end < 0 else end + len(CALL_CLOSE)
        out.append(text[start:end])
        position = end
    return out


_NAME = re.compile(r'"name"\s*:\s*"([^"]{1,200})"')


def _parse_block(block: str) -> tuple[str, str, str | None]:
    """(name, arguments as a JSON string, None) of a well-formed block; for a malformed one the name found in it (or
    "unknown"), the model's raw text, and the error kind."""
    body = block[len(CALL_OPEN) : -len(CALL_CLOSE)].strip()
    value, error = parsing.load_json(body)
    if error is None and isinstance(value, dict) and isinstance(value.get("name"), str):
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            decoded, failed = parsing.load_json(arguments)
            arguments = decoded if failed is None else arguments
        if isinstance(arguments, dict):
            return value["name"], json.dumps(arguments), None
        return (
            value["name"],
            json.dumps(arguments) if not isinstance(arguments, str) else arguments,
            parsing.BAD_ARGUMENTS,
        )
    found = _NAME.search(body)
    kind = error[0] if error is not None else parsing.NOT_AN_OBJECT
    return (found.group(1) if found else "unknown"), body, kind
