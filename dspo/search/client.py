"""Client for a retrieval service speaking Search-R1's `POST /retrieve` (dspo-serve or Search-R1's own server).

Connection failures, timeouts and 5xx answers are retried with exponential backoff (`backoff_s`, 2·backoff_s, ...,
at most `max_backoff_s` apart; each wait drawn between half and all of that, so that ranks that timed out together
on a slow server do not all resend their batch at the same moment) until `max_wait_s` has passed since the first
failure, so a training run outlives a restart of the service (a 21M-passage index takes minutes to load). Each wait
is logged as a warning naming the URL and counted in `retries`. A 4xx is the caller's fault and fails at once with
the server's message. When the service stays unreachable for the whole window, `RetrieverUnavailableError` names
the URL and how to start a server. A 503 with `Retry-After` (dspo-serve's back-pressure: too many requests pending)
is honoured: the wait is at least that long (capped at `max_backoff_s`), and a replica that sent it is skipped for
that long rather than `cooldown_s` (it is busy, not down).

Replicas (`url` a list, e.g. one `dspo-serve` per node): requests go round robin over the replicas, from a random
starting one per client so that ranks do not all start on the first. A replica that fails is skipped for `cooldown_s`
and the request goes at once to the next one (counted in `retries`, with a warning); after the cooldown the replica
gets requests again, the next one being its probe (a real request: Search-R1's server has no /health). Only when
every replica has failed does the client wait as above, then try each of them again; `max_wait_s` then bounds the
outage of all of them, and `RetrieverUnavailableError` names every URL with its last error.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from email.utils import parsedate_to_datetime

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


def retry_after_s(response: httpx.Response | None) -> float | None:
    """The `Retry-After` of a 503 in seconds (delta-seconds or an HTTP date), None without one or when unreadable."""
    value = response.headers.get("retry-after") if response is not None and response.status_code == 503 else None
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError, OverflowError):
        return None


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


def replica_urls(url: str | Sequence[str]) -> tuple[str, ...]:
    """`retriever.url` as a tuple of replica URLs: one URL, or a list of them (a Hydra ListConfig too)."""
    urls = (url,) if isinstance(url, str) else tuple(url)
    if not urls:
        raise ValueError("retriever.url is an empty list; give one URL or a list of replicas' URLs")
    for one in urls:
        if not isinstance(one, str) or not one.startswith(("http://", "https://")):
            raise ValueError(f"retriever.url: each URL must start with http:// or https://, got {one!r}")
    if len(set(urls)) != len(urls):
        raise ValueError(f"retriever.url lists a replica twice: {list(urls)}")
    return urls


class RemoteRetriever:
    """`Retriever` over HTTP, against one service or several replicas. Thread-safe (one pooled httpx client, one
    replica state); pickles without its connection pool."""

    def __init__(
        self,
        url: str | Sequence[str] = "http://127.0.0.1:8000/retrieve",
        timeout_s: float = 30.0,
        max_wait_s: float = 600.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        cooldown_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        urls = replica_urls(url)
        if timeout_s <= 0 or max_wait_s < 0 or backoff_s < 0 or max_backoff_s < backoff_s or cooldown_s < 0:
            raise ValueError(
                "retriever: need timeout_s > 0, max_wait_s >= 0, 0 <= backoff_s <= max_backoff_s, cooldown_s >= 0; got "
                f"timeout_s={timeout_s}, max_wait_s={max_wait_s}, backoff_s={backoff_s}, "
                f"max_backoff_s={max_backoff_s}, cooldown_s={cooldown_s}"
            )
        self.urls = urls
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.cooldown_s = cooldown_s
        self.retries = 0  # waits and failovers so far (all calls, all threads); logged as rollout/retriever_retries
        self._next = _JITTER.randrange(len(urls))  # round-robin position; random start spreads the ranks
        self._down_until: dict[str, float] = {}  # replica -> monotonic time its cooldown ends
        self._lock = threading.Lock()
        self._transport = transport  # tests inject httpx.MockTransport here
        self._client: httpx.Client | None = None

    @property
    def url(self) -> str | list[str]:
        """`retriever.url` as given: the service's URL, or the list of replicas' URLs."""
        return self.urls[0] if len(self.urls) == 1 else list(self.urls)

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
        url, body = self._post({"queries": list(queries), "topk": k, "return_scores": True})
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise RetrieverRequestError(
                f"{url} answered without a 'result' list of {len(queries)} entries: {str(body)[:200]}"
            )
        return [
            [parse_hit(item, f"{url} result[{q}][{j}]") for j, item in enumerate(hits)] for q, hits in enumerate(result)
        ]

    def _post(self, payload: dict) -> tuple[str, object]:
        """(replica that answered, its JSON), failing over between replicas and waiting when all of them fail."""
        first_failure: float | None = None
        attempts = waits = 0
        errors: dict[str, str] = {}
        tried: set[str] = set()  # replicas that failed since the last wait: each gets one try per wait
        while True:
            url = self._pick(tried)
            response, error = self._send(url, payload)
            attempts += 1
            if not error:
                self._mark_up(url)
                break
            errors[url] = error
            tried.add(url)
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            waited = now - first_failure
            busy_s = retry_after_s(response)  # the server's own word on when to come back
            if self._mark_down(url, now, tried, busy_s):  # another replica is up: send it there now
                self._count_retry()
                log.warning(
                    "retriever %s: %s; sending to the next of %d replicas (this one is skipped for "
                    "retriever.cooldown_s=%.0fs)",
                    url,
                    error,
                    len(self.urls),
                    self.cooldown_s,
                )
                continue
            if waited >= self.max_wait_s:
                raise RetrieverUnavailableError(self._unavailable(errors, waited, attempts))
            sleep = backoff_sleep(waits, self.backoff_s, self.max_backoff_s, self.max_wait_s - waited)
            if busy_s is not None:  # no sooner than Retry-After, within max_backoff_s and the max_wait_s window
                sleep = max(sleep, min(busy_s, self.max_backoff_s, self.max_wait_s - waited))
            waits += 1
            self._count_retry()
            log.warning(
                "retriever %s: %s; retry %d in %.1fs (waiting up to retriever.max_wait_s=%.0fs, %.0fs so far)",
                url,
                error,
                waits,
                sleep,
                self.max_wait_s,
                waited,
            )
            time.sleep(sleep)
            tried.clear()
            with self._lock:  # after the wait every replica gets a probe, not only the first to cool down
                self._down_until = dict.fromkeys(self._down_until, 0.0)
        if response.status_code >= 400:
            raise RetrieverRequestError(
                f"{url} rejected the request (HTTP {response.status_code}): {response.text[:500]}"
            )
        try:
            return url, response.json()
        except ValueError:
            raise RetrieverRequestError(f"{url} answered non-JSON: {response.text[:200]}") from None

    def _send(self, url: str, payload: dict) -> tuple[httpx.Response | None, str]:
        """One POST; the error text when it failed in a way worth retrying (connection, timeout, 5xx), else ""."""
        try:
            response = self.client.post(url, json=payload)
        except httpx.TransportError as err:  # refused, reset, DNS, timeouts
            return None, f"{type(err).__name__}: {err}"
        if response.status_code >= 500:
            return response, f"HTTP {response.status_code}: {response.text[:200]}"
        return response, ""

    def _pick(self, tried: set[str]) -> str:
        """The next replica in round-robin order that is neither cooling down nor `tried` (failed in this call since its
        last wait); if there is none, the one that cools off first (its request is the probe)."""
        with self._lock:
            now, n = time.monotonic(), len(self.urls)
            order = [self.urls[(self._next + i) % n] for i in range(n)]
            url = next((u for u in order if u not in tried and self._down_until.get(u, 0.0) <= now), None)
            url = url or min(order, key=lambda u: self._down_until.get(u, 0.0))
            self._next = (self.urls.index(url) + 1) % n
            return url

    def _mark_down(self, url: str, now: float, tried: set[str], busy_s: float | None = None) -> bool:
        """Start `url`'s cooldown (`cooldown_s`, or the shorter Retry-After `busy_s` of a busy replica); True when a
        replica not yet `tried` is not cooling down (somewhere to fail over)."""
        with self._lock:
            self._down_until[url] = now + (self.cooldown_s if busy_s is None else min(busy_s, self.cooldown_s))
            return any(u not in tried and self._down_until.get(u, 0.0) <= now for u in self.urls)

    def _mark_up(self, url: str) -> None:
        with self._lock:
            was_down = self._down_until.pop(url, None) is not None
        if was_down and len(self.urls) > 1:
            log.warning("retriever %s answers again; it is back in the rotation", url)

    def _count_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def _unavailable(self, errors: dict[str, str], waited: float, attempts: int) -> str:
        if len(self.urls) == 1:
            what, start, to = f"retrieval service at {self.urls[0]}", "one", "a running server"
        else:
            what, start, to = f"all {len(self.urls)} retrieval replicas", "them", "running servers"
        last = "; ".join(f"{u}: {errors.get(u, 'cooling down after an earlier failure')}" for u in self.urls)
        return (
            f"{what} unavailable for {waited:.0f}s after {attempts} attempts ({last}). Start {start} with "
            f"`dspo-serve index=DIR port=PORT`, set retriever.url to {to}, or raise retriever.max_wait_s."
        )
