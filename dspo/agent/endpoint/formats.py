"""The two tool-call syntaxes the endpoint speaks (`rollout.agent.tag_format`), as vLLM's OpenAI server has a tool
parser per model family: how a conversation becomes prompt text, what follows a returned assistant message, where a
completion stops, and how its text becomes an assistant message with `tool_calls`.

- `qwen` (Qwen2.5 function calling): the chat template renders `messages` + `tools`; calls are `<tool_call>` JSON
  blocks (`dspo.agent.endpoint.chat`).
- `searchr1` (Search-R1's tags, the toy's format): the first messages (system, user) are rendered by the chat template
  without tool schemas (the instruction describes the tags); from then on the episode is one assistant turn, as in
  Search-R1: a tool message is spliced in as `\\n\\n<information>…</information>\\n\\n` (the built-in loop's wrappers,
  tokenized apart from the observation as it does), and a call is `<search> query </search>` (any tool with a
  `tag_argument`). A history that goes on after a user message (a framework that rewrites tool turns as user
  messages, like smolagents) is rendered as the chat template renders a multi-turn chat, each earlier assistant turn
  written as the model writes it in this format (its calls as tags, its tool results spliced in), and only the turn
  after the last user message spliced by tokens: such a request extends no earlier one, so it is a new sample.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dspo.agent import parsing
from dspo.agent.endpoint import chat
from dspo.agent.tool_calling import ANSWER_CLOSE
from dspo.env.prompting import ToolTurnTemplate

_TURN_ROLES = frozenset({"assistant", "tool"})  # what one searchr1 assistant turn is made of
Parsed = tuple[dict, bool, list[tuple[str, str]]]  # (assistant message, has tool calls, malformed calls: (tool, kind))


class QwenFormat:
    name = "qwen"

    def __init__(self, tokenizer: Any, tools: Mapping[str, Any]) -> None:
        self.tokenizer, self.tools = tokenizer, tools

    def prompt_ids(self, messages: Sequence[dict], schemas: Sequence[dict] | None) -> list[int]:
        return self.tokenizer.encode(chat.render(self.tokenizer, messages, schemas), add_special_tokens=False)

    def following_ids(self, messages: Sequence[dict], schemas: Sequence[dict] | None, at: int) -> list[int]:
        text = chat.continuation_text(self.tokenizer, messages, schemas, at)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stops(self, with_tools: bool) -> list[str]:
        return [ANSWER_CLOSE, *([chat.CALL_CLOSE] if with_tools else [])]

    def message(self, text: str, eos_text: str | None, tool_names: Sequence[str] | None) -> Parsed:
        return chat.assistant_message(text, eos_text, tool_names)


class SearchR1Format:
    name = "searchr1"

    def __init__(self, tokenizer: Any, tools: Mapping[str, Any]) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.wrapper = ToolTurnTemplate.from_tokenizer(tokenizer, "searchr1")
        self.closes = parsing.call_closes(tools, "searchr1")

    def prompt_ids(self, messages: Sequence[dict], schemas: Sequence[dict] | None) -> list[int]:
        """The template renders everything up to the last user (or system) message, earlier assistant turns folded
        into this format's text; the assistant turn after it is spliced by tokens, as the built-in loop writes it."""
        last = max((i for i, m in enumerate(messages) if m.get("role") not in _TURN_ROLES), default=-1)
        head = self.tokenizer.apply_chat_template(
            self._folded(messages[: last + 1]), add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer.encode(head, add_special_tokens=False)
        for message in messages[last + 1 :]:
            ids += self._turn_ids(message)
        return ids

    def following_ids(self, messages: Sequence[dict], schemas: Sequence[dict] | None, at: int) -> list[int] | None:
        """None when a user or system message follows: the episode's assistant turn ends there, and the template
        renders what comes after it (`prompt_ids`)."""
        if any(m.get("role") not in _TURN_ROLES for m in messages[at + 1 :]):
            return None
        return [t for message in messages[at + 1 :] for t in self._turn_ids(message)]

    def _turn_ids(self, message: dict) -> list[int]:
        if message.get("role") == "tool":
            observation = self.tokenizer.encode(chat.normalized(message)[1], add_special_tokens=False)
            return self.wrapper.prefix_ids + observation + self.wrapper.suffix_ids
        return self.tokenizer.encode(self._turn_text(message), add_special_tokens=False)

    def _turn_text(self, message: dict) -> str:
        content = chat.normalized(message)[1]
        if message.get("role") == "tool":
            return self.wrapper.prefix_text + content + self.wrapper.suffix_text
        return content + "".join(self._call_text(call) for call in message.get("tool_calls") or [])

    def _folded(self, messages: Sequence[dict]) -> list[dict]:
        """Each run of assistant and tool messages as one assistant message with this format's text."""
        folded: list[dict] = []
        for message in messages:
            if message.get("role") not in _TURN_ROLES:
                folded.append({"role": message["role"], "content": chat.normalized(message)[1]})
            elif folded and folded[-1]["role"] == "assistant":
                folded[-1]["content"] += self._turn_text(message)
            else:
                folded.append({"role": "assistant", "content": self._turn_text(message)})
        return folded

    def _call_text(self, call: dict) -> str:
        function = call.get("function", {})
        name, arguments = function.get("name"), function.get("arguments")
        tool = self.tools.get(name)
        decoded, error = parsing.load_json(arguments) if isinstance(arguments, str) else (arguments, None)
        if tool is None or error is not None or not isinstance(decoded, dict):
            return f"<{name}> {arguments} </{name}>"
        value = decoded.get(tool.tag_argument, decoded.get("query_list", [""]))
        return f"<{name}> {value[0] if isinstance(value, list) and value else value} </{name}>"

    def stops(self, with_tools: bool) -> list[str]:
        return [ANSWER_CLOSE, *(self.closes if with_tools else [])]

    def message(self, text: str, eos_text: str | None, tool_names: Sequence[str] | None) -> Parsed:
        """A turn that ends with a tag tool's closing tag is a call: `{tag_argument: the tag's content}` as its
        arguments (checked by the tool when it runs), or, without the opening tag, the model's raw text (counted as
        `missing_open_tag`; not JSON, as the built-in loop answers such a call with an error)."""
        if eos_text and text.endswith(eos_text):
            text = text[: -len(eos_text)]
        close = next((c for c in self.closes if text.rstrip().endswith(c)), None) if tool_names is not None else None
        if close is None:
            return {"role": "assistant", "content": text}, False, []
        name = close[2:-1]
        open_tag, end = f"<{name}>", text.rfind(close)
        start = text.rfind(open_tag, 0, end)
        if start < 0:
            content, arguments, invalid = "", text[:end].strip(), [(name, parsing.MISSING_OPEN_TAG)]
        else:
            body = text[start + len(open_tag) : end].strip()
            content, arguments, invalid = text[:start], json.dumps({self.tools[name].tag_argument: body}), []
        tool_call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}
        return {"role": "assistant", "content": content, "tool_calls": [tool_call]}, True, invalid


FORMATS = {"qwen": QwenFormat, "searchr1": SearchR1Format}
