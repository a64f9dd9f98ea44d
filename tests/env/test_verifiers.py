"""`env=verifiers`: a single-turn and a multi-turn verifiers (v1) taskset, written with its public API
(tests/env/verifiers_envs/), played through dspo's endpoint. The rewards dspo logs equal what verifiers' own rollout
gives for the same completions (replayed from an OpenAI-compatible stub, without dspo), the multi-turn episode keeps
one token sequence, and each trains on the toy (slow)."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

from dspo.agent import AgentConfig  # noqa: E402
from dspo.agent.endpoint import EndpointAgent  # noqa: E402
from dspo.engines.scripted import ScriptedEngine  # noqa: E402
from dspo.env.verifiers_env import build, load, task_items, tasks, trace_score, verifiers_environment  # noqa: E402

ENVS = Path(__file__).resolve().parent / "verifiers_envs"
REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [
    {"question": "What is the capital of France?", "golden_answers": ["Paris"]},
    {"question": "What is the capital of Italy?", "golden_answers": ["Rome"]},
]
PAGES = [{"title": "France", "text": "Its capital is Paris."}, {"title": "Italy", "text": "Its capital is Rome."}]
SINGLE = {"questions": QUESTIONS}
SEARCH = {"questions": QUESTIONS, "task": {"tools": {"pages": PAGES}}}
SHARED = {"questions": QUESTIONS, "task": {"tools": {"pages": PAGES}, "shared": True}}


@pytest.fixture(autouse=True)
def taskset_path(monkeypatch):
    """verifiers imports a taskset by module name, and serves a toolset as `python -m <module>` in a subprocess."""
    monkeypatch.syspath_prepend(str(ENVS))
    path = os.pathsep.join(filter(None, [str(ENVS), str(REPO), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)


def scripted(searching: bool):
    """The policy: (a search first, when the task has the tool), then Paris for even episodes and Rome for odd."""

    def script(prompt: str, turn: int, index: int) -> str:
        if searching and turn == 0:
            return "<think>Look it up.</think>\n<search> capital </search>"
        return "<answer> Paris </answer>" if index % 2 == 0 else "<answer> Rome </answer>"

    return script


def rollout(qwen_tokenizer, taskset: str, args: dict, searching: bool):
    env = verifiers_environment(taskset, args)
    items = task_items(load(taskset, args), taskset)
    agent = EndpointAgent(
        ScriptedEngine(qwen_tokenizer, scripted(searching)),
        qwen_tokenizer,
        env,
        AgentConfig(max_turns=4, tag_format="searchr1"),
    )
    try:
        return agent.rollout(items, group_size=2, policy_version=0, seed=0), items
    finally:
        agent.close()


def stub_server(replies: list[dict]):
    """An OpenAI-compatible chat server answering each call with the next of `replies` (assistant messages)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    queue = list(replies)

    async def chat(request):
        message = queue.pop(0)
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        body = {"id": "stub", "object": "chat.completion", "created": 0, "model": "policy"}
        body["choices"] = [{"index": 0, "message": message, "finish_reason": finish}]
        body["usage"] = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return JSONResponse(body)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}/v1"


def verifiers_own_reward(taskset: str, args: dict, index: int, replies: list[dict]) -> tuple[float, dict]:
    """verifiers' own rollout of task `index` (its env, its harness, its interception, no dspo endpoint) on a client
    that replies `replies`: the trace's reward and its parts."""
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.configs.client import EvalClientConfig
    from verifiers.v1.env import RunSlot

    env = build(taskset, args)  # a fresh one: dspo's (load's) keeps its serving resources for the run
    server, url = stub_server(replies)
    os.environ["STUB_KEY"] = "stub"
    ctx = ModelContext(client=EvalClientConfig(base_url=url, api_key_var="STUB_KEY"), model="policy")

    async def run():
        async with env.serving():
            return await env.run_slot(RunSlot(tasks(env)[index]), ctx)

    try:
        episode = asyncio.run(run())
    finally:
        server.should_exit = True
    return trace_score(episode.traces[-1])


def search_call(query: str) -> dict:
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": f'{{"query": "{query}"}}'}}
    return {"role": "assistant", "content": "<think>Look it up.</think>\n", "tool_calls": [call]}


CASES = [("vf_toy_single", SINGLE, False), ("vf_toy_search", SEARCH, True), ("vf_toy_search", SHARED, True)]


@pytest.mark.parametrize(("taskset", "args", "searching"), CASES, ids=["single", "per_task_tool", "shared_tool"])
def test_rewards_are_what_verifiers_gives_the_same_completions(qwen_tokenizer, taskset, args, searching):
    result, items = rollout(qwen_tokenizer, taskset, args, searching)
    stats = result.stats
    assert stats["agent_errors"] == 0 and stats["prefix_breaks"] == 0 and stats["samples_per_episode"] == 1.0
    for item, group in zip(items, result.groups):
        for trajectory in group.trajectories:
            final = {"role": "assistant", "content": str(trajectory.answer)}
            replies = [search_call("capital"), final] if searching else [final]
            index = item.metadata["verifiers"]["index"]
            reward, parts = verifiers_own_reward(taskset, args, index, replies)
            assert trajectory.reward == reward
            assert {k: v for k, v in trajectory.reward_components.items() if k != "verifiers"} == parts
    rewards = [t.reward for g in result.groups for t in g.trajectories]
    assert rewards == [1.0, 0.0, 0.0, 1.0]  # Paris / Rome answered to France, then to Italy
    if searching:
        assert stats["reward/verifiers/searched"] == 1.0 and stats["turns_mean"] == 2.0


def test_a_toolset_tool_is_a_proxy_the_tag_format_parses():
    env = verifiers_environment("vf_toy_search", SEARCH)
    assert sorted(env.tools) == ["search"] and env.tools["search"].tag_argument == "query"
    assert verifiers_environment("vf_toy_single", SINGLE).tools == {}


def test_a_taskset_that_is_not_there_fails_naming_the_key():
    with pytest.raises(ValueError, match="env.id=no_such_taskset"):
        verifiers_environment("no_such_taskset")
    with pytest.raises(ValueError, match="env.id is empty"):
        verifiers_environment("")


def train_verifiers(run_train, short_default, toy_cache, tmp_path, taskset: str, extra: list[str]):
    from dspo.sweeps.analysis import find_runs, load_scalars

    train = toy_cache / "toyworld" / "default" / "world" / "train.jsonl"
    args = [arg for arg in short_default if not arg.startswith(("data.val_limit", "data.test_limit"))]
    args += ["env=verifiers", "data=verifiers", f"env.id={taskset}", "run_test=false", *extra]
    corpus = train.parent / "corpus.jsonl"
    tools = f", task: {{tools: {{corpus: '{corpus}'}}, shared: true}}" if taskset == "vf_toy_search" else ""
    args.append(f"env.args={{path: '{train}', limit: 64{tools}}}")
    outputs = tmp_path / "outputs"
    run_train(args, outputs)
    (run,) = find_runs(outputs)
    return load_scalars(run.dir)


@pytest.mark.slow
def test_train_a_single_turn_verifiers_env_two_steps(run_train, short_default, toy_cache, tmp_path):
    """No tool: the toy model's searches go nowhere, so groups are rarely mixed: no filter, the plumbing is tested."""
    scalars = train_verifiers(
        run_train, short_default, toy_cache, tmp_path, "vf_toy_single", ["algorithm.filter=none", "trainer.max_steps=2"]
    )
    tags = set(scalars.tag)
    for tag in ("reward/verifiers", "reward/verifiers/correct", "reward/verifiers/answered", "rollout/agent_errors"):
        assert tag in tags, f"{tag} missing; logged: {sorted(tags)}"
    assert (scalars[scalars.tag == "rollout/agent_errors"].value == 0).all()
    assert all(math.isfinite(g) for g in scalars[scalars.tag == "train/grad_norm"].value)


@pytest.mark.slow
def test_train_a_multi_turn_verifiers_env_that_searches_the_toy_world(run_train, short_default, toy_cache, tmp_path):
    """The taskset's toolset searches the toy world (one MCP server verifiers runs for the run); the default filter
    needs mixed groups, so 4 steps taken means the rubric's rewards differ within groups."""
    scalars = train_verifiers(run_train, short_default, toy_cache, tmp_path, "vf_toy_search", ["trainer.max_steps=4"])
    value = scalars.set_index("tag").value
    assert (value["rollout/agent_errors"] == 0).all()
    assert (scalars[scalars.tag == "reward/verifiers/searched"].value > 0).all()  # the warm start searches
    grads = scalars[scalars.tag == "train/grad_norm"].value
    assert len(grads) >= 4 and all(math.isfinite(g) for g in grads) and (grads > 0).any()


@pytest.mark.slow
def test_a_verifiers_env_trains_with_lora_on_two_ranks_one_round_ahead(run_train, short_default, toy_cache, tmp_path):
    """As `env=agent` does (its rows of tests/training/test_combinations.py): LoRA, two gloo ranks (each its own engine
    process, endpoint and verifiers serving) and k = 1 together, on the transformers engine."""
    extra = ["trainer.max_steps=2", "model.lora.r=4", "trainer=ddp", "trainer.devices=2"]
    extra += ["rollout.max_staleness=1", "rollout=hf"]  # the searching taskset: mixed groups, the filter on
    scalars = train_verifiers(run_train, short_default, toy_cache, tmp_path, "vf_toy_search", extra)
    assert (scalars[scalars.tag == "rollout/agent_errors"].value == 0).all()
    grads = scalars[scalars.tag == "train/grad_norm"].value
    assert len(grads) == 2 and all(math.isfinite(g) and g > 0 for g in grads)
    assert (scalars[scalars.tag == "rollout/staleness_max"].value <= 1).all()
