"""Bodies an agent framework may send, over HTTP, in the same batch as another episode's valid request: each is
answered on its own (200, or a 4xx naming the field), the other episode is answered, and the round completes. Each
shape here once escaped `Generator.run` and ended the rollout. Then generated bodies, thrown at the endpoint."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspo.agent import AgentConfig
from dspo.agent.endpoint import EndpointAgent
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment, SearchTool, SubEMReward
from dspo.env.search_tool import SEARCH_TOOL_SCHEMA
from dspo.types import QAItem

GOOD = QAItem(id="good", question="What is the capital of France?", golden_answers=["Paris"])
BAD = QAItem(id="bad", question="What is the capital of Italy?", golden_answers=["Rome"])
ANSWER = "<think>Found it.</think>\n<answer> Paris </answer>"
CASE: dict = {}  # what the "bad" episode sends: bodies(question message, returned assistant message) -> [body]
SEEN: dict = {}
PROMPTS: list[str] = []


async def post(client, body: dict) -> tuple[int, dict]:
    async with httpx.AsyncClient(timeout=30) as http:
        reply = await http.post(
            f"{client.base_url}chat/completions", json=body, headers={"Authorization": f"Bearer {client.api_key}"}
        )
    return reply.status_code, reply.json()


async def two_calls(client, item, tools):
    """A valid first call, then the case's bodies (all at once: one batch) or, for the good episode, a valid one."""
    question = {"role": "user", "content": item.question}
    first = await client.chat.completions.create(model="policy", messages=[question])
    returned = first.choices[0].message.model_dump(exclude_none=True)
    if item.id == "good":
        bodies = [{"model": "policy", "messages": [question, returned, {"role": "user", "content": "Sure?"}]}]
    else:
        bodies = CASE["bodies"](question, returned)
    SEEN[item.id] = await asyncio.gather(*(post(client, body) for body in bodies))
    return "Paris"


def record(prompt: str, turn: int, index: int) -> str:
    PROMPTS.append(prompt)
    return ANSWER


def make_agent(qwen_tokenizer, retriever) -> EndpointAgent:
    env = Environment({"search": SearchTool(retriever, topk=1)}, SubEMReward(), agent=two_calls)
    return EndpointAgent(ScriptedEngine(qwen_tokenizer, record), qwen_tokenizer, env, AgentConfig(max_turns=16))


def run_case(agent: EndpointAgent, bodies) -> tuple[list, dict]:
    CASE["bodies"], PROMPTS[:] = bodies, []
    SEEN.clear()
    rollout = agent.rollout([GOOD, BAD], group_size=1, policy_version=0, seed=0)
    ((status, body),) = SEEN["good"]
    assert status == 200 and body["choices"][0]["message"]["content"] == ANSWER  # the other episode is answered
    assert rollout.stats["agent_errors"] == 0
    return SEEN["bad"], rollout.stats


def one(messages: list) -> dict:
    return {"model": "policy", "messages": messages}


CALL = {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": '{"query_list": ["x"]}'}}
TOOL = {"role": "tool", "tool_call_id": "call_0", "content": "Doc 1 (Title: Rome) Rome."}
TRIGGERS = {
    # (bodies of the bad episode's second call, expected status, what the answer names)
    "user content as text parts": (
        lambda q, r: [one([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])],
        200,
        None,
    ),
    "content null": (lambda q, r: [one([{"role": "user", "content": None}])], 400, "messages[0].content"),
    "content 5": (lambda q, r: [one([{"role": "user", "content": 5}])], 400, "messages[0].content"),
    "no content": (lambda q, r: [one([{"role": "user"}])], 400, "messages[0].content"),
    "a part {'text': 5} on a follow-up": (
        lambda q, r: [one([q, r, {"role": "user", "content": [{"text": 5}]}])],
        400,
        "messages[2].content[0].type",
    ),
    "tool_calls [{'function': 'x'}] on a follow-up": (
        lambda q, r: [one([q, r | {"tool_calls": [{"function": "x"}]}, TOOL])],
        400,
        "messages[1].tool_calls[0].function",
    ),
    "tool_calls 5 on a follow-up": (
        lambda q, r: [one([q, r | {"tool_calls": 5}, TOOL])],
        400,
        "messages[1].tool_calls",
    ),
    "null assistant content with tool_calls": (
        lambda q, r: [one([q, {"role": "assistant", "content": None, "tool_calls": [CALL]}, TOOL])],
        200,
        None,
    ),
    "an image part": (
        lambda q, r: [one([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])],
        400,
        "messages[0].content[0].type='image_url'",
    ),
    "tool_choice required, parallel_tool_calls false": (
        lambda q, r: [
            one([q]) | {"tools": [SEARCH_TOOL_SCHEMA], "tool_choice": "required", "parallel_tool_calls": False}
        ],
        200,
        None,
    ),
    "tool_choice naming a function": (
        lambda q, r: [
            one([q])
            | {"tools": [SEARCH_TOOL_SCHEMA], "tool_choice": {"type": "function", "function": {"name": "search"}}}
        ],
        200,
        None,
    ),
    "response_format json_schema": (
        lambda q, r: [one([q]) | {"response_format": {"type": "json_schema", "json_schema": {}}}],
        400,
        "response_format='json_schema'",
    ),
}


@pytest.mark.parametrize("name", list(TRIGGERS))
def test_each_shape_is_answered_on_its_own(qwen_tokenizer, retriever, name):
    bodies, status, field = TRIGGERS[name]
    agent = make_agent(qwen_tokenizer, retriever)
    try:
        ((got, body),), _ = run_case(agent, bodies)
    finally:
        agent.close()
    assert got == status, body
    if field is not None:
        assert field in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"


def test_a_developer_message_reaches_the_prompt_as_system(qwen_tokenizer, retriever):
    agent = make_agent(qwen_tokenizer, retriever)
    developer = {"role": "developer", "content": "Answer in one word."}
    try:
        ((status, _),), _ = run_case(agent, lambda q, r: [one([developer, q])])
    finally:
        agent.close()
    assert status == 200
    assert any(
        p.startswith(
            "<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\nWhat is the capital of Italy"
        )
        for p in PROMPTS
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
PART = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "refusal"]) | JSON, "text": st.text(max_size=8) | JSON}
    ),
    JSON,
)
CALLS = st.lists(
    st.fixed_dictionaries(
        {"id": st.text(max_size=4) | JSON, "type": st.just("function") | JSON},
        optional={
            "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["search", "x"]) | JSON, "arguments": st.just('{"query_list": ["a"]}') | JSON}
            )
            | JSON
        },
    ),
    max_size=2,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"]) | JSON},
    optional={
        "content": st.text(max_size=12) | st.lists(PART, max_size=3) | JSON,
        "tool_calls": CALLS | JSON,
        "tool_call_id": st.text(max_size=4) | JSON,
        "name": st.text(max_size=4) | JSON,
    },
)
BODY = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=4) | JSON},
    optional={
        "model": st.sampled_from(["policy", "gpt-4o"]) | JSON,
        "tools": st.just([SEARCH_TOOL_SCHEMA]) | st.lists(JSON, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON,
        "parallel_tool_calls": JSON,
        "response_format": st.just({"type": "text"}) | JSON,
        "temperature": st.floats(0, 2) | JSON,
        "top_p": JSON,
        "seed": JSON,
        "n": st.integers(-1, 3) | JSON,
        "max_tokens": st.integers(-1, 40) | JSON,
        "stop": st.text(min_size=1, max_size=3) | JSON,
        "logprobs": JSON,
        "top_logprobs": JSON,
        "logit_bias": JSON,
    },
)


@pytest.fixture
def shared_agent(qwen_tokenizer, retriever):
    """One agent for every generated example (hypothesis runs them all within one call of the test)."""
    agent = make_agent(qwen_tokenizer, retriever)
    yield agent
    agent.close()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(bodies=st.lists(BODY, min_size=1, max_size=4))
def test_generated_bodies_are_each_answered_and_the_round_completes(shared_agent, bodies):
    answers, _ = run_case(shared_agent, lambda q, r: bodies)
    assert len(answers) == len(bodies)
    for status, body in answers:
        assert status == 200 or (400 <= status < 500 and body["error"]["message"]), (status, body)
