"""The HTTP side of the endpoint: an OpenAI-compatible server on 127.0.0.1 (uvicorn + starlette, on its own thread)
that answers only requests carrying the run's key.

Each episode's client has its own base URL, `http://127.0.0.1:<port>/e/<episode key>/v1`, so a client an agent builds
from that URL and key (LangGraph, smolagents, its own httpx calls) is still recorded as that episode. Requests are
checked and queued here; tokenization, generation and the answer happen on the rollout's thread
(`dspo.agent.endpoint.scheduler`).
"""

from __future__ import annotations

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


def error_body(status: int, message: str) -> dict:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class EndpointServer:
    """Serves `/e/<key>/v1/chat/completions` and `/v1/models` for the episodes `lookup` knows (episode key -> its
    index in the running rollout, or None). Started on construction; `close()` stops it."""

    def __init__(self, scheduler: Scheduler, lookup: Callable[[str], int | None], api_key: str | None = None) -> None:
        import uvicorn

        self.scheduler, self.lookup = scheduler, lookup
        self.api_key = api_key or secrets.token_urlsafe(24)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((HOST, 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="dspo-endpoint", daemon=True
        )
        self._thread.start()
        self._wait_started()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def base_url(self, episode_key: str) -> str:
        return f"{self.url}/e/{episode_key}/v1"

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
                Route("/e/{episode}/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._no_episode, methods=["POST"]),
                Route("/e/{episode}/v1/chat/completions", self._chat, methods=["POST"]),
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
        message = "this URL names no episode: use the client dspo passes your agent (its base_url ends in /e/<key>/v1)"
        return JSONResponse(error_body(404, message), status_code=404)

    async def _chat(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if not self._authorized(request):
            return JSONResponse(error_body(401, "missing or wrong API key (the run's key)"), status_code=401)
        try:
            episode = self.lookup(request.path_params["episode"])
            if episode is None:
                raise RequestError(404, "no running episode has this key (it ended, or the rollout is over)")
            body = await request.body()
            if len(body) > MAX_BODY_BYTES:
                raise RequestError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
            try:
                payload = json.loads(body)
            except ValueError as error:
                raise RequestError(400, f"the body is not JSON ({error})") from None
            chat = parse_request(payload)
            return JSONResponse(await wait_for_work(self.scheduler, GENERATE, episode, chat))
        except RequestError as error:
            return JSONResponse(error_body(error.status, error.message), status_code=error.status)
