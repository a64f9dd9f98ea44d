"""The judge's two clients behind one protocol (`JudgeClient.judge(conversations) -> [Reply]`, a batch at once), for
`dspo.env.judge.JudgedReward`:

- `HTTPJudge`: any OpenAI-compatible chat endpoint (a vLLM or SGLang server, a hosted API), with `concurrency`
  requests in flight, a `timeout_s` per request and `retries` on what a retry can fix (a connection refused or
  dropped, a timeout, HTTP 429 and 5xx; any other 4xx fails at once). It checks the server at construction (`GET
  <base_url>/models`): a judge that is down fails the run before the first round, naming the URL, rather than as a
  round of failed verdicts. `constrain` asks a vLLM server to sample only the choice words (vLLM 0.32's
  `structured_outputs: {"choice": [...]}` request field). The API key is read from the environment variable named
  by `api_key_env`, sent as a bearer token and never logged: every error text is scrubbed of it, and no repr shows it.
  It speaks HTTP itself (httpx) rather than through the `openai` SDK: the request field above is not the SDK's, and
  the SDK's own retries and errors would have to be undone to count failures per verdict.
- `LocalJudge`: a frozen local model (transformers, the toy's warm start on CPU by default) that does not write its
  verdict: it picks the choice word whose tokens have the highest log-probability after the rendered prompt (the sum
  over the word's tokens). That is deterministic and always parseable, which a toy model's free text is not (the
  warm start writes search-agent turns, never "yes"). The model is the process's one instance for its path and
  settings (`dspo.env.answerer.frozen_engine`, shared with `env=planner`'s answerer when the two name the same),
  built on first use and never trained: `FrozenEngine` refuses weight pushes and turns off its gradients.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Conversation = list[dict[str, str]]  # chat messages: [{"role": ..., "content": ...}]
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Reply:
    """The judge's reply to one conversation: its text, or why there is none (`error`)."""

    text: str | None = None
    error: str | None = None


class JudgeUnavailableError(RuntimeError):
    """The judge's server did not answer when the reward was built."""


class JudgeClient(Protocol):
    name: str  # what errors and reports name the judge by: its URL (never its key) or its model's path

    def judge(self, conversations: Sequence[Conversation]) -> list[Reply]: ...


# ------------------------------------------------------------------------------------------ over HTTP
class HTTPJudge:
    """An OpenAI-compatible chat endpoint as the judge (the module). Args (config keys `env.reward.judge.<key>`):
    base_url: e.g. `http://127.0.0.1:8000/v1`. model: the served model's name. api_key_env: the environment
    variable holding the key (None: no key). words: the choice words (sent with `constrain`). concurrency, timeout_s,
    retries, max_tokens, constrain: as the module says. check: ping `<base_url>/models` now (tests turn it off)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        words: Sequence[str],
        api_key_env: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 30.0,
        retries: int = 2,
        max_tokens: int = 8,
        constrain: bool = False,
        check: bool = True,
    ) -> None:
        import httpx

        if not model:
            raise ValueError("env.reward.judge.model: set the served model's name (required with base_url)")
        if concurrency < 1 or retries < 0 or timeout_s <= 0 or max_tokens < 1:
            raise ValueError(
                "env.reward.judge: concurrency >= 1, retries >= 0, timeout_s > 0 and max_tokens >= 1 are required "
                f"(got {concurrency}, {retries}, {timeout_s}, {max_tokens})"
            )
        self.name, self.model, self.words = base_url.rstrip("/"), model, list(words)
        self.concurrency, self.retries, self.max_tokens, self.constrain = concurrency, retries, max_tokens, constrain
        self._key = _read_key(api_key_env)
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._http = httpx.Client(headers=headers, timeout=timeout_s, limits=limits)
        if check:
            self.check()

    def __repr__(self) -> str:
        return f"HTTPJudge(base_url={self.name!r}, model={self.model!r})"

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "<api key>") if self._key else text

    def check(self) -> None:
        """`GET <base_url>/models`; fails naming the URL when the server does not answer or lacks `model`."""
        url = f"{self.name}/models"
        try:
            response = self._http.get(url)
            response.raise_for_status()
            served = [entry.get("id") for entry in response.json().get("data", [])]
        except Exception as exc:  # noqa: BLE001 - any failure here means the judge is not usable
            raise JudgeUnavailableError(
                f"env.reward.judge.base_url: the judge at {self.name} did not answer GET {url} "
                f"({self._scrub(f'{type(exc).__name__}: {exc}')[:300]}); start the server or fix the URL"
            ) from None
        if served and self.model not in served:
            raise JudgeUnavailableError(
                f"env.reward.judge.model={self.model!r}: the judge at {self.name} serves {served}; set one of them"
            )

    def judge(self, conversations: Sequence[Conversation]) -> list[Reply]:
        if not conversations:
            return []
        with concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="dspo-judge") as pool:
            return list(pool.map(self._ask, conversations))

    def _ask(self, messages: Conversation) -> Reply:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
        }
        if self.constrain:
            body["structured_outputs"] = {"choice": self.words}
        error = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.25 * 2**attempt, 4.0))
            reply, retry = self._post(body)
            if reply is not None:
                return reply
            error = retry
        return Reply(error=f"{error} (after {self.retries + 1} attempts)")

    def _post(self, body: dict) -> tuple[Reply | None, str]:
        """(the reply, "") or (None, why) when a retry may help; a reply carries the errors a retry cannot fix."""
        import httpx

        try:
            response = self._http.post(f"{self.name}/chat/completions", json=body)
        except httpx.HTTPError as exc:  # refused, dropped, timed out: the server may come back
            return None, self._scrub(f"{type(exc).__name__}: {exc}")[:300]
        if response.status_code in RETRY_STATUS:
            return None, f"HTTP {response.status_code}: {self._scrub(response.text)[:200]}"
        if response.status_code != 200:
            return Reply(error=f"HTTP {response.status_code}: {self._scrub(response.text)[:200]}"), ""
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return Reply(error=f"malformed response ({type(exc).__name__}): {self._scrub(response.text)[:200]}"), ""
        if not isinstance(content, str):
            return Reply(error="the response has no message content"), ""
        return Reply(text=content), ""

    def close(self) -> None:
        self._http.close()


def _read_key(api_key_env: str | None) -> str | None:
    if not api_key_env:
        return None
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(
            f"env.reward.judge.api_key_env={api_key_env!r}: that environment variable is not set (export the key "
            "there, or set api_key_env: null for a server without one)"
        )
    return key


# ------------------------------------------------------------------------------------------ a local model
class LocalJudge:
    """A frozen local model picking the likeliest choice word (the module). Args (config keys
    `env.reward.judge.<key>`): model_path, device, dtype: the model (built on first use, one per process). words:
    the choice words. batch_size: sequences per forward pass."""

    def __init__(
        self, model_path: str, words: Sequence[str], device: str = "cpu", dtype: str = "float32", batch_size: int = 32
    ) -> None:
        if not model_path:
            raise ValueError("env.reward.judge.model_path: set the local judge model's directory (or base_url)")
        if batch_size < 1:
            raise ValueError(f"env.reward.judge.batch_size={batch_size}: must be >= 1")
        self.name, self.words = str(model_path), list(words)
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        self._engine: Any = None

    def __repr__(self) -> str:
        return f"LocalJudge(model_path={self.name!r}, device={self.device!r})"

    def engine(self) -> Any:
        if self._engine is None:
            from dspo.engines import HFEngine
            from dspo.env.answerer import frozen_engine

            factory = functools.partial(HFEngine, batch_size=self.batch_size, device=self.device, dtype=self.dtype)
            self._engine = frozen_engine(self.name, factory)
        return self._engine

    def judge(self, conversations: Sequence[Conversation]) -> list[Reply]:
        if not conversations:
            return []
        engine = self.engine()
        tokenizer, model = engine.tokenizer, engine.engine.model
        prompts = [_render(tokenizer, messages) for messages in conversations]
        words = [tokenizer.encode(word, add_special_tokens=False) for word in self.words]
        scores = choice_logprobs(model, prompts, words, _pad_id(tokenizer), self.batch_size)
        return [Reply(text=self.words[int(row.argmax())]) for row in scores]


def _render(tokenizer: Any, messages: Conversation) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id


@torch.no_grad()
def choice_logprobs(
    model: Any, prompts: Sequence[list[int]], words: Sequence[list[int]], pad_id: int, batch_size: int = 32
) -> torch.Tensor:
    """[len(prompts), len(words)] the log-probability of each word's tokens following each prompt (the sum over the
    word's tokens).

    Each row is the prompt left-padded to its batch's longest, then the word, then padding to the longest word, so
    that every word's tokens are predicted within the last `span + 1` positions: the model computes logits there only
    (`logits_to_keep`). Full logits would be rows x tokens x vocabulary: 32 x 300 x 152k floats, 5.8 GB, for Qwen2.5.
    Position ids count real tokens only, so the left padding changes no position."""
    rows = [(p, w) for p in range(len(prompts)) for w in range(len(words))]
    span = max(len(word) for word in words)
    out = torch.empty(len(rows))
    device = next(model.parameters()).device
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(prompts[p]) for p, _ in chunk)
        ids = torch.full((len(chunk), width + span), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, w) in enumerate(chunk):
            first = width - len(prompts[p])
            ids[i, first:width], mask[i, first : width + len(words[w])] = torch.tensor(prompts[p]), 1
            ids[i, width : width + len(words[w])] = torch.tensor(words[w])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            logits_to_keep=span + 1,
        ).logits
        logp = torch.log_softmax(logits[:, :span].float(), dim=-1).cpu()  # kept position j predicts word token j
        for i, (_, w) in enumerate(chunk):
            out[start + i] = logp[i, torch.arange(len(words[w])), torch.tensor(words[w])].sum()
    return out.view(len(prompts), len(words))
