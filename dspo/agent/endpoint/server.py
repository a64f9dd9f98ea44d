"""The HTTP side of the endpoint: an OpenAI-compatible server on 127.0.0.1 (uvicorn + starlette, on its own thread)
that answers only requests carrying the run's key.

Each episode's client has its own base URL, `http://127.0.0.1:<port>/r/<round>/e/<episode key>/v1`, so a client an
agent builds from that URL and key (LangGraph, smolagents, its own httpx calls) is still recorded as that episode. The
round's id is in the URL: a request of a round that is over is refused (410), never answered against the next round's
episode. Requests are checked and queued here; tokenization, generation and the answer happen on the rollout's thread
(`dspo.agent.endpoint.scheduler`).

Limits, since any local user can connect: at most `max_connections` open connections (more are closed as they come),
a connection that has not sent a complete request head within `header_timeout_s` is closed, a body is refused (413)
from its `Content-Length` before it is read and read as a stream with the same cap otherwise, and must arrive within
`body_timeout_s` (408). Idle kept-alive connections close after uvicorn's `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

from dspo.agent.endpoint.episodes import RequestError
from dspo.agent.endpoint.requests import models_body, parse_request
from dspo.agent.endpoint.scheduler import GENERATE, Scheduler, wait_for_work

HOST = "127.0.0.1"
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_CONNECTIONS = 1024  # the agent raises it with the round's episodes (`expect`)
Lookup = Callable[[str, str], int]  # (round id, episode key) -> the episode's index, or RequestError


def error_body(status: int, message: str) -> dict:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class EndpointServer:
    """Serves `/r/<round>/e/<key>/v1/chat/completions` and `/v1/models` for the episodes `lookup` knows ((round id,
    episode key) -> its index in the running rollout; a `RequestError` says why not). Started on construction;
    `close()` stops it."""

    def __init__(
        self,
        scheduler: Scheduler,
        lookup: Lookup,
        api_key: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
    ) -> None:
        import uvicorn

        self.scheduler, self.lookup = scheduler, lookup
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.refused_connections = 0
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((HOST, 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            self._app(), log_level="warning", lifespan="off", access_log=False, http=_guarded_protocol(self)
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="dspo-endpoint", daemon=True
        )
        self._thread.start()
        self._wait_started()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def base_url(self, round_id: str, episode_key: str) -> str:
        return f"{self.url}/r/{round_id}/e/{episode_key}/v1"

    def expect(self, episodes: int) -> None:
        """A round of `episodes` is starting: room for each one's clients (ours, and any the agent builds)."""
        self.max_connections = max(MAX_CONNECTIONS, 8 * episodes)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    def _wait_started(self, timeout_s: float = 30.0) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.url}")
            time.sleep(0.01)

    # ------------------------------------------------------------------------------------------------ routes
    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/r/{round}/e/{episode}/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._no_episode, methods=["POST"]),
                Route("/r/{round}/e/{episode}/v1/chat/completions", self._chat, methods=["POST"]),
            ]
        )

    def _authorized(self, request: Any) -> bool:
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        return hmac.compare_digest(token.encode(), self.api_key.encode())

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if not self._authorized(request):
            return JSONResponse(error_body(401, "missing or wrong API key (the run's key)"), status_code=401)
        return JSONResponse(models_body())

    async def _no_episode(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if not self._authorized(request):
            return JSONResponse(error_body(401, "missing or wrong API key (the run's key)"), status_code=401)
        message = (
            "this URL names no episode: use the client dspo passes your agent (its base_url ends in "
            "/r/<round>/e/<key>/v1)"
        )
        return JSONResponse(error_body(404, message), status_code=404)

    async def _chat(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if not self._authorized(request):
            return JSONResponse(error_body(401, "missing or wrong API key (the run's key)"), status_code=401)
        try:
            round_id = request.path_params["round"]
            episode = self.lookup(round_id, request.path_params["episode"])
            try:
                body = await asyncio.wait_for(_read_body(request), self.body_timeout_s)
            except TimeoutError:
                raise RequestError(408, f"the body did not arrive within {self.body_timeout_s} s") from None
            try:
                payload = json.loads(body)
            except ValueError as error:
                raise RequestError(400, f"the body is not JSON ({str(error)[:200]})") from None
            chat = parse_request(payload)
            return JSONResponse(await wait_for_work(self.scheduler, GENERATE, round_id, episode, chat))
        except RequestError as error:
            return JSONResponse(error_body(error.status, error.message), status_code=error.status)


async def _read_body(request: Any) -> bytes:
    """The body, refused (413) from its declared length before a byte is read, and read as a stream with the same
    cap (a chunked body declares none)."""
    length = request.headers.get("content-length")
    if length is not None and not length.strip().isdigit():
        raise RequestError(400, f"Content-Length={length[:40]!r}: a number of bytes")
    if length is not None and int(length) > MAX_BODY_BYTES:
        raise RequestError(413, f"the body ({int(length)} bytes) is larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _guarded_protocol(server: EndpointServer) -> type:
    """uvicorn's HTTP protocol with the server's connection cap and request-head timeout (uvicorn has neither: a
    connection that never sends a request would stay open, holding one of the trainer's file descriptors)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # uvicorn without its `standard` extra
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class GuardedProtocol(Base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > server.max_connections:
                server.refused_connections += 1
                transport.close()
                return
            self._head_timer = self.loop.call_later(server.header_timeout_s, self._head_timeout)

        def _head_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no request head has arrived
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return GuardedProtocol
