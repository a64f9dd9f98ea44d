"""Tools: what the agent can call. A tool has a name, a description, a JSON schema of its arguments (rendered into the
Qwen2.5 tool-call prompt, and into Search-R1's tag format where the tool has a `tag_argument`), and runs a *batch* of
calls at once: one per live trajectory that called it in a turn, so a turn of 200 trajectories is one retriever (or
simulator) call per tool, not 200.

Two kinds of fault, told apart (docs/extending.md, "a new tool"):
- the model's: an unknown tool, arguments that do not fit the schema or the tool's limits. `prepare` raises
  `InvalidCall(kind, message)`; the message goes back to the model as the tool's answer, the kind is counted
  (`rollout/invalid/<tool>/<kind>`), and the episode goes on.
- the tool's: `run` raises, passes its `timeout_s`, or returns a result with `error` set. That trajectory gets a tool
  message and a tool error is counted (`rollout/tool_errors/<tool>`); above `env.max_tool_error_share` of a round's
  calls the round fails naming the tool (training on error messages would corrupt the signal silently). A backend
  that is down after its own retries raises `ToolUnavailableError` (the retrieval client's `RetrieverUnavailableError`
  is one): the round fails at once, as before tools were plug-ins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dspo.types import Passage

BAD_ARGUMENTS = "bad_arguments"  # the error kind of arguments that do not fit a tool's schema
# the error kind of arguments holding characters UTF-8, a tokenizer or an HTTP body cannot carry: JSON's `"\ud800"`
# decodes to a lone surrogate (tokenizers raise TypeError on it, httpx UnicodeEncodeError), `"\u0000"` to NUL
BAD_CHARACTERS = "bad_characters"
JSON_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
}


class ToolUnavailableError(RuntimeError):
    """A tool's backend is down after the tool's own retries: the round fails (not counted as a tool error)."""


class InvalidCall(ValueError):
    """The model's call does not fit the tool (`kind` is counted, `message` is shown to the model)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def _bad_character(text: str) -> str | None:
    if "\x00" in text:
        return "\\u0000"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"\\u{ord(text[error.start]):04x}"
    return None


def check_characters(arguments: Any, tool: str) -> None:
    """Raise InvalidCall(BAD_CHARACTERS) when any string of a call's arguments (keys included, at any depth) holds a
    lone surrogate or NUL: whatever the tool does with it next (echo it into its answer, which is tokenized; send it
    over HTTP) would raise there, inside the run, instead of failing this one call."""
    stack = [arguments]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            bad = _bad_character(node)
            if bad is not None:
                raise InvalidCall(
                    BAD_CHARACTERS,
                    f"Error: the arguments of {tool!r} hold the character {bad}, which no text can carry (a lone "
                    "surrogate or NUL). Write plain text.",
                )
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


def carried(text: str) -> str:
    """`text` as a tokenizer takes it: a lone surrogate (a tool echoing what it read, a corpus with JSON escapes)
    becomes '?' instead of a TypeError inside the run."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


@dataclass
class ToolResult:
    """A tool's answer to one call: the text shown to the model, the passages it retrieved (ids and titles for
    rewards such as StepSearch's), `error` (a short reason) when the tool failed on this call, and `metrics` the tool
    wants logged (averaged over a round's calls as `rollout/tool/<tool>/<name>`, e.g. a simulator's noise)."""

    text: str
    passages: list[Passage] = field(default_factory=list)
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class CallContext:
    """What a tool may know about the episode a call comes from (hidden from the model; never in the schema)."""

    item: Any  # the QAItem: question, golden_answers, metadata
    turn: int  # 0-based model turn of the call
    episode_index: int  # position of the episode in the agent's batch
    # the episode's model turns so far (`TurnRecord`s, the calling turn last, without its result yet): what the
    # episode found, for a tool that reads it (env=planner's answerer answers from the passages retrieved before)
    history: list = field(default_factory=list)


class Tool:
    """Base class. Subclasses set `name`, `description`, `parameters` and implement `run`; `prepare` validates the
    arguments against `parameters` (required keys, JSON types, no unknown keys) unless overridden."""

    name: str = "tool"
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}
    tag_argument: str | None = None  # Search-R1 format: `<name> value </name>` fills this argument (stripped)
    timeout_s: float | None = None  # a batch that runs longer counts as a tool error for each of its calls

    def schema(self) -> dict:
        """The Qwen2.5 / OpenAI function schema the chat template renders into the prompt."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def usage(self) -> str:
        """An example call, as the model should write it (shown after a malformed call)."""
        example = {key: f"<{key}>" for key in self.parameters.get("required", [])}
        return json.dumps({"name": self.name, "arguments": example})

    def tag_hint(self, open_tag: str, close_tag: str) -> str:
        return f"Call it as {open_tag} {self.tag_argument} {close_tag}."

    def prepare(self, arguments: Any) -> dict:
        """The call's arguments, checked against the schema; raises InvalidCall."""
        check_arguments(self.parameters, arguments, self.name, self.usage())
        return dict(arguments)

    def run(self, calls: list[dict], contexts: list[CallContext]) -> list[ToolResult]:
        """One result per call, in order."""
        raise NotImplementedError

    def on_progress(self, step: int, total_steps: int | None) -> None:
        """Called by the trainer before each round (curricula, e.g. a simulator's growing noise); default: nothing."""


def check_arguments(schema: dict, arguments: Any, tool: str, usage: str) -> None:
    """A small JSON-schema check (object with typed properties, `enum`s, required keys, no others), enough for tool
    calls; raises InvalidCall("bad_arguments", ...) naming the key."""
    if not isinstance(arguments, dict):
        raise InvalidCall(BAD_ARGUMENTS, f"Error: the arguments of {tool!r} must be a JSON object. Use {usage}.")
    properties = schema.get("properties", {})
    missing = [key for key in schema.get("required", []) if key not in arguments]
    unknown = [key for key in arguments if key not in properties]
    if missing or unknown:
        what = f"missing {missing}" if missing else f"unknown {unknown}"
        raise InvalidCall(BAD_ARGUMENTS, f"Error: arguments of {tool!r}: {what}. Use {usage}.")
    for key, value in arguments.items():
        expected = properties[key].get("type")
        if expected and not _is_type(value, expected, properties[key]):
            raise InvalidCall(BAD_ARGUMENTS, f"Error: argument {key!r} of {tool!r} must be a {expected}. Use {usage}.")
        choices = properties[key].get("enum")
        if choices is not None and value not in choices:
            raise InvalidCall(BAD_ARGUMENTS, f"Error: argument {key!r} of {tool!r} must be one of {choices}.")


def _is_type(value: Any, expected: str, spec: dict) -> bool:
    kind = JSON_TYPES.get(expected)
    if kind is None:
        return True
    if expected in ("integer", "number") and isinstance(value, bool):
        return False
    if not isinstance(value, kind):
        return False
    item = spec.get("items", {}).get("type") if expected == "array" else None
    return item is None or all(_is_type(v, item, spec.get("items", {})) for v in value)
