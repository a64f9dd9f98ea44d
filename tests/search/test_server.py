"""The retrieval service on loopback: Search-R1's happy path and a 4xx (never 500) for every bad request."""

from __future__ import annotations

import re

import httpx
import pytest

from dspo.search.server import BadRequest, ServerLimits, parse_request, server_config


def test_health(server_url: str) -> None:
    response = httpx.get(f"{server_url}/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "num_passages": 4}


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
