"""Parse the model's tool calls. Every malformed call becomes a `ParsedCall` with an `error` (later shown to the model
as the tool's answer), never an exception: one bad generation must not kill a long run.

Two formats, one loop (`AgentConfig.tag_format`), any tools (`dspo.env.tools`):
- `qwen` (Qwen2.5 function calling): `<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>`; the name picks
  the tool, whose `prepare` checks the arguments (the search tool takes `query_list`, or a plain `query` string as
  Search-R1's retriever tool does).
- `searchr1`: `<tool> value </tool>`, one tag per tool that has a `tag_argument` (the search tool's:
  `<search> q </search>`).

Each error has a kind, counted per tool (`rollout/invalid/<tool>/<kind>`; `call` when no tool could be told).
Nothing the model writes makes parsing raise (a property test throws random text and random JSON at it): a name that
is not a string, JSON nested deeper than `MAX_JSON_DEPTH`, a number too long to read, or a string no text can carry
(JSON's `"\ud800"`, a lone surrogate, or NUL: `bad_characters`, checked before any tool sees the call) are invalid
calls like the others. A tool's `prepare` reports bad arguments by raising `InvalidCall`; anything else it raises is
that tool's bug and propagates.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dspo.env.search_tool import EMPTY_QUERY, QUERY_TOO_LONG, TOO_MANY_QUERIES  # noqa: F401  the search tool's kinds
from dspo.env.tools import BAD_ARGUMENTS, BAD_CHARACTERS, InvalidCall, check_characters  # noqa: F401  kinds, counted

# Error kinds, each counted separately in the rollout stats (the search tool adds its own: empty_query, ...).
MISSING_OPEN_TAG = "missing_open_tag"
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
UNKNOWN_TOOL = "unknown_tool"
CALL_AFTER_LAST_TURN = "call_after_last_turn"
TOO_DEEP = "nested_too_deep"
NO_TOOL = "call"  # the label of errors no tool can be told for (invalid JSON, an unknown name)

QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
# No tool takes arguments nested this deep; deeper JSON would only reach recursive code later (records, copies, logs).
MAX_JSON_DEPTH = 32


@dataclass
class ParsedCall:
    """A parsed call: the tool it names (`NO_TOOL` when none could be told) and its prepared `arguments` when valid,
    else `error_kind` + a human-readable `error` for the model."""

    tool: str = NO_TOOL
    arguments: dict = field(default_factory=dict)
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None


def _last_block(text: str, open_tag: str, close_tag: str) -> str | None:
    """Content between the last `open_tag` before the last `close_tag` and that `close_tag`; None without both."""
    end = text.rfind(close_tag)
    if end < 0:
        return None
    start = text.rfind(open_tag, 0, end)
    if start < 0:
        return None
    return text[start + len(open_tag) : end]


def call_closes(tools: Mapping[str, Any], tag_format: str) -> list[str]:
    """The stop strings that end a turn with a call: `</tool_call>`, or each tag tool's closing tag."""
    if not tools:
        return []
    if tag_format == "qwen":
        return [QWEN_CLOSE]
    return [f"</{name}>" for name, tool in tools.items() if tool.tag_argument]


def _fail(tool: str, kind: str, message: str) -> ParsedCall:
    return ParsedCall(tool=tool, error_kind=kind, error=message)


def prepare_call(tool: Any, arguments: Any) -> dict:
    """`tool.prepare(arguments)`, after refusing characters nothing downstream can carry; raises InvalidCall."""
    check_characters(arguments, tool.name)
    return tool.prepare(arguments)


def _prepared(tool: Any, arguments: Any) -> ParsedCall:
    try:
        return ParsedCall(tool=tool.name, arguments=prepare_call(tool, arguments))
    except InvalidCall as invalid:
        return _fail(tool.name, invalid.kind, invalid.message)


def parse_call(text: str, tools: Mapping[str, Any], tag_format: str, close: str) -> ParsedCall:
    """Parse the call that ends `text` (a turn that stopped at `close`, one of `call_closes`)."""
    if tag_format == "qwen":
        return _parse_qwen(text, tools)
    name = close[2:-1]
    tool, open_tag = tools.get(name), f"<{name}>"
    if tool is None:  # only a stop string of `call_closes` ends a call turn; anything else names no tool
        return _fail(NO_TOOL, UNKNOWN_TOOL, f"Error: {close} closes no tool's call.")
    body = _last_block(text, open_tag, close)
    if body is None:
        return _fail(
            name, MISSING_OPEN_TAG, f"Error: found {close} without {open_tag}. {tool.tag_hint(open_tag, close)}"
        )
    return _prepared(tool, {tool.tag_argument: body.strip()})  # `<judge> yes </judge>`: the argument is 'yes'


def _parse_qwen(text: str, tools: Mapping[str, Any]) -> ParsedCall:
    """The last `<tool_call>…</tool_call>` block: JSON object, a known tool name, arguments the tool accepts."""
    names = list(tools)
    usage = " or ".join(tool.usage() for tool in tools.values())
    how = f"Call the tool as {usage}." if len(names) == 1 else f"Call a tool as {usage}."
    body = _last_block(text, QWEN_OPEN, QWEN_CLOSE)
    if body is None:
        return _fail(NO_TOOL, MISSING_OPEN_TAG, f"Error: found {QWEN_CLOSE} without {QWEN_OPEN}. {how}")
    call, problem = load_json(body.strip())
    if problem is not None:
        return _fail(NO_TOOL, problem[0], f"Error: the tool call is not valid JSON ({problem[1]}). {how}")
    if not isinstance(call, dict):
        return _fail(NO_TOOL, NOT_AN_OBJECT, f"Error: the tool call must be a JSON object. {how}")
    name = call.get("name")
    if not isinstance(name, str) or name not in tools:  # a list or an object as the name is unhashable
        known = f"the only tool is {names[0]!r}" if len(names) == 1 else "the tools are " + ", ".join(map(repr, names))
        return _fail(NO_TOOL, UNKNOWN_TOOL, f"Error: unknown tool {_short(name)}; {known}.")
    return _prepared(tools[name], call.get("arguments"))


def load_json(text: str) -> tuple[Any, tuple[str, str] | None]:
    """(value, None), or (None, (error kind, reason)) for text that is not JSON a tool can take: malformed, a
    number past Python's digit limit (a ValueError that is no JSONDecodeError), or nested deeper than MAX_JSON_DEPTH
    (the decoder's own recursion limit raises RecursionError)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, (INVALID_JSON, exc.msg)
    except ValueError as exc:
        return None, (INVALID_JSON, str(exc).split(";")[0][:120])
    except RecursionError:
        return None, (TOO_DEEP, f"nested deeper than {MAX_JSON_DEPTH} levels")
    if json_depth(value) > MAX_JSON_DEPTH:
        return None, (TOO_DEEP, f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value, None


def json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
