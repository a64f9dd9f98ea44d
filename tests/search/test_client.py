"""RemoteRetriever: same answers as the in-process index, Search-R1 response shapes, retries, clear errors."""

from __future__ import annotations

import pickle
import time

import httpx
import pytest

from dspo.search.bm25 import BM25Index
from dspo.search.client import RemoteRetriever, RetrieverRequestError, RetrieverUnavailableError, parse_hit


def test_client_matches_in_process_index(server_url: str, tiny_index: BM25Index) -> None:
    client = RemoteRetriever(f"{server_url}/retrieve")
    queries = ["capital of France", "soft cheese", "Seine"]
    assert client.search(queries, 3) == tiny_index.search(queries, 3)
    assert client.search([], 3) == []
    restored = pickle.loads(pickle.dumps(client))  # e.g. sent to a worker process
    assert restored.search(["Berlin"], 1)[0][0].id == "p1"
    assert restored.retries == 0 and restored._lock is not client._lock  # the lock is rebuilt, not shared


def test_client_reports_4xx_without_retrying(server_url: str) -> None:
    client = RemoteRetriever(f"{server_url}/retrieve", max_wait_s=60.0, backoff_s=10.0, max_backoff_s=10.0)
    start = time.monotonic()
    with pytest.raises(RetrieverRequestError, match=r"HTTP 422.*1\.\.100"):
        client.search(["paris"], 500)
    assert time.monotonic() - start < 5  # no backoff sleeps


def test_client_waits_max_wait_s_then_names_the_url_when_server_is_down(dead_port: int, caplog) -> None:
    url = f"http://127.0.0.1:{dead_port}/retrieve"
    client = RemoteRetriever(url, timeout_s=2.0, max_wait_s=0.3, backoff_s=0.05, max_backoff_s=0.1)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="dspo.search.client"), pytest.raises(RetrieverUnavailableError) as info:
        client.search(["paris"], 3)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert url in message and "retriever.max_wait_s" in message and "dspo-serve" in message
    # jittered sleeps in [0.025, 0.05], [0.05, 0.1], [0.05, 0.1], ... until the 0.3 s window is used up: 4 waits if
    # every draw is the longest, 12 at most; each logged with the URL
    assert 0.3 <= elapsed < 5 and 4 <= client.retries <= 12
    waits = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert len(waits) == client.retries and all(url in w and "max_wait_s=0s" in w for w in waits)
    assert "retry 1 in 0.1s" in waits[0] or "retry 1 in 0.0s" in waits[0]
    once = RemoteRetriever(url, timeout_s=2.0, max_wait_s=0.0)  # no window: the first failure is final
    with pytest.raises(RetrieverUnavailableError, match="after 1 attempts"):
        once.search(["paris"], 3)
    assert once.retries == 0


def test_client_outlives_an_outage_shorter_than_max_wait_s(monkeypatch) -> None:
    """The service is down (refused, then 503 while loading) for longer than the old 3-retry budget, then answers."""
    answers = [httpx.ConnectError("refused")] * 4 + [httpx.Response(503, text="loading")] * 3
    hit = {"document": {"id": "1", "contents": '"T"\nbody'}, "score": 1.0}

    def handler(request: httpx.Request) -> httpx.Response:
        if answers:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer
        return httpx.Response(200, json={"result": [[hit]]})

    slept: list[float] = []
    monkeypatch.setattr("dspo.search.client.time.sleep", slept.append)
    transport = httpx.MockTransport(handler)
    client = RemoteRetriever(
        "http://search.test/retrieve", max_wait_s=60.0, backoff_s=1.0, max_backoff_s=8.0, transport=transport
    )
    assert client.search(["q"], 1)[0][0].id == "1"
    ceilings = [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]  # doubling from backoff_s, capped at max_backoff_s
    assert len(slept) == 7 and client.retries == 7
    assert all(c / 2 <= s <= c for s, c in zip(slept, ceilings, strict=True)), slept  # "equal jitter"


def _sleeps_through_an_outage(monkeypatch, failures: int) -> list[float]:
    """The sleeps of one client that sees `failures` read timeouts, then an answer."""
    answers = [httpx.ReadTimeout("slow")] * failures
    hit = {"document": {"id": "1", "contents": '"T"\nbody'}, "score": 1.0}

    def handler(request: httpx.Request) -> httpx.Response:
        if answers:
            raise answers.pop(0)
        return httpx.Response(200, json={"result": [[hit]]})

    slept: list[float] = []
    monkeypatch.setattr("dspo.search.client.time.sleep", slept.append)
    client = RemoteRetriever(
        "http://search.test/retrieve", max_wait_s=600.0, backoff_s=1.0, max_backoff_s=8.0,
        transport=httpx.MockTransport(handler),
    )  # fmt: skip
    client.search(["q"], 1)
    return slept


def test_ranks_that_time_out_together_do_not_retry_together(monkeypatch) -> None:
    """Every rank sends its heavy batch when the round starts; after a read timeout they must not all come back at
    the same moment. Each rank seeds Python's `random` alike (seed_everything), so the jitter cannot come from it."""
    import random

    random.seed(0)
    rank0 = _sleeps_through_an_outage(monkeypatch, 5)
    random.seed(0)
    rank1 = _sleeps_through_an_outage(monkeypatch, 5)
    ceilings = [1.0, 2.0, 4.0, 8.0, 8.0]
    for slept in (rank0, rank1):
        assert len(slept) == 5 and all(c / 2 <= s <= c for s, c in zip(slept, ceilings, strict=True)), slept
    assert rank0 != rank1


def test_jittered_sleep_never_outlasts_the_remaining_window(monkeypatch) -> None:
    from dspo.search import client as module

    assert module.backoff_sleep(0, 1.0, 8.0, 100.0, uniform=lambda low, high: high) == 1.0
    assert module.backoff_sleep(5, 1.0, 8.0, 100.0, uniform=lambda low, high: low) == 4.0  # half of the 8 s cap
    assert module.backoff_sleep(5, 1.0, 8.0, 0.25, uniform=lambda low, high: high) == 0.25  # what is left of max_wait_s
    assert module.backoff_sleep(0, 0.0, 0.0, 10.0) == 0.0


def test_threads_that_search_at_once_share_one_http_client(monkeypatch) -> None:
    """The environment's worker threads call search() together at the first round: one connection pool, not one per
    thread (the extra ones would never be closed)."""
    import threading

    made: list[object] = []
    real = httpx.Client

    def slow_client(*args, **kwargs):
        time.sleep(0.05)  # widen the window between the check and the assignment
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr("dspo.search.client.httpx.Client", slow_client)
    retriever = RemoteRetriever("http://search.test/retrieve")
    start = threading.Barrier(8)
    seen: list[object] = []

    def worker() -> None:
        start.wait()
        seen.append(retriever.client)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and all(client is made[0] for client in seen) and len(seen) == 8
    retriever.close()
    assert retriever._client is None


def test_client_retries_5xx_until_success() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) < 3:
            return httpx.Response(503, text="warming up")
        hit = {"document": {"id": "7", "contents": '"T"\nbody'}, "score": 2.5}
        return httpx.Response(200, json={"result": [[hit]]})

    transport = httpx.MockTransport(handler)
    client = RemoteRetriever("http://search.test/retrieve", backoff_s=0.0, max_backoff_s=0.0, transport=transport)
    hits = client.search(["q"], 1)
    assert (
        len(calls) == 3
        and client.retries == 2
        and hits[0][0].id == "7"
        and hits[0][0].title == "T"
        and hits[0][0].score == 2.5
    )
    assert calls[0].read() == b'{"queries":["q"],"topk":1,"return_scores":true}'


def test_client_rejects_malformed_answers() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"result": []})

    client = RemoteRetriever("http://search.test/retrieve", transport=httpx.MockTransport(handler))
    with pytest.raises(RetrieverRequestError, match="'result' list of 1 entries"):
        client.search(["q"], 1)


def test_parse_hit_reads_search_r1_shapes() -> None:
    bare = parse_hit({"id": "3", "contents": '"Title"\nText'}, "r[0][0]")  # Search-R1 without return_scores
    assert (bare.id, bare.title, bare.text, bare.score) == ("3", "Title", "Text", 0.0)
    titled = parse_hit({"document": {"id": 4, "title": "A", "text": "B"}, "score": 1}, "r[0][1]")
    assert (titled.id, titled.title, titled.text, titled.score) == ("4", "A", "B", 1.0)
    with pytest.raises(RetrieverRequestError, match=r"r\[0\]\[2\]: document has neither"):
        parse_hit({"document": {"id": "x"}}, "r[0][2]")


def test_client_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="http://"):
        RemoteRetriever("127.0.0.1:8000/retrieve")
    with pytest.raises(ValueError, match="timeout_s > 0"):
        RemoteRetriever(timeout_s=0)
    with pytest.raises(ValueError, match="max_wait_s=-1"):
        RemoteRetriever(max_wait_s=-1)
    with pytest.raises(ValueError, match="backoff_s <= max_backoff_s"):
        RemoteRetriever(backoff_s=5.0, max_backoff_s=1.0)


def _busy_then_ok(busy: int, retry_after: str) -> httpx.MockTransport:
    """`busy` answers 503 with `Retry-After: retry_after` (dspo-serve's back-pressure), then hits."""
    answers = [httpx.Response(503, headers={"Retry-After": retry_after}, json={"error": "server busy"})] * busy
    hit = {"document": {"id": "1", "contents": '"T"\nbody'}, "score": 1.0}
    return httpx.MockTransport(
        lambda request: answers.pop(0) if answers else httpx.Response(200, json={"result": [[hit]]})
    )


@pytest.mark.parametrize(("max_backoff_s", "expected"), [(10.0, 3.0), (2.0, 2.0)])
def test_a_busy_server_is_retried_no_sooner_than_its_retry_after(monkeypatch, max_backoff_s, expected) -> None:
    """503 + Retry-After: 3 is a lower bound of the wait (backoff alone would wait 0.05-0.2 s), capped by
    max_backoff_s."""
    slept: list[float] = []
    monkeypatch.setattr("dspo.search.client.time.sleep", slept.append)
    client = RemoteRetriever(
        "http://search.test/retrieve", backoff_s=0.1, max_backoff_s=max_backoff_s, transport=_busy_then_ok(2, "3")
    )
    assert client.search(["q"], 1)[0][0].id == "1"
    assert slept == [expected, expected] and client.retries == 2


def test_retry_after_reads_seconds_and_http_dates() -> None:
    from email.utils import formatdate

    from dspo.search.client import retry_after_s

    def busy(value: str, status: int = 503) -> httpx.Response:
        return httpx.Response(status, headers={"Retry-After": value})

    assert retry_after_s(busy("2")) == 2.0 and retry_after_s(busy("-4")) == 0.0
    assert 8.0 <= retry_after_s(busy(formatdate(time.time() + 10, usegmt=True))) <= 10.0
    assert retry_after_s(busy("soon")) is None and retry_after_s(busy("2", status=500)) is None
    assert retry_after_s(httpx.Response(503)) is None and retry_after_s(None) is None
