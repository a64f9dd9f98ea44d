"""`EndpointAgent`: trains an agent written against the OpenAI chat API (`env.agent`), unchanged, by serving the
policy behind an OpenAI-compatible endpoint and recording every call by token ids.

The user's agent is `async def agent(client, item, tools) -> str | None`: `client` an `openai.AsyncOpenAI` on this
episode's URL (model `policy`), `item` the `QAItem`, `tools` the environment's tools as async callables (`await
tools["search"](query_list=[...])` returns the tool's text; `tools["search"].schema` is its OpenAI schema). It returns
the final answer, which the environment's reward scores (`EpisodeRecord.answer`) as the built-in agent's extracted
answer. G episodes per question, the filter, the advantages and every objective are unchanged.

Like the built-in loop, and on purpose: generation stops after a tool call's `</tool_call>` and after `</answer>`
(both kept in the text), a tool's text is cut to `max_obs_tokens`, and the budgets are `rollout.agent`'s: a request
past `max_turns` calls or `max_total_tokens` is refused (400) and the episode ends as truncated, scored on what the
agent returns. An episode whose agent raises, times out or returns something other than a string or None is a
*masked stub* (reward 0, no trained token), counted as `rollout/agent_errors`; above `env.max_agent_error_share` of a
batch the round fails naming the agent.

Deadlines that hold: the agent's coroutines run on their own thread and event loop, which beats a heartbeat. Code that
blocks that loop (`time.sleep`, a sync HTTP client in an async function) stops the heartbeat and defeats
`asyncio.wait_for`; the rollout's thread watches it, and after `stall_timeout_s` without a beat (or past
`rollout_timeout_s` in all) it ends every unfinished episode as a timed-out stub, logs the agent and the stack where
it blocked, and leaves that loop behind for a fresh one (a thread cannot be killed; the round's id keeps whatever it
does later from touching the next round).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
import threading
import time
import traceback
from typing import Any

from dspo.agent.accounting import CALL_STAT_KINDS, check_tool_errors, grouped, rollout_stats
from dspo.agent.config import AgentConfig
from dspo.agent.endpoint.episodes import Episode, RequestError
from dspo.agent.endpoint.formats import FORMATS
from dspo.agent.endpoint.generation import Generator
from dspo.agent.endpoint.scheduler import GENERATE, TOOLS, Scheduler, wait_for_work
from dspo.agent.endpoint.server import EndpointServer
from dspo.agent.endpoint.tools import EpisodeTools, run_tool_work
from dspo.agent.endpoint.trajectories import episode_trajectory
from dspo.agent.protocol import AgentRollout
from dspo.agent.stats import Kind
from dspo.env.prompting import build_messages
from dspo.env.rewards import EpisodeRecord
from dspo.types import QAItem

log = logging.getLogger(__name__)
BEAT_S = 0.1  # the agent loop's heartbeat
WATCH_S = 0.25  # how often the rollout's thread checks it, and the deadline, while no batch is ready


class AgentFailureError(RuntimeError):
    """The user's agent failed on more than `env.max_agent_error_share` of a batch's episodes."""


class EndpointAgent:
    """Rolls out `env.agent` (an async function, module docstring) `group_size` times per item, all at once.

    Args:
        engine, tokenizer, env: as for every agent (`dspo.agent.build.build_agent`); `env.agent` is the function.
        config: the episode's budgets and sampling (`rollout.agent`'s settings), or give them as keywords.
        batch_wait_s: how long a queued request waits for episodes still running user code before its batch goes.
        episode_timeout_s: an episode running longer is an agent error.
        stall_timeout_s: the agent's event loop blocked this long ends the round's unfinished episodes as timed out.
        rollout_timeout_s: the whole rollout's deadline (default: `episode_timeout_s` + 60 s); the same then.
    """

    # its rollout statistics' kinds (dspo.agent.stats): rollout_stats' and the endpoint's own counts
    stat_kinds = {
        **CALL_STAT_KINDS,
        "prefix_breaks": Kind.SUM,
        "agent_errors": Kind.SUM,
        "samples_per_episode": Kind.MEAN,
        "overridden_sampling": Kind.SUM,
    }

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        env: Any,
        config: AgentConfig | None = None,
        batch_wait_s: float = 0.5,
        episode_timeout_s: float = 600.0,
        stall_timeout_s: float = 60.0,
        rollout_timeout_s: float | None = None,
        **limits: Any,
    ) -> None:
        config = config if config is not None else AgentConfig.from_settings(limits)
        function = getattr(env, "agent", None)
        if not callable(function):
            raise ValueError("EndpointAgent: env.agent must name the agent function (module.function)")
        if config.tag_format not in FORMATS:
            raise ValueError(f"rollout.agent.tag_format={config.tag_format!r}: expected one of {sorted(FORMATS)}")
        if config.overflow != "end":
            raise ValueError(
                f"rollout.agent.overflow={config.overflow} with env.agent: the agent keeps its own context (a call "
                "that rewrites its history is trained as a sample of its own, docs/agents.md); set "
                "rollout.agent.overflow=end"
            )
        if env.credit != "trajectory":
            raise ValueError(
                "env.reward.credit=turn with env.agent: an agent's calls may rewrite its history, and per-turn credit "
                "needs one token sequence per episode; use env.reward.credit=trajectory"
            )
        rollout_timeout_s = episode_timeout_s + 60.0 if rollout_timeout_s is None else rollout_timeout_s
        for key, value in [
            ("episode_timeout_s", episode_timeout_s),
            ("stall_timeout_s", stall_timeout_s),
            ("rollout_timeout_s", rollout_timeout_s),
        ]:
            if value <= 0:
                raise ValueError(f"rollout.agent.{key}={value}: must be > 0 (seconds)")
        self.engine, self.env, self.config, self.function = engine, env, config, function
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.tools = env.tools
        self.format = FORMATS[config.tag_format](self.tokenizer, self.tools)
        self.episode_timeout_s, self.stall_timeout_s = episode_timeout_s, stall_timeout_s
        self.rollout_timeout_s = rollout_timeout_s
        self.scheduler = Scheduler(batch_wait_s)
        for name in ("httpx", "httpx2"):  # the HTTP clients of openai and of the agent frameworks: a line per request
            logging.getLogger(name).setLevel(logging.WARNING)
        self._episodes: dict[str, Episode] = {}
        self._round: str | None = None
        self._lock = threading.Lock()  # an episode's end: set once, by its coroutine or by the watchdog
        self._warned: set[str] = set()  # sampling parameters already warned about (once per run)
        self._server: EndpointServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()
        self._http: list[Any] = []  # HTTP clients of the agent loop, one per episode slot
        self.name = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', function)}"

    # ----------------------------------------------------------------------------------------- lifetime
    @property
    def server(self) -> EndpointServer:
        """The endpoint (started on first use; `close()` stops it)."""
        if self._server is None:
            self._server = EndpointServer(self.scheduler, self._lookup)
        return self._server

    def _agent_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = loop = _new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="dspo-agents", daemon=True)
            self._thread.start()

            def beat() -> None:
                if self._loop is loop:  # a loop left behind beats no more
                    self._beat = time.monotonic()
                    loop.call_later(BEAT_S, beat)

            loop.call_soon_threadsafe(beat)
        return self._loop

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._loop is not None:
            if self._http:
                asyncio.run_coroutine_threadsafe(_close_all(self._http), self._loop).result(timeout=30)
                self._http = []
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    def _lookup(self, round_id: str, key: str) -> int:
        if round_id != self._round:
            raise RequestError(410, f"round {round_id} is over: this client was kept from an earlier round's episode")
        episode = self._episodes.get(key)
        if episode is None:
            raise RequestError(404, "no episode of this round has this key: use the client dspo passes your agent")
        if episode.done:
            raise RequestError(410, "this episode has ended: its client takes no more requests")
        return episode.index

    def _warn_override(self, name: str, sent: Any, used: Any) -> None:
        if name in self._warned:
            return
        self._warned.add(name)
        log.warning(
            "the agent %s sent %s=%r; the endpoint samples with %s=%s (the behaviour policy is the trainer's: "
            "rollout.agent's settings, greedy when evaluating). Counted as rollout/overridden_sampling; warned once.",
            self.name,
            name,
            sent,
            name,
            used,
        )

    # ------------------------------------------------------------------------------------------ rollout
    def rollout(
        self,
        items: list[QAItem],
        group_size: int,
        policy_version: int,
        greedy: bool = False,
        seed: int | None = None,
    ) -> AgentRollout:
        start = time.perf_counter()
        reset = getattr(self.engine, "reset_episodes", None)
        if reset is not None:
            reset()
        episodes = [
            Episode(index=i * group_size + g, key=secrets.token_hex(8), item=item)
            for i, item in enumerate(items)
            for g in range(group_size)
        ]
        round_id = secrets.token_hex(6)
        self._round, self._episodes = round_id, {ep.key: ep for ep in episodes}
        generator = Generator(
            self.engine, self.tokenizer, self.config, self.format, greedy, seed, warn=self._warn_override
        )
        timers = {"generation_s": 0.0, "tool_s": 0.0, "generated_tokens": 0}
        self.scheduler.start(round_id, [ep.index for ep in episodes])
        server, loop = self.server, self._agent_loop()
        server.expect(len(episodes))
        self._beat = time.monotonic()
        running = asyncio.run_coroutine_threadsafe(self._run_all(round_id, episodes, server), loop)
        try:
            overdue = self._serve(episodes, generator, timers)
        except BaseException as error:
            self.scheduler.abort(RuntimeError(f"the rollout failed: {type(error).__name__}: {error}"))
            running.cancel()
            raise
        finally:
            self._round, self._episodes = None, {}
        if overdue:
            self._leave_loop(running)
        else:
            running.result()
        check_tool_errors(self.env, episodes)
        self._check_agent_errors(episodes)
        trajectories = self._score(episodes, policy_version)
        stats = rollout_stats(self.tools, trajectories, episodes, timers, time.perf_counter() - start)
        stats["prefix_breaks"] = float(sum(ep.prefix_breaks for ep in episodes))
        stats["agent_errors"] = float(sum(ep.error is not None for ep in episodes))
        stats["samples_per_episode"] = sum(1 + len(t.segments) for t in trajectories) / max(len(trajectories), 1)
        stats["overridden_sampling"] = float(sum(generator.overridden.values()))
        return AgentRollout(grouped(items, trajectories, group_size), stats)

    def _serve(self, episodes: list[Episode], generator: Generator, timers: dict) -> bool:
        """Run the batches the episodes queue, on this thread, until every episode has ended; True when the
        watchdog ended them (the agent loop stalled, or the rollout's deadline passed)."""
        deadline = time.monotonic() + self.rollout_timeout_s
        while (batch := self.scheduler.next_batch(timeout_s=WATCH_S)) is not None:
            if batch:
                self.scheduler.resumed([work.episode for work in batch])
                tic = time.perf_counter()
                if batch[0].kind == GENERATE:
                    timers["generated_tokens"] += generator.run(batch, episodes)
                    timers["generation_s"] += time.perf_counter() - tic
                else:
                    run_tool_work(batch, episodes, self.tools, self.tokenizer, self.config)
                    timers["tool_s"] += time.perf_counter() - tic
                self.scheduler.answered()
            reason = self._overdue(deadline)
            if reason is not None:
                self._end_unfinished(episodes, reason)
                return True
        return False

    def _overdue(self, deadline: float) -> str | None:
        """Why the round must end now, or None: the agent loop has not beaten for `stall_timeout_s` (logged with the
        stack it is stuck in), or the rollout's deadline has passed."""
        now = time.monotonic()
        if now - self._beat > self.stall_timeout_s:
            where, stack = self._agent_stack()
            log.error(
                "the agent %s blocked its event loop for more than rollout.agent.stall_timeout_s=%s s (sync code in an "
                "async function: time.sleep, a sync HTTP client, a CPU loop; await it, or run it with "
                "asyncio.to_thread). Its unfinished episodes end as timed out. Where it blocked:\n%s",
                self.name,
                self.stall_timeout_s,
                stack,
            )
            return f"the agent blocked its event loop for more than {self.stall_timeout_s} s, at {where}"
        if now > deadline:
            log.error(
                "the agent %s's rollout passed its deadline, rollout.agent.rollout_timeout_s=%s s: its unfinished "
                "episodes end as timed out",
                self.name,
                self.rollout_timeout_s,
            )
            return f"the rollout passed its deadline (rollout.agent.rollout_timeout_s={self.rollout_timeout_s} s)"
        return None

    def _agent_stack(self) -> tuple[str, str]:
        """(file:line in function, the whole stack) of the agent loop's thread now."""
        frame = sys._current_frames().get(self._thread.ident) if self._thread is not None else None
        if frame is None:
            return "an unknown place", "(no stack)"
        code = frame.f_code
        return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}", "".join(traceback.format_stack(frame))

    def _end_unfinished(self, episodes: list[Episode], reason: str) -> None:
        with self._lock:
            for ep in episodes:
                if not ep.done:
                    ep.error, ep.done = f"TimeoutError: {reason}"[:500], True
        self.scheduler.abort(RequestError(410, f"the round is over: {reason}"))

    def _leave_loop(self, running: Any) -> None:
        """Give up the agent loop (blocked, or running late) for a fresh one at the next round: its episodes are
        cancelled and its clients closed whenever it runs again, and it then stops."""
        loop, http = self._loop, self._http
        self._loop, self._thread, self._http = None, None, []
        if loop is None:
            return
        running.cancel()
        asyncio.run_coroutine_threadsafe(_retire(loop, http), loop)

    async def _run_all(self, round_id: str, episodes: list[Episode], server: EndpointServer) -> None:
        await asyncio.gather(*(self._run_episode(round_id, ep, server, self._http_client(ep.index)) for ep in episodes))

    def _http_client(self, slot: int) -> Any:
        """A kept-alive HTTP client per episode slot, reused across rounds: one shared client's connection pool
        scans every connection per request (quadratic in the episodes), and a new client per episode reconnects.
        Plain HTTP on loopback: no TLS context."""
        import httpx

        while len(self._http) <= slot:
            limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
            self._http.append(httpx.AsyncClient(verify=False, limits=limits, timeout=self.episode_timeout_s))
        return self._http[slot]

    async def _run_episode(self, round_id: str, ep: Episode, server: EndpointServer, http: Any) -> None:
        import openai

        url = server.base_url(round_id, ep.key)
        client = openai.AsyncOpenAI(base_url=url, api_key=server.api_key, http_client=http).with_options(max_retries=0)

        async def submit(name: str, arguments: dict) -> str:
            return await wait_for_work(self.scheduler, TOOLS, round_id, ep.index, (name, arguments))

        answer, error = None, None
        try:
            tools = EpisodeTools(self.tools, submit, self._instruction(ep.item))
            answer = await asyncio.wait_for(self.function(client, ep.item, tools), self.episode_timeout_s)
            if answer is not None and not isinstance(answer, str):
                raise TypeError(f"the agent returned a {type(answer).__name__}; it must return a str or None")
        except Exception as failure:  # noqa: BLE001  one bad episode is a counted stub, not the round's end
            error = f"{type(failure).__name__}: {failure}"[:500]
        finally:
            with self._lock:  # the watchdog may have ended it already: its verdict stands
                if not ep.done:
                    if error is None:
                        ep.answer = answer
                    elif not ep.truncated:
                        ep.error = error
                    ep.done = True
            self.scheduler.finished(round_id, ep.index)

    def _instruction(self, item: QAItem) -> str:
        messages = build_messages(item.question, self.config.tag_format, None, self.env.instruction)
        return messages[-1]["content"]

    def _check_agent_errors(self, episodes: list[Episode]) -> None:
        failed = [ep for ep in episodes if ep.error is not None]
        share = len(failed) / max(len(episodes), 1)
        if share > self.env.max_agent_error_share:
            raise AgentFailureError(
                f"the agent {self.name} failed in {len(failed)} of {len(episodes)} episodes (share {share:.2f} > "
                f"env.max_agent_error_share={self.env.max_agent_error_share}); first failure: {failed[0].error}"
            )

    def _score(self, episodes: list[Episode], policy_version: int) -> list:
        records = [EpisodeRecord(ep.item, ep.turns, ep.answer, ep.truncated) for ep in episodes]
        results = self.env.reward.score(records)
        if len(results) != len(records):
            raise RuntimeError(f"{type(self.env.reward).__name__}.score returned {len(results)} for {len(records)}")
        return [episode_trajectory(ep, result, policy_version, self.tokenizer) for ep, result in zip(episodes, results)]


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where installed (uvicorn's `standard` extra brings it: about a third less Python per
    request), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _close_all(clients: list[Any]) -> None:
    await asyncio.gather(*(client.aclose() for client in clients))


async def _retire(loop: asyncio.AbstractEventLoop, clients: list[Any]) -> None:
    with contextlib.suppress(Exception):  # a left-behind loop's clients: nothing depends on their closing cleanly
        await asyncio.wait_for(_close_all(clients), 30)
    loop.stop()
