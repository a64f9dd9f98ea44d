"""The example agent written with four agent frameworks (docs/examples; the `agents` extra), trained unchanged:
each runs through the endpoint on a scripted engine with 0 agent errors, and the two that keep their history make one
sample per episode. The other two rewrite it and pay a sample per call: smolagents (a call becomes assistant text, its
result a user message) and pydantic-ai (a `<think>` block is sent back re-rendered). Each trains a few steps of
`dspo-train env=agent` on the toy (slow)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from dspo.agent import AgentConfig
from dspo.agent.endpoint import EndpointAgent
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment, SearchTool, SubEMReward
from dspo.sweeps.analysis import find_runs, load_scalars
from dspo.types import QAItem

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"
KEEP_HISTORY = {"langgraph_agent": True, "openai_agents_sdk_agent": True, "smolagents_agent": False}
KEEP_HISTORY["pydantic_ai_agent"] = False
PARIS = QAItem(id="q1", question="What is the capital of France?", golden_answers=["Paris"])
CALL = "<think>I should search.</think>\n<search> France </search>"


def script(prompt: str, turn: int, index: int) -> str:
    """Reads the prompt only: a rewritten history is a new trajectory to the scripted engine."""
    if "(Title: " not in prompt:
        return CALL
    return "<think>Found it.</think>\n<answer> Paris </answer>" if index % 2 == 0 else "<answer> Lyon </answer>"


@pytest.fixture(scope="module")
def examples():
    sys.path.insert(0, str(EXAMPLES))
    yield lambda name: importlib.import_module(name).agent
    sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize("name", sorted(KEEP_HISTORY))
def test_each_framework_runs_through_the_endpoint(qwen_tokenizer, retriever, examples, name):
    env = Environment({"search": SearchTool(retriever, topk=1)}, SubEMReward(), agent=examples(name))
    config = AgentConfig(max_turns=4, tag_format="searchr1")  # the toy's format
    agent = EndpointAgent(ScriptedEngine(qwen_tokenizer, script), qwen_tokenizer, env, config)
    try:
        rollout = agent.rollout([PARIS], group_size=4, policy_version=0, seed=0)
    finally:
        agent.close()
    stats, trajectories = rollout.stats, rollout.groups[0].trajectories
    assert stats["agent_errors"] == 0 and stats["calls/search"] == 1.0
    assert [t.reward for t in trajectories] == [1.0, 0.0, 1.0, 0.0]
    assert [t.answer for t in trajectories] == ["Paris", "Lyon", "Paris", "Lyon"]
    if KEEP_HISTORY[name]:
        assert stats["prefix_breaks"] == 0 and stats["samples_per_episode"] == 1.0
    else:  # one break per episode: the answer's call extends no earlier call
        assert stats["prefix_breaks"] == 4 and stats["samples_per_episode"] == 2.0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(KEEP_HISTORY))
def test_each_framework_trains_on_the_toy(run_train, short_default, tmp_path, monkeypatch, name):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")])))
    outputs = tmp_path / "outputs"
    args = [*short_default, "env=agent", f"env.agent={name}.agent", "trainer.max_steps=2", "algorithm.batch_groups=1"]
    args += ["data.val_limit=4", "~callbacks.validate_at_start"]  # the suite's time: training is what is tested
    if KEEP_HISTORY[name]:  # the transformers engine starts in a second; vLLM's prefix cache pays off on rewritten
        args.append("rollout=hf")  # histories, whose every call is a whole prompt (measured 2x faster there)
    run_train([*args, "run_name=fw", "run_test=false"], outputs)
    (run,) = find_runs(outputs)
    scalars = load_scalars(run.dir)
    value = scalars.set_index("tag").value
    assert (value["rollout/agent_errors"] == 0).all()
    if KEEP_HISTORY[name]:
        assert (value["rollout/prefix_breaks"] == 0).all() and (value["rollout/samples_per_episode"] == 1).all()
    else:
        assert (value["rollout/samples_per_episode"] > 1).all()
    assert (value["rollout/tool_calls_mean"] > 0).all()  # the warm start searches through the framework's tool
    assert torch.isfinite(torch.tensor(value["train/grad_norm"].to_numpy())).all()
    last = torch.load(run.dir / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert last["global_step"] == 2


async def two_searches(client, item, tools):
    """Records the ids of the calls the endpoint returns: the Agents SDK refused a reused id ("Model reused a completed
    tool call ID"), as OpenAI's ids are unique; the endpoint once numbered them from call_0 at every answer."""
    messages, ids = [{"role": "user", "content": tools.instruction}], []
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[tools["search"].schema])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            ids.append(call.id)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": await tools["search"](query="x")})
    return " ".join(ids)


def test_tool_call_ids_are_unique_within_an_episode(qwen_tokenizer, retriever):
    env = Environment({"search": SearchTool(retriever, topk=1)}, SubEMReward(), agent=two_searches)
    engine = ScriptedEngine(qwen_tokenizer, lambda prompt, turn, index: CALL)
    agent = EndpointAgent(engine, qwen_tokenizer, env, AgentConfig(max_turns=4, tag_format="searchr1"))
    try:
        rollout = agent.rollout([PARIS], group_size=2, policy_version=0, seed=0)
    finally:
        agent.close()
    ids = [i for t in rollout.groups[0].trajectories for i in t.answer.split()]
    assert len(ids) == 4 and len(set(ids)) == 4 and all(i.startswith("call_") for i in ids)
