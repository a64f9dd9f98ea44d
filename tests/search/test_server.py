"""The retrieval service on loopback: Search-R1's happy path, a 4xx (never 500) for every bad request, 503 with
Retry-After when too many requests are pending, and /health's report of the index."""

from __future__ import annotations

import os
import re
import threading

import httpx
import pytest

from dspo.search.server import BadRequest, ServerLimits, create_app, parse_request, server_config
from dspo.types import Passage


def test_health(server_url: str, tiny_index) -> None:
    response = httpx.get(f"{server_url}/health")
    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["num_passages"]) == ("ok", 4)  # as before (Search-R1 tools read these)
    assert body["backend"] == "bm25s" and body["index_digest"] == getattr(tiny_index, "digest", None)
    assert body["pending"] == 0 and body["max_pending"] == 64 and body["pid"] == os.getpid()
    assert body["cache"] == (tiny_index.cache_stats() if hasattr(tiny_index, "cache_stats") else None)


class GatedRetriever:
    """A retriever whose search waits until `release` is set; `entered` is set once a search has started. With
    the identity and cache statistics /health reports."""

    backend = "gated"
    digest = "sha256:0123abcd"

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0

    def __len__(self) -> int:
        return 7

    def cache_stats(self) -> dict:
        return {"hits": 3, "misses": self.calls}

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(timeout=30), "the test never released the search"
        return [[Passage("g", "Gate", q, 1.0)] for q in queries]


def test_a_full_server_answers_503_with_retry_after_at_once_then_serves_again(app_server) -> None:
    retriever = GatedRetriever()
    limits = ServerLimits(max_pending=1, retry_after_s=7)
    with app_server(create_app(retriever, limits)) as url:
        first: list[httpx.Response] = []
        slow = threading.Thread(target=lambda: first.append(httpx.post(f"{url}/retrieve", json={"queries": ["a"]})))
        slow.start()
        assert retriever.entered.wait(timeout=10)  # one request is being searched: the server is full
        try:
            busy = httpx.post(f"{url}/retrieve", json={"queries": ["b"]}, timeout=5.0)  # not queued: answered now
            health = httpx.get(f"{url}/health", timeout=5.0).json()  # never refused
        finally:
            retriever.release.set()
            slow.join(timeout=10)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "7"
        assert "limits.max_pending=1" in busy.json()["error"] and retriever.calls == 1
        assert health == {
            "status": "ok",
            "num_passages": 7,
            "index_digest": "sha256:0123abcd",
            "backend": "gated",
            "cache": {"hits": 3, "misses": 1},
            "pending": 1,
            "max_pending": 1,
            "pid": os.getpid(),
        }
        assert first[0].status_code == 200 and first[0].json()["result"][0][0]["document"]["id"] == "g"
        again = httpx.post(f"{url}/retrieve", json={"queries": ["c"]}, timeout=5.0)  # the slot was given back
        assert again.status_code == 200 and httpx.get(f"{url}/health").json()["pending"] == 0


def test_bad_requests_give_their_slot_back(app_server) -> None:
    """A refused request (4xx) leaves the pending count as it found it, or a limit of 1 would lock the server."""
    retriever = GatedRetriever()
    retriever.release.set()
    with app_server(create_app(retriever, ServerLimits(max_pending=1))) as url:
        for _ in range(3):
            assert httpx.post(f"{url}/retrieve", content=b"{").status_code == 400
        assert httpx.post(f"{url}/retrieve", json={"queries": ["x"]}).status_code == 200


@pytest.mark.parametrize(("key", "value"), [("max_pending", 0), ("max_pending", True), ("retry_after_s", -1)])
def test_limits_refuse_bad_back_pressure_settings(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"limits.{key} must be an integer"):
        ServerLimits(**{key: value})


def test_retrieve_with_scores(server_url: str) -> None:
    body = {"queries": ["capital of France", "soft cheese"], "topk": 3, "return_scores": True}
    response = httpx.post(f"{server_url}/retrieve", json=body)
    assert response.status_code == 200
    result = response.json()["result"]
    assert len(result) == 2 and all(len(hits) == 3 for hits in result)
    top = result[0][0]
    assert top["document"] == {"id": "p0", "contents": '"Paris"\nParis is the capital and largest city of France.'}
    assert top["score"] > result[0][1]["score"] > 0
    assert result[1][0]["document"]["id"] == "p2"


def test_retrieve_without_scores_and_default_topk(server_url: str) -> None:
    response = httpx.post(f"{server_url}/retrieve", json={"queries": ["Seine"]})
    hits = response.json()["result"][0]
    assert len(hits) == 2  # default_topk of the test server
    assert hits[0] == {"document": {"id": "p3", "contents": '"Rivers"\nThe Seine flows through Paris.'}}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"not json", 400, "not valid JSON"),
        (b"\xff\xfe", 400, "not valid JSON"),
        (b"[1, 2]", 422, "must be a JSON object"),
        (b"{}", 422, "missing field 'queries'"),
        (b'{"queries": []}', 422, "non-empty list"),
        (b'{"queries": "paris"}', 422, "non-empty list"),
        (b'{"queries": ["ok", 3]}', 422, r"queries\[1\] must be a string"),
        (b'{"queries": ["a", "b", "c", "d", "e"]}', 413, "max_queries=4"),
        (b'{"queries": ["' + b"x" * 51 + b'"]}', 413, "max_query_chars=50"),
        (b'{"queries": ["a"], "topk": 0}', 422, "1..100"),
        (b'{"queries": ["a"], "topk": 101}', 422, "1..100"),
        (b'{"queries": ["a"], "topk": "5"}', 422, "1..100"),
        (b'{"queries": ["a"], "topk": true}', 422, "1..100"),
        (b'{"queries": ["a"], "return_scores": "yes"}', 422, "return_scores"),
    ],
)
def test_bad_requests_get_4xx_with_message(server_url: str, body: bytes, status: int, message: str) -> None:
    response = httpx.post(f"{server_url}/retrieve", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    assert re.search(message, response.json()["error"])


def test_wrong_method_and_path_are_4xx(server_url: str) -> None:
    assert httpx.get(f"{server_url}/retrieve").status_code == 405
    assert httpx.post(f"{server_url}/search", json={}).status_code == 404


def test_server_survives_bad_requests(server_url: str) -> None:
    for _ in range(3):
        httpx.post(f"{server_url}/retrieve", content=b"{")
    assert httpx.post(f"{server_url}/retrieve", json={"queries": ["Berlin"], "topk": 1}).status_code == 200


def test_parse_request_accepts_search_r1_payload() -> None:
    queries, topk, scores = parse_request(b'{"queries": ["q"], "topk": 3, "return_scores": true}', ServerLimits())
    assert (queries, topk, scores) == (["q"], 3, True)
    with pytest.raises(BadRequest) as info:
        parse_request(b'{"queries": [null]}', ServerLimits())
    assert info.value.status == 422


def test_server_keeps_idle_connections_longer_than_clients_do(tiny_index) -> None:
    """Otherwise a busy server closes a pooled connection as a client reuses it (ReadError in the soak)."""
    config = server_config(tiny_index, port=0)
    client_expiry = httpx.Limits().keepalive_expiry
    assert config.timeout_keep_alive == 30 > client_expiry and config.host == "127.0.0.1"
    with pytest.raises(ValueError, match="keep_alive_s"):
        server_config(tiny_index, keep_alive_s=0)
