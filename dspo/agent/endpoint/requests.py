"""`/v1/chat/completions` bodies in and out: a request checked field by field (`parse_request`, errors that name the
field), and the OpenAI `chat.completion` object of a call (`completion_body`).

Supported: `model` (`policy`), `messages`, `tools` (OpenAI function schemas), `tool_choice` (`auto` | `none`),
`temperature`, `top_p`, `max_tokens` / `max_completion_tokens`, `n`, `stop`, `logprobs`, `seed` (ignored: the
rollout seeds the engine). Refused with a message: `stream`, `tool_choice` naming a function or `required`, and any
sampling setting that differs from training's (`SamplingPolicy`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dspo.agent.endpoint.episodes import RequestError
from dspo.types import Generation

MODEL_NAME = "policy"
MAX_N = 64
MAX_STOPS = 8


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str = "auto"
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False

    @property
    def tool_names(self) -> list[str] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.get("function", {}).get("name") for t in self.tools]


@dataclass(frozen=True)
class SamplingPolicy:
    """What training samples with: a request may omit these or repeat them, not change them (the engine's logprobs
    must be those of the distribution the objective corrects for)."""

    temperature: float  # 0 = greedy (evaluation)
    top_p: float = 1.0

    def check(self, request: ChatRequest) -> None:
        if request.temperature is not None and abs(request.temperature - self.temperature) > 1e-9:
            raise RequestError(
                400,
                f"temperature={request.temperature} refused: this endpoint samples at temperature={self.temperature} "
                "(training's rollout.agent.temperature, or 0 when evaluating); omit temperature or send that value",
            )
        if request.top_p is not None and abs(request.top_p - self.top_p) > 1e-9:
            raise RequestError(400, f"top_p={request.top_p} refused: this endpoint samples with top_p={self.top_p}")


def parse_request(body: Any) -> ChatRequest:
    """A request body checked field by field; `RequestError(400)` names the first field that is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    if body.get("stream"):
        raise RequestError(400, "stream=true is not supported; send stream=false (or omit it)")
    model = body.get("model", MODEL_NAME)
    if model != MODEL_NAME:
        raise RequestError(404, f"model {model!r} does not exist; this endpoint serves one model, {MODEL_NAME!r}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
        raise RequestError(400, "messages: a non-empty list of objects with a role (system|user|assistant|tool)")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(_is_tool(t) for t in tools)):
        raise RequestError(400, "tools: a list of {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none"):
        raise RequestError(400, f"tool_choice={tool_choice!r} is not supported; use 'auto' or 'none'")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    n = body.get("n", 1)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise RequestError(400, f"max_tokens={max_tokens!r}: a positive integer")
    if not (_is_int(n) and 1 <= n <= MAX_N):
        raise RequestError(400, f"n={n!r}: an integer within [1, {MAX_N}]")
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, f"stop: a string or a list of at most {MAX_STOPS} non-empty strings")
    return ChatRequest(
        messages=messages,
        tools=tools or None,
        tool_choice=tool_choice,
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        max_tokens=max_tokens,
        n=n,
        stop=list(stop),
        logprobs=bool(body.get("logprobs", False)),
    )


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") in ("system", "user", "assistant", "tool", "developer")


def _is_tool(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(400, f"{key}={value!r}: a number")
    return float(value)


@dataclass
class Choice:
    message: dict
    finish_reason: str  # stop | length | tool_calls
    generation: Generation


def completion_body(choices: list[Choice], prompt_tokens: int, logprobs: bool, tokenizer: Any) -> dict:
    """The OpenAI `chat.completion` object."""
    completion_tokens = sum(len(c.generation.token_ids) for c in choices)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [
            {
                "index": k,
                "message": choice.message,
                "finish_reason": choice.finish_reason,
                "logprobs": _logprobs(choice.generation, tokenizer) if logprobs else None,
            }
            for k, choice in enumerate(choices)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _logprobs(generation: Generation, tokenizer: Any) -> dict:
    tokens = tokenizer.convert_ids_to_tokens(list(generation.token_ids))
    return {
        "content": [
            {"token": str(token), "logprob": float(lp), "bytes": None, "top_logprobs": []}
            for token, lp in zip(tokens, generation.logprobs)
        ]
    }


def models_body() -> dict:
    return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "dspo"}]}
