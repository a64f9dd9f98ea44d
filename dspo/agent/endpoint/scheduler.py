"""Batching the requests of many concurrent episodes into one engine call, and their tool calls into one `run` per
tool, as the built-in loop batches a turn.

Episodes run as coroutines on the agent thread; their requests arrive on the server thread; the engine and the tools
run on the thread that called `rollout` (vLLM's in-process engine and torch's thread settings belong to it). The
`Scheduler` is the meeting point: `submit` queues a piece of work and blocks the episode on it; `next_batch`, on the
calling thread, waits until every live episode is blocked (or no request has arrived for `batch_wait_s`: an agent
awaiting something else must not stall the others), then hands over every queued tool call first
(those episodes then ask for their next generation, which joins the batch) or else every queued generation request.

Episodes are numbered within a round, and the round has an id: work submitted for a round that is not the running
one, or for an episode that has finished, is answered at once with a `RequestError` (410) and never queued, so a
request admitted before its round ended, or a cancelled episode's late `finished`, cannot touch the next round's
episode of the same number.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dspo.agent.endpoint.episodes import RequestError

GENERATE, TOOLS = "generate", "tools"


@dataclass
class Work:
    """One queued request: `kind` (generate | tools), the episode, the payload, and how to answer it (called on the
    calling thread; it hands the answer to the episode's event loop)."""

    kind: str
    episode: int
    payload: Any
    answer: Callable[[Any], None]
    order: int = 0  # arrival order (batches are sorted by episode, then arrival, for reproducible seeding)


class Scheduler:
    def __init__(self, batch_wait_s: float = 0.5) -> None:
        if batch_wait_s <= 0:
            raise ValueError(f"batch_wait_s={batch_wait_s}: must be > 0")
        self.batch_wait_s = batch_wait_s
        self._condition = threading.Condition()
        self._running: set[int] = set()
        self._live: set[int] = set()
        self._queue: list[Work] = []
        self._last: float | None = None
        self._arrivals = 0
        self._round: str | None = None

    def start(self, round_id: str, episodes: list[int]) -> None:
        with self._condition:
            self._round = round_id
            self._live, self._running = set(episodes), set(episodes)
            self._queue, self._last = [], None

    def submit(self, kind: str, round_id: str, episode: int, payload: Any, answer: Callable[[Any], None]) -> None:
        """Queue work for `episode` of round `round_id` (which now waits for it); thread-safe. Work of another round,
        or of an episode that has finished, is answered with a `RequestError` instead."""
        with self._condition:
            current = round_id == self._round and episode in self._live
            if current:
                self._arrivals += 1
                self._queue.append(Work(kind, episode, payload, answer, self._arrivals))
                self._running.discard(episode)
                self._last = time.monotonic()
                self._condition.notify_all()
        if not current:
            answer(RequestError(410, f"round {round_id}'s episode {episode} is over: a client kept past its episode"))

    def finished(self, round_id: str, episode: int) -> None:
        with self._condition:
            if round_id != self._round:  # a cancelled episode of an earlier round, finishing late
                return
            self._running.discard(episode)
            self._live.discard(episode)
            self._condition.notify_all()

    def resumed(self, episodes: list[int]) -> None:
        """These episodes got their answers and run again (called before the answers are handed over)."""
        with self._condition:
            self._running.update(e for e in episodes if e in self._live)

    def abort(self, error: BaseException) -> None:
        """The rollout failed: every queued request is answered with `error` (no HTTP handler is left waiting)."""
        with self._condition:
            queued, self._queue, self._live, self._round = self._queue, [], set(), None
        for work in queued:
            work.answer(error)

    def answered(self) -> None:
        """A batch has been answered: its episodes get a full `batch_wait_s` to send their next requests."""
        with self._condition:
            self._last = time.monotonic()

    def next_batch(self, poll_s: float = 1.0, timeout_s: float | None = None) -> list[Work] | None:
        """The next batch of one kind, None once every episode has finished and nothing is queued, or an empty batch
        when none was ready within `timeout_s` (the caller's chance to check its deadlines)."""
        until = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            while True:
                if not self._queue and not self._live:
                    return None
                if until is not None and time.monotonic() >= until:
                    return []
                waited = time.monotonic() - self._last if self._last is not None else 0.0  # since the last arrival
                if self._queue and (not self._running or waited >= self.batch_wait_s):
                    return self._take()
                timeout = poll_s if not self._queue else max(self.batch_wait_s - waited, 1e-3)
                if until is not None:
                    timeout = max(min(timeout, until - time.monotonic()), 1e-3)
                self._condition.wait(timeout=timeout)

    def _take(self) -> list[Work]:
        kind = TOOLS if any(w.kind == TOOLS for w in self._queue) else GENERATE
        batch = sorted((w for w in self._queue if w.kind == kind), key=lambda w: (w.episode, w.order))
        self._queue = [w for w in self._queue if w.kind != kind]
        return batch


def answer_on(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Callable[[Any], None]:
    """A thread-safe `answer` for `Work`: an exception is raised in the waiting coroutine, anything else returned."""

    def settle(value: Any) -> None:
        if future.done():  # the episode was cancelled (timeout) meanwhile
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    def answer(value: Any) -> None:
        loop.call_soon_threadsafe(settle, value)

    return answer


async def wait_for_work(scheduler: Scheduler, kind: str, round_id: str, episode: int, payload: Any) -> Any:
    """Submit work from a coroutine and wait for its answer."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    scheduler.submit(kind, round_id, episode, payload, answer_on(loop, future))
    return await future
