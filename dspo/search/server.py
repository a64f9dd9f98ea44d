"""HTTP retrieval service speaking Search-R1's API, so Search-R1 / FlashRAG agents can use a dspo index unchanged.

    POST /retrieve  {"queries": ["...", ...], "topk": 3, "return_scores": true}
      -> {"result": [[{"document": {"id": "...", "contents": "\\"Title\\"\\ntext"}, "score": 12.3}, ...], ...]}
    GET  /health    -> {"status": "ok", "num_passages": N, "index_digest": ..., "backend": ..., "cache": {...} | null,
                        "pending": n, "max_pending": m, "pid": worker pid}

Departure from Search-R1's server: with `return_scores: false` each hit is still `{"document": {...}}` (just without
`score`) instead of the bare document, so a response has one shape; dspo's client reads both shapes. Requests are
validated by hand (not by a pydantic model) so that every bad request gets a 4xx with a one-line message: 400 for a
body that is not JSON, 422 for a JSON body with wrong fields, 413 for too many or too long queries.
All queries of one request are searched as one batch, in a worker thread so the event loop keeps serving.

Back-pressure: at most `limits.max_pending` /retrieve requests are admitted (being read, waiting for a thread or
searched) per server process; one more gets 503 with `Retry-After: limits.retry_after_s` and `{"error": ...}` at once,
so an overloaded server sheds load (clients back off, or fail over to a replica) instead of queueing without bound
until every queued request times out on its client. /health is never refused: it is how one tells "busy" from "down".
Several processes over one index: dspo/search/workers.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from dspo.search.base import Retriever
from dspo.types import Passage

if TYPE_CHECKING:
    import uvicorn


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for. `default_topk` applies when the request has no `topk` (Search-R1 uses 3).

    `max_pending`: /retrieve requests admitted at once per server process (more get 503). 64: the 50-client soak
    (bench/retrieval.py) never reaches it on one process, anyio's 40 search threads stay busy with a queue behind them,
    and 64 requests of the largest size (512 queries) take ~13 s at the measured 2,454 queries/s, under the client's
    default 30 s timeout_s, so an admitted request is answered before its client gives up on it.
    `retry_after_s`: the `Retry-After` (whole seconds) of such a 503."""

    max_queries: int = 512
    max_query_chars: int = 4096
    max_topk: int = 100
    default_topk: int = 3
    max_pending: int = 64
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for key, low in (("max_pending", 1), ("retry_after_s", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"limits.{key} must be an integer >= {low}, got {value!r}; set limits.{key}=...")


class BadRequest(Exception):
    """A request the server refuses, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_request(raw: bytes, limits: ServerLimits) -> tuple[list[str], int, bool]:
    """Validate a /retrieve body; returns (queries, topk, return_scores) or raises BadRequest."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(400, f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest(422, f"request body must be a JSON object, got {type(body).__name__}")
    queries = body.get("queries")
    if queries is None:
        raise BadRequest(422, "missing field 'queries' (a non-empty list of strings)")
    if not isinstance(queries, list) or not queries:
        raise BadRequest(422, "'queries' must be a non-empty list of strings")
    if len(queries) > limits.max_queries:
        raise BadRequest(413, f"too many queries: {len(queries)} > max_queries={limits.max_queries}; split the batch")
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise BadRequest(422, f"queries[{i}] must be a string, got {type(query).__name__}")
        if len(query) > limits.max_query_chars:
            raise BadRequest(
                413, f"queries[{i}] has {len(query)} characters > max_query_chars={limits.max_query_chars}"
            )
    topk = body.get("topk")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        raise BadRequest(422, f"'topk' must be an integer in 1..{limits.max_topk}, got {topk!r}")
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(422, f"'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


def format_hits(hits: list[Passage], return_scores: bool) -> list[dict]:
    """One query's hits in Search-R1's document form."""
    out = []
    for p in hits:
        item: dict = {"document": {"id": p.id, "contents": p.contents}}
        if return_scores:
            item["score"] = p.score
        out.append(item)
    return out


def create_app(retriever: Retriever, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app serving `retriever`."""
    limits = limits or ServerLimits()
    app = FastAPI(title="dspo retrieval", docs_url=None, redoc_url=None)
    num_passages = len(retriever) if hasattr(retriever, "__len__") else None
    # fixed for the index's life: read once (in the parent, before workers fork, when there are several)
    digest, backend = getattr(retriever, "digest", None), getattr(retriever, "backend", None)
    cache_stats = getattr(retriever, "cache_stats", None)
    # Admitted /retrieve requests of this process. Only the event loop's thread touches it (the handlers are
    # coroutines; the search itself runs in a thread but does not count), so a plain int needs no lock.
    pending = 0
    busy_headers = {"Retry-After": str(limits.retry_after_s)}

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"error": exc.message})

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "num_passages": num_passages,
            "index_digest": digest,
            "backend": backend,
            "cache": cache_stats() if callable(cache_stats) else None,
            "pending": pending,
            "max_pending": limits.max_pending,
            "pid": os.getpid(),  # which worker answered (dspo-serve workers=N)
        }

    @app.post("/retrieve", response_model=None)
    async def retrieve(request: Request) -> dict | JSONResponse:
        nonlocal pending
        if pending >= limits.max_pending:  # refuse before reading the body: shedding load must cost little
            message = (
                f"server busy: {pending} requests pending (limits.max_pending={limits.max_pending} per worker); "
                f"retry after {limits.retry_after_s}s, or serve with more workers= or replicas"
            )
            return JSONResponse(status_code=503, content={"error": message}, headers=busy_headers)
        pending += 1
        try:
            queries, topk, return_scores = parse_request(await request.body(), limits)
            results = await run_in_threadpool(retriever.search, queries, topk)
            return {"result": [format_hits(hits, return_scores) for hits in results]}
        finally:
            pending -= 1

    return app


def server_config(
    retriever: Retriever,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: ServerLimits | None = None,
    log_level: str = "info",
    keep_alive_s: int = 30,
) -> uvicorn.Config:
    """The uvicorn config of the service. `keep_alive_s` must exceed the clients' idle-connection expiry (httpx: 5 s):
    with uvicorn's default of 5 s too, a busy server closes a pooled connection just as a client reuses it, and that
    client gets a ReadError (23 of 10,547 requests in a 5-minute soak under load)."""
    import uvicorn

    if keep_alive_s < 1:
        raise ValueError(f"keep_alive_s must be >= 1 second, got {keep_alive_s}")
    app = create_app(retriever, limits)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=keep_alive_s)


def serve(retriever: Retriever, workers: int = 1, **config: Any) -> None:
    """Run the service in the foreground until interrupted (Ctrl-C or SIGTERM); `config`: `server_config`'s keywords.
    `workers` > 1: that many processes on one socket, supervised by this one (dspo/search/workers.py)."""
    import uvicorn

    from dspo.search.workers import check_workers, serve_workers

    check_workers(workers)
    uvicorn_config = server_config(retriever, **config)
    if workers == 1:  # one process, uvicorn binding the port itself, as before workers existed
        uvicorn.Server(uvicorn_config).run()
    else:
        serve_workers(uvicorn_config, workers)
