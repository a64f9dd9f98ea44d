"""The endpoint over HTTP, driven by the real `openai` client and by plain HTTP requests: the run's key, `n > 1`, tool
calls, logprobs, a refused stream, and the budgets."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from dspo.agent import AgentConfig
from dspo.agent.endpoint import EndpointAgent
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment, SearchTool, SubEMReward
from dspo.types import QAItem

PARIS = QAItem(id="q1", question="What is the capital of France?", golden_answers=["Paris"])
CALL = '<think>search</think>\n<tool_call>\n{"name": "search", "arguments": {"query_list": ["France"]}}\n</tool_call>'
ANSWER = "<think>Found it.</think>\n<answer> Paris </answer>"
SEEN: dict = {}


def endpoint(tokenizer, retriever, agent, script, **config) -> EndpointAgent:
    env = Environment({"search": SearchTool(retriever, topk=1)}, SubEMReward(), agent=agent, max_agent_error_share=1)
    engine = ScriptedEngine(tokenizer, script)
    return EndpointAgent(engine, tokenizer, env, AgentConfig(**{"max_turns": 4, **config}))


async def openai_calls(client, item, tools):
    SEEN["models"] = [m.id for m in (await client.models.list()).data]
    question = [{"role": "user", "content": item.question}]
    first = await client.chat.completions.create(
        model="policy", messages=question, tools=[t.schema for t in tools.values()], n=2, logprobs=True
    )
    SEEN["first"] = first
    message = first.choices[0].message
    call = message.tool_calls[0]
    text = await tools["search"](**json.loads(call.function.arguments))
    history = [
        *question,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": text},
    ]
    second = await client.chat.completions.create(model="policy", messages=history)
    SEEN["second"] = second
    return "Paris"


def test_the_openai_client_gets_tool_calls_n_choices_and_logprobs(qwen_tokenizer, retriever):
    agent = endpoint(qwen_tokenizer, retriever, openai_calls, lambda prompt, turn, index: CALL if turn == 0 else ANSWER)
    try:
        rollout = agent.rollout([PARIS], group_size=1, policy_version=3, seed=0)
    finally:
        agent.close()
    assert SEEN["models"] == ["policy"]
    first = SEEN["first"]
    assert [c.finish_reason for c in first.choices] == ["tool_calls", "tool_calls"]
    assert first.choices[0].message.tool_calls[0].function.name == "search"
    tokens = first.choices[0].logprobs.content
    assert len(tokens) == first.usage.completion_tokens // 2 and all(t.logprob == 0.0 for t in tokens)
    second = SEEN["second"].choices[0]
    assert second.finish_reason == "stop" and second.message.content.endswith("<answer> Paris </answer>")
    (trajectory,) = rollout.groups[0].trajectories
    assert trajectory.reward == 1.0 and trajectory.num_tool_calls == 1 and trajectory.policy_version == 3
    assert len(trajectory.segments) == 1  # the second choice of the first call: a branch of its own
    assert rollout.stats["prefix_breaks"] == 0 and rollout.stats["agent_errors"] == 0


async def plain_http(client, item, tools):
    url = f"{client.base_url}chat/completions".replace("//chat", "/chat")

    def post(body: dict, key: str | None = client.api_key) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(url, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    messages = [{"role": "user", "content": item.question}]
    SEEN["no_key"] = await asyncio.to_thread(post, {"messages": messages}, None)
    SEEN["wrong_key"] = await asyncio.to_thread(post, {"messages": messages}, "not-the-key")
    SEEN["stream"] = await asyncio.to_thread(post, {"messages": messages, "stream": True})
    SEEN["model"] = await asyncio.to_thread(post, {"messages": messages, "model": "gpt-4o"})
    SEEN["ok"] = await asyncio.to_thread(post, {"model": "policy", "messages": messages, "max_tokens": 4})
    SEEN["budget"] = await asyncio.to_thread(post, {"messages": messages})  # max_turns=1: the second call
    raise RuntimeError("never reached: a refused budget ends the episode as truncated, not as an error")


def test_plain_http_needs_the_key_and_the_budgets_end_the_episode(qwen_tokenizer, retriever):
    agent = endpoint(qwen_tokenizer, retriever, plain_http, lambda *_: ANSWER, max_turns=1)
    try:
        rollout = agent.rollout([PARIS], group_size=1, policy_version=0)
    finally:
        agent.close()
    assert SEEN["no_key"][0] == 401 and SEEN["wrong_key"][0] == 401
    assert SEEN["stream"][0] == 400 and "stream" in SEEN["stream"][1]["error"]["message"]
    assert SEEN["model"][0] == 404
    status, body = SEEN["ok"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    assert SEEN["budget"][0] == 400 and "max_turns=1" in SEEN["budget"][1]["error"]["message"]
    (trajectory,) = rollout.groups[0].trajectories
    assert trajectory.truncated and rollout.stats["agent_errors"] == 0  # a budget is no agent error
    assert trajectory.num_generated_tokens == 4


def test_the_endpoint_binds_loopback_only(qwen_tokenizer, retriever):
    agent = endpoint(qwen_tokenizer, retriever, plain_http, lambda *_: ANSWER)
    try:
        assert agent.server.url.startswith("http://127.0.0.1:")
        with pytest.raises(urllib.error.HTTPError) as error:  # no key: refused before anything else
            urllib.request.urlopen(f"{agent.server.url}/v1/models", timeout=10)
        assert error.value.code == 401
    finally:
        agent.close()
