"""`/v1/chat/completions` bodies in and out: a request checked field by field (`parse_request`, errors that name the
field; the shapes of `messages` and `tools` in `dspo.agent.endpoint.shapes`), and the OpenAI `chat.completion` object
of a call (`completion_body`).

Supported: `model` (`policy`), `messages`, `tools` (OpenAI function schemas), `tool_choice` (`auto` | `none` |
`required` | a named function: all but `none` leave the choice to the policy), `parallel_tool_calls` (every call the
model writes is returned), `max_tokens` / `max_completion_tokens`, `n`, `stop`, `logprobs`, `top_logprobs` (answered
with none), `response_format` `text`. Refused with a message naming the field: `stream`, another `response_format`,
the deprecated `functions` / `function_call`.

Sampling is the trainer's (`SamplingPolicy`): `temperature`, `top_p`, `seed`, the penalties and `logit_bias`, an `n`
above `MAX_N` and a `max_tokens` above `rollout.agent.max_new_tokens_per_turn` are replaced by what training (or
greedy evaluation) samples with, never refused; each replacement is counted (`rollout/overridden_sampling`) and
warned about once per run.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dspo.agent.endpoint.episodes import RequestError
from dspo.agent.endpoint.shapes import check_messages, check_tool_choice, check_tools
from dspo.types import Generation

MODEL_NAME = "policy"
MAX_N = 64
MAX_STOPS = 8
MAX_TOP_LOGPROBS = 20
NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0}  # what the engine samples with: no penalty


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
    seed: int | None = None
    penalties: dict[str, float] = field(default_factory=dict)  # the ones sent, by name
    logit_bias: bool = False  # a non-empty logit_bias was sent

    @property
    def tool_names(self) -> list[str] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t["function"]["name"] for t in self.tools]


@dataclass(frozen=True)
class SamplingPolicy:
    """What training samples with. A request's own sampling settings are replaced by these, never refused: the
    engine's logprobs must be those of the distribution the objective corrects for, and an agent written for a
    deployed model sets a temperature of its own."""

    temperature: float  # 0 = greedy (evaluation)
    top_p: float = 1.0
    max_new_tokens: int = 256  # rollout.agent.max_new_tokens_per_turn

    def overrides(self, request: ChatRequest) -> list[tuple[str, Any, Any]]:
        """(parameter, what the request sent, what is used instead) for each setting of `request` that is replaced;
        the request's `n` is capped to `MAX_N` here."""
        out: list[tuple[str, Any, Any]] = []
        if request.temperature is not None and abs(request.temperature - self.temperature) > 1e-9:
            out.append(("temperature", request.temperature, self.temperature))
        if request.top_p is not None and abs(request.top_p - self.top_p) > 1e-9:
            out.append(("top_p", request.top_p, self.top_p))
        if request.seed is not None:
            out.append(("seed", request.seed, "the rollout's seed"))
        for name, value in request.penalties.items():
            if value != NEUTRAL[name]:
                out.append((name, value, NEUTRAL[name]))
        if request.logit_bias:
            out.append(("logit_bias", "a bias", "none"))
        if request.n > MAX_N:
            out.append(("n", request.n, MAX_N))
            request.n = MAX_N
        if request.max_tokens is not None and request.max_tokens > self.max_new_tokens:
            out.append(("max_tokens", request.max_tokens, self.max_new_tokens))
        return out


def parse_request(body: Any) -> ChatRequest:
    """A request body checked field by field; `RequestError` (400, or 404 for another model) names the first field
    that is wrong."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    if body.get("stream"):
        raise RequestError(400, "stream=true is not supported; send stream=false (or omit it)")
    model = body.get("model", MODEL_NAME)
    if model != MODEL_NAME:
        raise RequestError(
            404, f"model {str(model)[:60]!r} does not exist; this endpoint serves one model, {MODEL_NAME!r}"
        )
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise RequestError(400, f"{old} (the API's deprecated form) is not supported: send tools and tool_choice")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        kind = response_format.get("type") if isinstance(response_format, dict) else response_format
        raise RequestError(
            400,
            f"response_format={str(kind)[:60]!r} is not supported: the policy's text is returned as it was sampled "
            "(constrained decoding would change the distribution trained on); omit response_format or send "
            "{'type': 'text'}",
        )
    messages = check_messages(body.get("messages"))
    tools = check_tools(body.get("tools"))
    tool_choice = check_tool_choice(body.get("tool_choice"), tools)
    if not isinstance(body.get("parallel_tool_calls", True), bool):
        raise RequestError(400, f"parallel_tool_calls={body['parallel_tool_calls']!r}: true or false")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    n = body.get("n", 1)
    n = 1 if n is None else n
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise RequestError(400, f"max_tokens={str(max_tokens)[:60]}: a positive integer")
    if not (_is_int(n) and n >= 1):
        raise RequestError(400, f"n={str(n)[:60]}: a positive integer")
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, f"stop: a string or a list of at most {MAX_STOPS} non-empty strings")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(400, f"seed={str(seed)[:60]}: an integer")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None and not (_is_int(top_logprobs) and 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise RequestError(400, f"top_logprobs={str(top_logprobs)[:60]}: an integer within [0, {MAX_TOP_LOGPROBS}]")
    logprobs = body.get("logprobs", False)
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(400, f"logprobs={str(logprobs)[:60]}: true or false")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise RequestError(400, f"logit_bias: an object of token id -> bias, got {type(logit_bias).__name__}")
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        max_tokens=max_tokens,
        n=n,
        stop=list(stop),
        logprobs=bool(logprobs),
        seed=seed,
        penalties={k: v for k in NEUTRAL if (v := _number(body, k)) is not None},
        logit_bias=bool(logit_bias),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(400, f"{key}={str(value)[:60]}: a number")
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
