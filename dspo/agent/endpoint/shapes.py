"""The shapes of a `/v1/chat/completions` request's `messages` and `tools`, as OpenAI defines them, checked field by
field and normalized before anything is rendered.

Every error is a `RequestError(400)` naming the field (`messages[2].content[0].type`), so a bad request is answered on
its own and never reaches the chat template (a template fed a list or a number where it expects a string raises, and
that error would otherwise end the round). What comes out is what the template and `chat.extends` expect: every
message a fresh dict with a role the template renders, its content a string, and its tool calls
`{"id", "type": "function", "function": {"name", "arguments"}}` with `arguments` a string.

- `content`: a string, or a list of content parts whose `text` parts are joined with "\\n" (as vLLM's server joins
  them); any other part (`image_url`, `input_audio`, `file`, `refusal`) is refused by its type: the policy reads text.
- `developer` is `system` (OpenAI's newer name for it; the Qwen template has no branch for `developer` and would drop
  it silently). `function` messages (the API's deprecated pre-tools form) are refused: send `tool` messages.
- An `assistant` message may have `null` or no `content` when it has `tool_calls` (what the API returns with calls).
"""

from __future__ import annotations

import json
from typing import Any

from dspo.agent.endpoint.episodes import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096


def check_messages(messages: Any) -> list[dict]:
    """The request's messages, checked and normalized (module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: a non-empty list of message objects ({'role': ..., 'content': ...})")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(400, f"messages: {len(messages)} messages; at most {MAX_MESSAGES}")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise RequestError(400, f"{where}: an object with a role and content, got {_kind(message)}")
    role = message.get("role")
    if role == "function":
        raise RequestError(400, f"{where}.role='function' (the API's deprecated form) is not supported: send a 'tool'")
    if role not in ROLES:
        raise RequestError(400, f"{where}.role={_short(role)}: one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    calls = message.get("tool_calls")
    if role == "assistant" and calls is not None:
        out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    elif calls is not None:
        raise RequestError(400, f"{where}.tool_calls: only an assistant message has tool calls (role {role!r})")
    if "content" not in message or message["content"] is None:
        if role != "assistant":
            raise RequestError(400, f"{where}.content: required for a {role} message (a string or text parts)")
        if not out.get("tool_calls"):
            raise RequestError(400, f"{where}.content: an assistant message needs content, tool_calls or both")
        out["content"] = ""
    else:
        out["content"] = _content(message["content"], f"{where}.content")
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise RequestError(400, f"{where}.{key}={_short(value)}: a string")
        if value is not None:
            out[key] = value
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where}: a string or a list of content parts, got {_kind(content)}")
    texts = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(400, f"{here}: a content part ({{'type': 'text', 'text': ...}}), got {_kind(part)}")
        if part.get("type") != "text":
            raise RequestError(
                400, f"{here}.type={_short(part.get('type'))}: only 'text' parts are supported (the policy reads text)"
            )
        if not isinstance(part.get("text"), str):
            raise RequestError(400, f"{here}.text={_short(part.get('text'))}: a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(400, f"{where}: a list of tool calls, got {_kind(calls)}")
    out = []
    for k, call in enumerate(calls):
        here = f"{where}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise RequestError(400, f"{here}.function: an object {{'name': ..., 'arguments': '<JSON string>'}}")
        if call.get("type", "function") != "function":
            raise RequestError(400, f"{here}.type={_short(call.get('type'))}: only 'function' calls are supported")
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str):
            raise RequestError(400, f"{here}.function.name={_short(name)}: a string")
        if isinstance(arguments, dict):  # some clients send the decoded object: same call
            arguments = json.dumps(arguments)
        if not isinstance(arguments, str):
            raise RequestError(400, f"{here}.function.arguments={_short(arguments)}: a JSON string")
        call_id = call.get("id", f"call_{k}")
        if not isinstance(call_id, str):
            raise RequestError(400, f"{here}.id={_short(call_id)}: a string")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def check_tools(tools: Any) -> list[dict] | None:
    """The request's `tools` (OpenAI function schemas), checked: each `{'type': 'function', 'function': {'name': str,
    'description'?: str, 'parameters'?: object}}`."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(400, f"tools: a list of function schemas, got {_kind(tools)}")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise RequestError(400, f"{where}: {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        if not isinstance(function.get("name"), str):
            raise RequestError(400, f"{where}.function.name={_short(function.get('name'))}: a string")
        for key, kind in (("description", str), ("parameters", dict)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise RequestError(400, f"{where}.function.{key}={_short(function[key])}: a {kind.__name__}")
    return tools or None


def check_tool_choice(choice: Any, tools: list[dict] | None) -> str:
    """`auto` | `none` | `required` | `{'type': 'function', 'function': {'name': ...}}` -> `none`, or `auto` for the
    rest: the endpoint cannot force a call without constraining decoding (which would change the distribution
    trained on), so `required` and a named function leave the choice to the policy, as `auto` does."""
    if choice is None or choice in ("auto", "none", "required"):
        return "none" if choice == "none" else "auto"
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(
            400,
            f"tool_choice={_short(choice)}: 'auto', 'none', 'required' or {{'type': 'function', 'function': "
            "{'name': ...}}",
        )
    names = [tool["function"]["name"] for tool in tools or []]
    if function["name"] not in names:
        raise RequestError(400, f"tool_choice names {function['name']!r}, which is not in tools ({names})")
    return "auto"


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
