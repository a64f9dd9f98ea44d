"""RemoteRetriever over several replicas (`retriever.url` a list): round robin, failover with a cooldown and re-probe,
the all-down wait of one service, a busy replica's Retry-After, a replica slower than the client's timeout, and a real
outage of one of two `dspo-serve` processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from omegaconf import OmegaConf

from dspo.search.client import RemoteRetriever, RetrieverUnavailableError, replica_urls
from dspo.search.server import create_app

A, B = "http://a.test/retrieve", "http://b.test/retrieve"
HIT = {"document": {"id": "1", "contents": '"T"\nbody'}, "score": 1.0}


class Replicas:
    """A MockTransport for replicas a.test and b.test: `down` holds the hosts that refuse connections; `seen` the host
    of every request, in order."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.seen: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.seen.append(host)
        if host in self.down:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"result": [[{**HIT, "document": {**HIT["document"], "id": host}}]]})


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """A fake monotonic clock that `time.sleep` advances: cooldowns and waits without waiting."""
    now = [1000.0]
    monkeypatch.setattr("dspo.search.client.time.monotonic", lambda: now[0])
    monkeypatch.setattr("dspo.search.client.time.sleep", lambda s: now.__setitem__(0, now[0] + s))
    return now


def _client(replicas: Replicas, **kwargs) -> RemoteRetriever:
    settings = {"max_wait_s": 60.0, "backoff_s": 1.0, "max_backoff_s": 4.0, "cooldown_s": 30.0, **kwargs}
    return RemoteRetriever([A, B], transport=httpx.MockTransport(replicas.handler), **settings)


def test_requests_alternate_and_a_failed_replica_is_skipped_until_its_cooldown_ends(clock, caplog) -> None:
    replicas = Replicas()
    client = _client(replicas)
    answered = [client.search(["q"], 1)[0][0].id for _ in range(4)]
    assert sorted(answered) == ["a.test", "a.test", "b.test", "b.test"] and answered[0] != answered[1]
    replicas.down.add("a.test")
    replicas.seen.clear()
    with caplog.at_level("WARNING", logger="dspo.search.client"):
        answered = [client.search(["q"], 1)[0][0].id for _ in range(6)]
    assert answered == ["b.test"] * 6  # no request lost
    assert replicas.seen.count("a.test") == 1 and client.retries == 1  # one failover, then a.test is skipped
    assert any(A in r.getMessage() and "retriever.cooldown_s=30s" in r.getMessage() for r in caplog.records)
    clock[0] += 31  # cooldown over, still down: the next request to it is the probe, which fails over again
    assert [client.search(["q"], 1)[0][0].id for _ in range(3)] == ["b.test"] * 3
    assert replicas.seen.count("a.test") == 2 and client.retries == 2
    replicas.down.clear()
    clock[0] += 31
    caplog.clear()
    with caplog.at_level("WARNING", logger="dspo.search.client"):
        answered = [client.search(["q"], 1)[0][0].id for _ in range(4)]
    assert sorted(answered) == ["a.test", "a.test", "b.test", "b.test"] and client.retries == 2
    assert any(f"{A} answers again" in r.getMessage() for r in caplog.records)


def test_all_replicas_down_waits_with_backoff_then_names_every_url(clock) -> None:
    replicas = Replicas()
    replicas.down |= {"a.test", "b.test"}
    client = _client(replicas, max_wait_s=10.0)
    start = clock[0]
    with pytest.raises(RetrieverUnavailableError) as info:
        client.search(["q"], 1)
    message = str(info.value)
    assert "all 2 retrieval replicas" in message and A in message and B in message and "ConnectError" in message
    assert "retriever.max_wait_s" in message and "dspo-serve" in message
    assert clock[0] - start >= 10.0
    # every wait is followed by one probe of each replica: (failover + wait) per round, the last failure is final
    rounds = len(replicas.seen) // 2
    assert len(replicas.seen) == 2 * rounds and client.retries == 2 * rounds - 1 and rounds >= 4
    assert all(set(replicas.seen[i : i + 2]) == {"a.test", "b.test"} for i in range(0, len(replicas.seen), 2))


def test_an_outage_of_every_replica_shorter_than_max_wait_s_loses_nothing(clock, monkeypatch) -> None:
    replicas = Replicas()
    replicas.down |= {"a.test", "b.test"}
    client = _client(replicas, cooldown_s=0.0)  # no cooldown: failovers are still bounded by one try per wait
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock[0] += seconds
        if len(sleeps) == 3:
            replicas.down.discard("b.test")

    monkeypatch.setattr("dspo.search.client.time.sleep", sleep)
    assert client.search(["q"], 1)[0][0].id == "b.test"
    # both fail before each of the 3 waits (one failover + one wait), then b.test answers (after a failover from
    # a.test when the rotation starts there): every failed attempt is counted
    assert len(sleeps) == 3 and client.retries == len(replicas.seen) - 1 in (6, 7)
    assert all(set(replicas.seen[i : i + 2]) == {"a.test", "b.test"} for i in range(0, 6, 2))
    assert all(c / 2 <= s <= c for s, c in zip(sleeps, [1.0, 2.0, 4.0], strict=True)), sleeps


def test_replica_urls_take_one_url_or_a_list() -> None:
    assert replica_urls(A) == (A,)
    assert RemoteRetriever(A).url == A and RemoteRetriever([A, B]).url == [A, B]  # as retriever.url was given
    assert replica_urls(OmegaConf.create({"url": [A, B]}).url) == (A, B)  # what Hydra passes
    with pytest.raises(ValueError, match="empty list"):
        replica_urls([])
    with pytest.raises(ValueError, match="twice"):
        replica_urls([A, A])
    with pytest.raises(ValueError, match="http://"):
        RemoteRetriever([A, "b.test:8000/retrieve"])
    with pytest.raises(ValueError, match="cooldown_s=-1"):
        RemoteRetriever(A, cooldown_s=-1)


# ------------------------------------------------------------------------------------------------ real servers
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(index: Path, port: int, log_file: Path) -> subprocess.Popen:
    """`dspo-serve` (logging every request) on loopback; returns once /health answers."""
    code = "from dspo.search.cli import serve_main; serve_main()"
    with open(log_file, "a") as log:
        server = subprocess.Popen(
            [sys.executable, "-c", code, f"index={index}", f"port={port}", "log_level=info"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.poll() is None, f"dspo-serve exited: {log_file.read_text()[-2000:]}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    _kill(server)
    raise AssertionError(f"dspo-serve not healthy after 60 s: {log_file.read_text()[-2000:]}")


def _kill(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)


def _answered(log_file: Path) -> int:
    return log_file.read_text().count('"POST /retrieve HTTP/1.1" 200')


def test_two_dspo_serve_replicas_one_killed_mid_run_and_restarted(tiny_index, tmp_path) -> None:
    index = tmp_path / "index"
    tiny_index.save(index)
    ports, logs = [_free_port(), _free_port()], [tmp_path / "a.log", tmp_path / "b.log"]
    servers = [_serve(index, port, log) for port, log in zip(ports, logs)]
    urls = [f"http://127.0.0.1:{port}/retrieve" for port in ports]
    client = RemoteRetriever(urls, timeout_s=5.0, max_wait_s=30.0, backoff_s=0.05, max_backoff_s=0.5, cooldown_s=1.0)
    try:
        want = tiny_index.search(["capital of France"], 2)
        for _ in range(6):
            assert client.search(["capital of France"], 2) == want
        assert _answered(logs[0]) == _answered(logs[1]) == 3 and client.retries == 0  # round robin
        _kill(servers[0])  # mid-run: every request still answered, by the other replica
        for _ in range(6):
            assert client.search(["capital of France"], 2) == want
        assert _answered(logs[1]) == 9 and 1 <= client.retries <= 2
        servers[0] = _serve(index, ports[0], logs[0])  # back: after its cooldown it gets requests again
        before, deadline = _answered(logs[0]), time.monotonic() + 30
        while _answered(logs[0]) == before:
            assert time.monotonic() < deadline, "the restarted replica got no request within 30 s"
            assert client.search(["capital of France"], 2) == want
            time.sleep(0.1)
        for server in servers:
            _kill(server)
        short = RemoteRetriever(urls, timeout_s=5.0, max_wait_s=1.0, backoff_s=0.05, max_backoff_s=0.2)
        start = time.monotonic()
        with pytest.raises(RetrieverUnavailableError) as info:
            short.search(["capital of France"], 2)
        assert all(url in str(info.value) for url in urls) and time.monotonic() - start < 10
    finally:
        for server in servers:
            _kill(server)


def test_a_busy_replica_is_skipped_for_its_retry_after_not_the_whole_cooldown(clock) -> None:
    """dspo-serve's 503 + Retry-After means busy, not down: back in the rotation after 1 s, not cooldown_s=30."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        seen.append(host)
        if host == "a.test" and seen.count("a.test") == 1:
            return httpx.Response(503, headers={"Retry-After": "1"}, json={"error": "server busy"})
        return httpx.Response(200, json={"result": [[{**HIT, "document": {**HIT["document"], "id": host}}]]})

    client = RemoteRetriever([A, B], transport=httpx.MockTransport(handler), cooldown_s=30.0)
    client._next = 0  # start at a.test
    assert client.search(["q"], 1)[0][0].id == "b.test" and client.retries == 1  # failover at once
    clock[0] += 2
    assert sorted(client.search(["q"], 1)[0][0].id for _ in range(2)) == ["a.test", "b.test"]


class SlowRetriever:
    """Answers only once `release` is set (the test sets it at the end): longer than any client timeout here."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def search(self, queries: list[str], k: int) -> list:
        self.release.wait(timeout=30)
        return [[] for _ in queries]


def test_a_replica_slower_than_timeout_s_counts_as_failed_and_the_other_answers(tiny_index, app_server) -> None:
    """A client-side read timeout is a failed try: the call goes to the other replica at once and succeeds; when
    every replica is that slow, the call fails with RetrieverUnavailableError after max_wait_s (the round's fault)."""
    slow, slower = SlowRetriever(), SlowRetriever()
    try:
        with (
            app_server(create_app(slow)) as slow_url,
            app_server(create_app(tiny_index)) as fast_url,
            app_server(create_app(slower)) as slower_url,
        ):
            urls = [f"{slow_url}/retrieve", f"{fast_url}/retrieve"]
            client = RemoteRetriever(urls, timeout_s=0.5, max_wait_s=30.0, backoff_s=0.05, max_backoff_s=0.1)
            client._next = 0  # the slow one first
            start = time.monotonic()
            assert client.search(["capital of France"], 2) == tiny_index.search(["capital of France"], 2)
            assert client.retries == 1 and 0.5 <= time.monotonic() - start < 5  # one timeout, then the fast one
            both_slow = RemoteRetriever(
                [f"{slow_url}/retrieve", f"{slower_url}/retrieve"],
                timeout_s=0.3, max_wait_s=1.0, backoff_s=0.05, max_backoff_s=0.1,
            )  # fmt: skip
            with pytest.raises(RetrieverUnavailableError, match="ReadTimeout") as info:
                both_slow.search(["capital of France"], 2)
            assert all(url in str(info.value) for url in both_slow.urls) and time.monotonic() - start < 10
            slow.release.set()
            slower.release.set()
    finally:
        slow.release.set()
        slower.release.set()
