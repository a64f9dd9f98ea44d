"""Shared fixtures for the search tests: a tiny index and a live dspo server on an ephemeral loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from dspo.search.bm25 import BM25Index
from dspo.search.server import ServerLimits, create_app
from dspo.types import Passage

TINY = [
    Passage("p0", "Paris", "Paris is the capital and largest city of France."),
    Passage("p1", "Berlin", "Berlin is the capital of Germany."),
    Passage("p2", "Cheese", "Brie is a soft cheese from France."),
    Passage("p3", "Rivers", "The Seine flows through Paris."),
]
LIMITS = ServerLimits(max_queries=4, max_query_chars=50, max_topk=100, default_topk=2)


@pytest.fixture(scope="module")
def tiny_index() -> BM25Index:
    return BM25Index.build(TINY, show_progress=False)


@contextlib.contextmanager
def serve_app(app: object) -> Iterator[str]:
    """Serve an ASGI app from a background thread on an ephemeral loopback port (bound first, so it is known and
    free); yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("test server did not start within 10 s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def app_server():
    """`with app_server(app) as url:` serves an ASGI app (serve_app) for the block."""
    return serve_app


@pytest.fixture(scope="module")
def server_url(tiny_index: BM25Index) -> Iterator[str]:
    """Serve `tiny_index` from a background thread."""
    with serve_app(create_app(tiny_index, LIMITS)) as url:
        yield url


@pytest.fixture
def dead_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
