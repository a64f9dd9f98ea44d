"""Client for a retrieval service speaking Search-R1's `POST /retrieve` (dspo-serve or Search-R1's own server).

Connection failures, timeouts and 5xx answers are retried with exponential backoff (`backoff_s`, 2·backoff_s, ...,
at most `max_backoff_s` apart; each wait drawn between half and all of that, so that ranks that timed out together
on a slow server do not all resend their batch at the same moment) until `max_wait_s` has passed since the first
failure, so a training run outlives a restart of the service (a 21M-passage index takes minutes to load). Each wait
is logged as a warning naming the URL and counted in `retries`. A 4xx is the caller's fault and fails at once with
the server's message. When the service stays unreachable for the whole window, `RetrieverUnavailableError` names
the URL and how to start a server.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import httpx

from dspo.env.tools import ToolUnavailableError
from dspo.search.corpus import split_contents
from dspo.types import Passage

log = logging.getLogger(__name__)

# Not Python's seeded `random`: seed_everything gives every rank the same stream, hence the same "random" waits.
_JITTER = random.SystemRandom()


def backoff_sleep(
    attempt: int, backoff_s: float, max_backoff_s: float, remaining_s: float, uniform: Callable = _JITTER.uniform
) -> float:
    """Seconds to wait before retry `attempt + 1`: "equal jitter", uniform in [c/2, c] for c = backoff_s·2^attempt
    capped at max_backoff_s; never past the `remaining_s` of the max_wait_s window."""
    ceiling = min(backoff_s * 2 ** min(attempt, 30), max_backoff_s)
    return min(uniform(ceiling / 2, ceiling), remaining_s)


class RetrieverUnavailableError(ToolUnavailableError):
    """The retrieval service could not be reached (or kept failing) after all retries: the round fails (a tool that is
    down, not a tool error to count and go on with; dspo.env.tools)."""


class RetrieverRequestError(ValueError):
    """The retrieval service rejected the request (4xx) or answered something that is not Search-R1's format."""


def parse_hit(item: object, where: str) -> Passage:
    """One hit of a /retrieve answer: `{"document": {...}, "score": s}` or a bare document (Search-R1 without
    return_scores). The document has FlashRAG `contents`, or `title`/`text`."""
    if not isinstance(item, dict):
        raise RetrieverRequestError(f"{where}: expected an object, got {type(item).__name__}")
    doc = item.get("document", item)
    if not isinstance(doc, dict):
        raise RetrieverRequestError(f"{where}: 'document' must be an object")
    if isinstance(doc.get("contents"), str):
        title, text = split_contents(doc["contents"])
    elif isinstance(doc.get("text"), str):
        title, text = str(doc.get("title", "")), doc["text"]
    else:
        raise RetrieverRequestError(f"{where}: document has neither 'contents' nor 'text'")
    score = item.get("score", 0.0)
    return Passage(id=str(doc.get("id", "")), title=title, text=text, score=float(score))


class RemoteRetriever:
    """`Retriever` over HTTP. Thread-safe (one pooled httpx client); pickles without its connection pool."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000/retrieve",
        timeout_s: float = 30.0,
        max_wait_s: float = 600.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever url must start with http:// or https://, got {url!r}")
        if timeout_s <= 0 or max_wait_s < 0 or backoff_s < 0 or max_backoff_s < backoff_s:
            raise ValueError(
                "retriever: need timeout_s > 0, max_wait_s >= 0, 0 <= backoff_s <= max_backoff_s; got "
                f"timeout_s={timeout_s}, max_wait_s={max_wait_s}, backoff_s={backoff_s}, max_backoff_s={max_backoff_s}"
            )
        self.url = url
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.retries = 0  # waits so far (all calls, all threads); logged per round as rollout/retriever_retries
        self._lock = threading.Lock()
        self._transport = transport  # tests inject httpx.MockTransport here
        self._client: httpx.Client | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_client": None, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def client(self) -> httpx.Client:
        client = self._client
        if client is None:
            with self._lock:  # the environment's threads search at once: one pool, not one per thread (never closed)
                if self._client is None:
                    self._client = httpx.Client(timeout=self.timeout_s, transport=self._transport)
                client = self._client
        return client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-k passages per query, best first. Raises RetrieverUnavailableError / RetrieverRequestError."""
        if isinstance(queries, str):
            raise TypeError("search() takes a list of queries, not a single string")
        if not queries:
            return []
        body = self._post({"queries": list(queries), "topk": k, "return_scores": True})
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise RetrieverRequestError(
                f"{self.url} answered without a 'result' list of {len(queries)} entries: {str(body)[:200]}"
            )
        return [
            [parse_hit(item, f"{self.url} result[{q}][{j}]") for j, item in enumerate(hits)]
            for q, hits in enumerate(result)
        ]

    def _post(self, payload: dict) -> object:
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                response = self.client.post(self.url, json=payload)
                error = f"HTTP {response.status_code}: {response.text[:200]}" if response.status_code >= 500 else ""
            except httpx.TransportError as err:  # refused, reset, DNS, timeouts
                error = f"{type(err).__name__}: {err}"
            if not error:
                break
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            waited = now - first_failure
            if waited >= self.max_wait_s:
                raise RetrieverUnavailableError(
                    f"retrieval service at {self.url} unavailable for {waited:.0f}s after {attempt + 1} attempts "
                    f"({error}). Start one with `dspo-serve index=DIR port=PORT`, set retriever.url to a running "
                    "server, or raise retriever.max_wait_s."
                )
            sleep = backoff_sleep(attempt, self.backoff_s, self.max_backoff_s, self.max_wait_s - waited)
            attempt += 1
            with self._lock:
                self.retries += 1
            log.warning(
                "retriever %s: %s; retry %d in %.1fs (waiting up to retriever.max_wait_s=%.0fs, %.0fs so far)",
                self.url,
                error,
                attempt,
                sleep,
                self.max_wait_s,
                waited,
            )
            time.sleep(sleep)
        if response.status_code >= 400:
            raise RetrieverRequestError(
                f"{self.url} rejected the request (HTTP {response.status_code}): {response.text[:500]}"
            )
        try:
            return response.json()
        except ValueError:
            raise RetrieverRequestError(f"{self.url} answered non-JSON: {response.text[:200]}") from None
