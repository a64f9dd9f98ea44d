"""Rounds that end when they must: episodes keyed by the round's id, the turn budget taken atomically, and deadlines
that hold when the agent blocks its event loop or ignores cancellation (each ends as counted, timed-out stubs, within
the configured deadline, and the next round runs on a fresh loop)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time

import openai
import pytest

from dspo.agent import AgentConfig
from dspo.agent.build import build_agent
from dspo.agent.endpoint import EndpointAgent
from dspo.agent.tool_calling import ToolCallingAgent
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment, SearchTool, SubEMReward
from dspo.types import QAItem

PARIS = QAItem(id="q1", question="What is the capital of France?", golden_answers=["Paris"])
SLOW = QAItem(id="slow", question="What is the capital of Italy?", golden_answers=["Rome"])
ANSWER = "<think>Found it.</think>\n<answer> Paris </answer>"
SEEN: dict = {}


def make(qwen_tokenizer, retriever, agent, config=None, **kwargs) -> EndpointAgent:
    env = Environment({"search": SearchTool(retriever, topk=1)}, SubEMReward(), agent=agent, max_agent_error_share=1)
    engine = ScriptedEngine(qwen_tokenizer, lambda *_: ANSWER)
    return EndpointAgent(engine, qwen_tokenizer, env, config or AgentConfig(), **kwargs)


def bounded(function, timeout_s: float = 30.0):
    """`function()` on a thread, joined within `timeout_s` (so code that would hang fails the test instead)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(function()), daemon=True)
    tic = time.monotonic()
    thread.start()
    thread.join(timeout_s)
    assert out, f"did not return within {timeout_s} s"
    return out[0], time.monotonic() - tic


async def twice_at_once(client, item, tools):
    if item.id == "slow":  # still running when the other's two requests queue: they go in one batch
        await asyncio.sleep(0.3)
        return None
    messages = [{"role": "user", "content": item.question}]
    calls = [client.chat.completions.create(model="policy", messages=messages) for _ in range(2)]
    SEEN["twice"] = await asyncio.gather(*calls, return_exceptions=True)
    return "Paris"


def test_two_concurrent_requests_cannot_both_take_the_last_turn(qwen_tokenizer, retriever):
    agent = make(qwen_tokenizer, retriever, twice_at_once, AgentConfig(max_turns=1), batch_wait_s=5.0)
    try:
        rollout = agent.rollout([PARIS, SLOW], group_size=1, policy_version=0)
    finally:
        agent.close()
    refused = [r for r in SEEN["twice"] if isinstance(r, openai.BadRequestError)]
    assert len(refused) == 1 and "max_turns=1" in refused[0].message
    assert rollout.groups[0].trajectories[0].num_turns == 1


async def keeps_its_client(client, item, tools):
    if "client" in SEEN:
        try:
            await SEEN["client"].chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        except openai.APIStatusError as error:
            SEEN["stale"] = (error.status_code, error.message)
    SEEN["client"] = client
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": item.question}])
    return reply.choices[0].message.content


def test_a_client_kept_from_an_earlier_round_is_refused(qwen_tokenizer, retriever):
    SEEN.clear()
    agent = make(qwen_tokenizer, retriever, keeps_its_client)
    try:
        agent.rollout([PARIS], group_size=1, policy_version=0)
        rollout = agent.rollout([PARIS], group_size=1, policy_version=0)
    finally:
        agent.close()
    status, message = SEEN["stale"]
    assert status == 410 and "is over" in message  # never answered against this round's episode 0
    assert rollout.groups[0].trajectories[0].reward == 1.0 and rollout.stats["agent_errors"] == 0


async def blocks_its_loop(client, item, tools):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": item.question}])
    time.sleep(2.0)  # sync sleep inside the async function: no await can fire meanwhile
    return "Paris"


async def answers(client, item, tools):
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": item.question}])
    return reply.choices[0].message.content


def test_an_agent_that_blocks_its_event_loop_ends_as_timed_out_stubs_naming_where(qwen_tokenizer, retriever, caplog):
    agent = make(qwen_tokenizer, retriever, blocks_its_loop, stall_timeout_s=0.4)
    try:
        with caplog.at_level("ERROR", logger="dspo.agent.endpoint.agent"):
            rollout, took = bounded(lambda: agent.rollout([PARIS, SLOW], group_size=2, policy_version=0))
        assert took < 1.8  # the watchdog, not the sleep, ended it
        assert rollout.stats["agent_errors"] == 4
        trajectories = [t for group in rollout.groups for t in group.trajectories]
        assert {t.stop_reason for t in trajectories} == {"agent_timeout"} and all(t.reward == 0 for t in trajectories)
        (logged,) = [r.getMessage() for r in caplog.records if "blocked its event loop" in r.getMessage()]
        assert "test_rounds.blocks_its_loop" in logged and "time.sleep(2.0)" in logged
        agent.env.agent = agent.function = answers  # the next round runs, on a fresh loop
        rollout, _ = bounded(lambda: agent.rollout([PARIS], group_size=2, policy_version=0))
        assert rollout.stats["agent_errors"] == 0 and [t.reward for t in rollout.groups[0].trajectories] == [1.0, 1.0]
    finally:
        agent.close()


async def ignores_cancellation(client, item, tools):
    for _ in range(50):  # at most 5 s: the test's threads end on their own
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.1)
    return "Paris"


def test_the_rollout_deadline_holds_when_an_agent_swallows_its_timeout(qwen_tokenizer, retriever, caplog):
    agent = make(qwen_tokenizer, retriever, ignores_cancellation, episode_timeout_s=0.2, rollout_timeout_s=0.8)
    try:
        with caplog.at_level("ERROR", logger="dspo.agent.endpoint.agent"):
            rollout, took = bounded(lambda: agent.rollout([PARIS], group_size=2, policy_version=0))
    finally:
        agent.close()
    assert took < 3.0 and rollout.stats["agent_errors"] == 2
    assert {t.stop_reason for t in rollout.groups[0].trajectories} == {"agent_timeout"}
    assert any("rollout_timeout_s=0.8" in r.getMessage() for r in caplog.records)


def test_deadlines_are_rollout_agent_keywords_and_must_be_positive(qwen_tokenizer, retriever):
    env = Environment({"search": SearchTool(retriever, topk=1)}, SubEMReward(), agent=answers)
    partial = functools.partial(ToolCallingAgent, max_turns=6, stall_timeout_s=5.0, rollout_timeout_s=9.0)
    agent = build_agent(
        partial, engine=ScriptedEngine(qwen_tokenizer, lambda *_: ANSWER), tokenizer=qwen_tokenizer, env=env
    )
    assert (agent.stall_timeout_s, agent.rollout_timeout_s, agent.config.max_turns) == (5.0, 9.0, 6)
    assert make(qwen_tokenizer, retriever, answers, episode_timeout_s=30).rollout_timeout_s == 90.0
    with pytest.raises(ValueError, match=r"rollout.agent.stall_timeout_s=0: must be > 0"):
        make(qwen_tokenizer, retriever, answers, stall_timeout_s=0)
