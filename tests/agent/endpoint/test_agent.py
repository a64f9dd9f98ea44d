"""`EndpointAgent` end to end on the real Qwen2.5 template: the example agent of docs/examples trains the same tokens as
the built-in loop; rewritten histories become segments; failing agents become counted stubs; budgets; dispatch."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

from dspo.agent import AgentConfig
from dspo.agent.build import build_agent
from dspo.agent.endpoint import AgentFailureError, EndpointAgent
from dspo.agent.tool_calling import ToolCallingAgent
from dspo.data.round_builder import build_round
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment, SearchTool, SubEMReward
from dspo.env.environment import resolve_agent
from dspo.types import QAItem

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"
PARIS = QAItem(id="q1", question="What is the capital of France?", golden_answers=["Paris"])
CALL = '<think>I should search.</think>\n<tool_call>\n{"name": "search", "arguments": {"query_list": ["France"]}}\n'
CALL += "</tool_call>"
ANSWER = "<think>Found it.</think>\n<answer> Paris </answer>"
WRONG = "<think>Hm.</think>\n<answer> Lyon </answer>"


@pytest.fixture(scope="module")
def example_agent():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import openai_agent

        yield openai_agent.agent
    finally:
        sys.path.remove(str(EXAMPLES))


def env_with(retriever, agent=None, share: float = 0.05) -> Environment:
    return Environment(
        {"search": SearchTool(retriever, topk=1)}, SubEMReward(), agent=agent, max_agent_error_share=share
    )


SEARCHR1_CALL = "<think>I should search.</think>\n<search> France </search>"


def scripted(tag_format: str):
    call = CALL if tag_format == "qwen" else SEARCHR1_CALL

    def script(prompt: str, turn: int, index: int) -> str:
        return call if turn == 0 else (ANSWER if index % 2 == 0 else WRONG)

    return script


def by_prompt(prompt: str, turn: int, index: int) -> str:
    """A history that extends no earlier one is a new trajectory to the scripted engine: script by the prompt."""
    if "<tool_response>" not in prompt:
        return CALL
    return ANSWER if index % 2 == 0 else WRONG


def trained(trajectory) -> list[int]:
    return [t for t, m in zip(trajectory.response_ids, trajectory.response_mask) if m]


@pytest.mark.parametrize("tag_format", ["qwen", "searchr1"])
@pytest.mark.parametrize("max_turns", [2, 4])
def test_the_example_agent_trains_what_the_built_in_loop_trains(
    qwen_tokenizer, retriever, example_agent, tag_format, max_turns
):
    """Same prompt, same model tokens and logprobs, same text (the last-turn note included), same rewards."""
    config, script = AgentConfig(max_turns=max_turns, tag_format=tag_format), scripted(tag_format)
    builtin = ToolCallingAgent(ScriptedEngine(qwen_tokenizer, script), qwen_tokenizer, env_with(retriever), config)
    endpoint = build_agent(
        config,
        engine=ScriptedEngine(qwen_tokenizer, script),
        tokenizer=qwen_tokenizer,
        env=env_with(retriever, example_agent),
    )
    assert isinstance(endpoint, EndpointAgent)
    try:
        ours = endpoint.rollout([PARIS], group_size=4, policy_version=2, seed=0)
    finally:
        endpoint.close()
    theirs = builtin.rollout([PARIS], group_size=4, policy_version=2, seed=0)
    for a, b in zip(ours.groups[0].trajectories, theirs.groups[0].trajectories):
        assert a.prompt_ids == b.prompt_ids
        assert trained(a) == trained(b)  # the model's tokens, exactly; the tool turn may split differently
        assert qwen_tokenizer.decode(a.response_ids) == qwen_tokenizer.decode(b.response_ids)
        assert a.engine_logprobs == b.engine_logprobs or a.response_ids != b.response_ids
        assert (a.reward, a.answer, a.num_tool_calls, a.num_turns) == (b.reward, b.answer, b.num_tool_calls, 2)
        assert not a.segments and a.policy_version == 2
    assert [t.reward for t in ours.groups[0].trajectories] == [1.0, 0.0, 1.0, 0.0]
    assert ours.stats["prefix_breaks"] == 0 and ours.stats["calls/search"] == 1.0


async def forgetful(client, item, tools):
    """Rewrites its history: the second call drops the thinking of the first (as some templates do)."""
    messages = [{"role": "user", "content": item.question}]
    schemas = [tool.schema for tool in tools.values()]
    reply = (await client.chat.completions.create(model="policy", messages=messages, tools=schemas)).choices[0].message
    call = reply.tool_calls[0]
    text = await tools["search"](**json.loads(call.function.arguments))
    edited = reply.model_dump(exclude_none=True) | {"content": ""}
    messages += [edited, {"role": "tool", "tool_call_id": call.id, "content": text}]
    final = (await client.chat.completions.create(model="policy", messages=messages, tools=schemas)).choices[0]
    return "Paris" if "Paris" in (final.message.content or "") else None


def test_a_rewritten_history_is_a_second_sample_with_the_same_advantage(qwen_tokenizer, retriever):
    agent = EndpointAgent(
        ScriptedEngine(qwen_tokenizer, by_prompt), qwen_tokenizer, env_with(retriever, forgetful), AgentConfig()
    )
    try:
        rollout = agent.rollout([PARIS], group_size=2, policy_version=0, seed=0)
    finally:
        agent.close()
    assert rollout.stats["prefix_breaks"] == 2 and rollout.stats["samples_per_episode"] == 2.0
    first, second = rollout.groups[0].trajectories
    assert (first.reward, second.reward) == (1.0, 0.0)
    (segment,) = first.segments
    assert qwen_tokenizer.decode([t for t, m in zip(segment.response_ids, segment.response_mask) if m]) == ANSWER
    assert qwen_tokenizer.decode(trained(first)) == CALL
    (minibatch,) = build_round(rollout.groups, 1, 8, pad_token_id=0, policy_version=0, seed=0).minibatches
    (batch,) = minibatch
    assert len(batch) == 4  # 2 episodes x 2 samples
    assert sorted(batch.advantages.tolist()) == pytest.approx([-0.7071, -0.7071, 0.7071, 0.7071], abs=1e-3)


async def flaky(client, item, tools):
    if item.id == "bad":
        raise ConnectionError("the agent's own backend is down")
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": item.question}])
    return reply.choices[0].message.content


def test_a_failing_episode_is_a_counted_stub_and_too_many_fail_the_round(qwen_tokenizer, retriever):
    items = [PARIS, QAItem(id="bad", question="?", golden_answers=["x"])]
    agent = EndpointAgent(
        ScriptedEngine(qwen_tokenizer, lambda *_: ANSWER),
        qwen_tokenizer,
        env_with(retriever, flaky, 0.5),
        AgentConfig(),
    )
    try:
        rollout = agent.rollout(items, group_size=1, policy_version=0)
        assert rollout.stats["agent_errors"] == 1
        stub = rollout.groups[1].trajectories[0]
        assert stub.reward == 0.0 and stub.num_generated_tokens == 0 and stub.truncated
        agent.env.max_agent_error_share = 0.25
        with pytest.raises(AgentFailureError, match=r"test_agent.flaky failed in 1 of 2 episodes.*backend is down"):
            agent.rollout(items, group_size=1, policy_version=0)
    finally:
        agent.close()


async def hot(client, item, tools):
    """Sampling settings as a deployed agent sets them."""
    messages = [{"role": "user", "content": item.question}]
    settings = {"temperature": 1.0, "top_p": 0.5, "seed": 3, "max_tokens": 10_000}
    reply = await client.chat.completions.create(model="policy", messages=messages, **settings)
    messages.append(reply.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "Sure?"})
    await client.chat.completions.create(model="policy", messages=messages, **settings)
    return "Paris"


class Recording(ScriptedEngine):
    def generate(self, prompts, sampling):
        self.sampled = [*getattr(self, "sampled", []), sampling]
        return super().generate(prompts, sampling)


@pytest.mark.parametrize("greedy", [True, False])
def test_sampling_is_the_trainers_and_each_override_is_counted_and_warned_once(
    qwen_tokenizer, retriever, caplog, greedy
):
    """An agent's temperature=1.0 during greedy evaluation once ended the run (every call refused): now replaced."""
    engine = Recording(qwen_tokenizer, lambda *_: ANSWER)
    agent = EndpointAgent(engine, qwen_tokenizer, env_with(retriever, hot, 0.0), AgentConfig(temperature=0.7))
    try:
        with caplog.at_level("WARNING", logger="dspo.agent.endpoint.agent"):
            rollout = agent.rollout([PARIS], group_size=2, policy_version=0, greedy=greedy, seed=0)
    finally:
        agent.close()
    assert rollout.stats["agent_errors"] == 0 and rollout.stats["overridden_sampling"] == 16  # 4 settings x 4 calls
    assert {s.temperature for s in engine.sampled} == {0.0 if greedy else 0.7}
    assert {(s.top_p, s.max_new_tokens) for s in engine.sampled} == {(1.0, 256)}
    warned = [r.getMessage() for r in caplog.records if "overridden_sampling" in r.getMessage()]
    assert len(warned) == 4  # once per parameter, not per call
    used = "0.0" if greedy else "0.7"
    assert any("sent temperature=1.0" in m and f"samples with temperature={used}" in m for m in warned)
    assert any("sent max_tokens=10000" in m and "max_tokens=256" in m for m in warned)
    assert EndpointAgent.stat_kinds["overridden_sampling"].value == "sum"


def test_build_agent_serves_env_agent_with_rollout_agent_budgets(qwen_tokenizer, retriever, example_agent):
    engine = ScriptedEngine(qwen_tokenizer, lambda *_: ANSWER)
    partial = functools.partial(ToolCallingAgent, max_turns=6, max_total_tokens=512)
    agent = build_agent(partial, engine=engine, tokenizer=qwen_tokenizer, env=env_with(retriever, example_agent))
    assert isinstance(agent, EndpointAgent) and agent.config.max_turns == 6 and agent.config.max_total_tokens == 512
    other = functools.partial(ScriptedEngine)
    with pytest.raises(ValueError, match="both name an agent"):
        build_agent(other, engine=engine, tokenizer=qwen_tokenizer, env=env_with(retriever, example_agent))
    with pytest.raises(ValueError, match="tag_format='xml': expected one of"):
        EndpointAgent(engine, qwen_tokenizer, env_with(retriever, example_agent), AgentConfig(tag_format="xml"))
    with pytest.raises(ValueError, match="overflow=compact with env.agent: the agent keeps its own context"):
        EndpointAgent(engine, qwen_tokenizer, env_with(retriever, example_agent), AgentConfig(overflow="compact"))


def sync_agent(client, item, tools):
    return None


def test_env_agent_names_an_async_function():
    with pytest.raises(TypeError, match="async def agent"):
        resolve_agent(sync_agent)
    with pytest.raises(ImportError, match="PYTHONPATH"):
        resolve_agent("no_such_module_here.agent")
    with pytest.raises(ValueError, match="module.function"):
        resolve_agent("agent")


def test_a_tool_backend_that_is_down_fails_the_round_and_the_agent_stays_usable(
    qwen_tokenizer, retriever, failing_retriever, example_agent
):
    engine = ScriptedEngine(qwen_tokenizer, scripted("qwen"))
    down = EndpointAgent(engine, qwen_tokenizer, env_with(failing_retriever, example_agent), AgentConfig())
    try:
        with pytest.raises(Exception, match="unreachable after 3 retries"):
            down.rollout([PARIS], group_size=2, policy_version=0, seed=0)
        down.env.tools["search"].retriever = retriever  # the backend is back: the next round runs
        rollout = down.rollout([PARIS], group_size=2, policy_version=0, seed=0)
        assert [t.reward for t in rollout.groups[0].trajectories] == [1.0, 0.0]
    finally:
        down.close()
