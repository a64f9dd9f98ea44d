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
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from typing import Any

from dspo.agent.accounting import CALL_STAT_KINDS, check_tool_errors, grouped, rollout_stats
from dspo.agent.config import AgentConfig
from dspo.agent.endpoint.episodes import Episode
from dspo.agent.endpoint.formats import FORMATS
from dspo.agent.endpoint.generation import Generator
from dspo.agent.endpoint.scheduler import GENERATE, TOOLS, Scheduler, wait_for_work
from dspo.agent.endpoint.server import EndpointServer
from dspo.agent.endpoint.tools import EpisodeTools, run_tool_work
from dspo.agent.endpoint.trajectories import episode_trajectory
from dspo.agent.prompts import build_messages
from dspo.agent.protocol import AgentRollout
from dspo.agent.stats import Kind
from dspo.env.rewards import EpisodeRecord
from dspo.types import QAItem


class AgentFailureError(RuntimeError):
    """The user's agent failed on more than `env.max_agent_error_share` of a batch's episodes."""


class EndpointAgent:
    """Rolls out `env.agent` (an async function, module docstring) `group_size` times per item, all at once.

    Args:
        engine, tokenizer, env: as for every agent (`dspo.agent.protocol.build_agent`); `env.agent` is the function.
        config: the episode's budgets and sampling (`rollout.agent`'s settings), or give them as keywords.
        batch_wait_s: how long a queued request waits for episodes still running user code before its batch goes.
        episode_timeout_s: an episode running longer is an agent error.
    """

    # its rollout statistics' kinds (dspo.agent.stats): rollout_stats' and the endpoint's own counts
    stat_kinds = {
        **CALL_STAT_KINDS,
        "prefix_breaks": Kind.SUM,
        "agent_errors": Kind.SUM,
        "samples_per_episode": Kind.MEAN,
    }

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        env: Any,
        config: AgentConfig | None = None,
        batch_wait_s: float = 0.5,
        episode_timeout_s: float = 600.0,
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
        if episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s={episode_timeout_s}: must be > 0")
        self.engine, self.env, self.config, self.function = engine, env, config, function
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.tools = env.tools
        self.format = FORMATS[config.tag_format](self.tokenizer, self.tools)
        self.episode_timeout_s = episode_timeout_s
        self.scheduler = Scheduler(batch_wait_s)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
        self._episodes: dict[str, Episode] = {}
        self._server: EndpointServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
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
            self._loop = _new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="dspo-agents", daemon=True).start()
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

    def _lookup(self, key: str) -> int | None:
        episode = self._episodes.get(key)
        return None if episode is None or episode.done else episode.index

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
        self._episodes = {ep.key: ep for ep in episodes}
        generator = Generator(self.engine, self.tokenizer, self.config, self.format, greedy, seed)
        timers = {"generation_s": 0.0, "tool_s": 0.0, "generated_tokens": 0}
        self.scheduler.start([ep.index for ep in episodes])
        server, loop = self.server, self._agent_loop()
        running = asyncio.run_coroutine_threadsafe(self._run_all(episodes, server), loop)
        try:
            self._serve(episodes, generator, timers)
        except BaseException as error:
            self.scheduler.abort(RuntimeError(f"the rollout failed: {type(error).__name__}: {error}"))
            running.cancel()
            raise
        finally:
            self._episodes = {}
        running.result()
        check_tool_errors(self.env, episodes)
        self._check_agent_errors(episodes)
        trajectories = self._score(episodes, policy_version)
        stats = rollout_stats(self.tools, trajectories, episodes, timers, time.perf_counter() - start)
        stats["prefix_breaks"] = float(sum(ep.prefix_breaks for ep in episodes))
        stats["agent_errors"] = float(sum(ep.error is not None for ep in episodes))
        stats["samples_per_episode"] = sum(1 + len(t.segments) for t in trajectories) / max(len(trajectories), 1)
        return AgentRollout(grouped(items, trajectories, group_size), stats)

    def _serve(self, episodes: list[Episode], generator: Generator, timers: dict) -> None:
        """Run the batches the episodes queue, on this thread, until every episode has ended."""
        while (batch := self.scheduler.next_batch()) is not None:
            self.scheduler.resumed([work.episode for work in batch])
            tic = time.perf_counter()
            if batch[0].kind == GENERATE:
                timers["generated_tokens"] += generator.run(batch, episodes)
                timers["generation_s"] += time.perf_counter() - tic
            else:
                run_tool_work(batch, episodes, self.tools, self.tokenizer, self.config)
                timers["tool_s"] += time.perf_counter() - tic
            self.scheduler.answered()

    async def _run_all(self, episodes: list[Episode], server: EndpointServer) -> None:
        await asyncio.gather(*(self._run_episode(ep, server, self._http_client(ep.index)) for ep in episodes))

    def _http_client(self, slot: int) -> Any:
        """A kept-alive HTTP client per episode slot, reused across rounds: one shared client's connection pool
        scans every connection per request (quadratic in the episodes), and a new client per episode reconnects.
        Plain HTTP on loopback: no TLS context."""
        import httpx

        while len(self._http) <= slot:
            limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
            self._http.append(httpx.AsyncClient(verify=False, limits=limits, timeout=self.episode_timeout_s))
        return self._http[slot]

    async def _run_episode(self, ep: Episode, server: EndpointServer, http: Any) -> None:
        import openai

        client = openai.AsyncOpenAI(base_url=server.base_url(ep.key), api_key=server.api_key, http_client=http)
        client = client.with_options(max_retries=0)

        async def submit(name: str, arguments: dict) -> str:
            return await wait_for_work(self.scheduler, TOOLS, ep.index, (name, arguments))

        try:
            tools = EpisodeTools(self.tools, submit, self._instruction(ep.item))
            answer = await asyncio.wait_for(self.function(client, ep.item, tools), self.episode_timeout_s)
            if answer is not None and not isinstance(answer, str):
                raise TypeError(f"the agent returned a {type(answer).__name__}; it must return a str or None")
            ep.answer = answer
        except Exception as error:  # noqa: BLE001  one bad episode is a counted stub, not the round's end
            if not ep.truncated:
                ep.error = f"{type(error).__name__}: {error}"[:500]
        finally:
            ep.done = True
            self.scheduler.finished(ep.index)

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
