"""`env=verifiers env.id=<taskset> env.args={...}`: an installed verifiers (v1) environment trained unchanged.

verifiers 0.4 (the `envs` extra) is its v1 stack: a `Taskset` yields `Task`s (prompt + data), an `Env` plays a task
with agents whose `Harness` runs the chat loop, every model call goes through verifiers' interception server (which
records it on the episode's `Trace`), and the task's `@reward` functions (a rubric, a judge) score the trace. prime-rl
trains it by pointing the episode's client at its own inference server and taking the trace's reward; dspo does the
same through its OpenAI-compatible endpoint: the episode is an `env.agent` (`dspo.env.external`), the rollout's
client is the endpoint URL of that episode, so every call is recorded by token ids (prefix breaks split samples as
for any endpoint agent), and the outcome is `trace.reward`, each `@reward` logged as `reward/verifiers/<name>`.

What maps to what:
- `env.id`: the taskset's id (an importable module exporting its `Taskset`, as `vf-eval` takes it); `env.args`: its
  `TasksetConfig` fields. The tasks are the prompts (`data=verifiers`, `dspo.data.verifiers`): an item carries the
  task's index, and the episode plays that task.
- the harness: `dspo.env.verifiers_harness` (an in-process chat loop; verifiers' own `null` / `bash` loops install a
  uv script, which needs the network), on verifiers' local `subprocess` runtime, so a task's MCP tool servers run as
  local processes. `env.max_turns` bounds its replies; `rollout.agent.max_turns` bounds the endpoint's calls.
- sampling is the trainer's (the endpoint replaces a temperature the environment sets).
Not supported: container or hosted runtimes (docker, prime, modal, e2b), harnesses that launch third-party programs,
multi-agent envs whose other seats are not the policy (every call is trained as the policy's), and `env.reward.credit=
turn`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from dspo.env.environment import Environment
from dspo.env.external import ExternalReward, ProxyTool, ScoredAnswer

METADATA_KEY = "verifiers"
HARNESS = "dspo_in_process"  # verifiers imports a harness id as verifiers.v1.harnesses.<id> or a top-level module
KEY_VAR = "DSPO_VERIFIERS_ENDPOINT_KEY"  # verifiers reads a client's key from an environment variable


@functools.lru_cache(maxsize=8)
def _load(taskset_id: str, args_json: str, max_turns: int) -> Any:
    import json

    return build(taskset_id, json.loads(args_json), max_turns)


def build(taskset_id: str, args: Mapping, max_turns: int = 8) -> Any:
    """A fresh verifiers `Env` of the taskset on the in-process harness and the local runtime (`load` caches one)."""
    import sys

    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import load_environment

    from dspo.env import verifiers_harness

    # a dotted id cannot name it (verifiers looks up `verifiers.v1.harnesses.<id>` first, whose parent must exist), so
    # it is registered under the harness package, where verifiers' loader finds its own
    sys.modules.setdefault(f"verifiers.v1.harnesses.{HARNESS}", verifiers_harness)
    config = vf.SingleAgentEnvConfig(
        taskset={"id": taskset_id, **dict(args)},
        agent={"harness": {"id": HARNESS, "max_turns": max_turns}, "runtime": {"type": "subprocess"}},
    )
    return load_environment(config)


def plain(args: Any) -> dict:
    """`env.args` as plain JSON values (Hydra passes nested config nodes)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(args, DictConfig):
        return OmegaConf.to_container(args, resolve=True)  # type: ignore[return-value]
    return dict(args or {})


def load(taskset_id: str, args: Mapping | None = None, max_turns: int = 8) -> Any:
    """The verifiers `Env` of `env.id` + `env.args` (one per process), failing naming the keys."""
    import json
    import logging

    # verifiers logs every rollout, and its interception server (aiohttp) every request, at INFO: a round of training
    # would print hundreds of lines into train.log
    for name in ("verifiers", "aiohttp.access"):
        logging.getLogger(name).setLevel(max(logging.getLogger(name).getEffectiveLevel(), logging.WARNING))
    args = plain(args)
    if not taskset_id:
        raise ValueError("env.id is empty: name the verifiers taskset, e.g. env.id=my_taskset (an importable module)")
    try:
        return _load(taskset_id, json.dumps(dict(args or {}), sort_keys=True), int(max_turns))
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise ValueError(
            f"env.id={taskset_id} env.args={dict(args or {})}: verifiers could not load it: {error}"
        ) from error


def tasks(env: Any) -> list[Any]:
    """The taskset's tasks in order (bounded tasksets only: dspo samples its prompts itself), listed once per env:
    an episode looks its task up by index, and a taskset may read a file to list them."""
    if not env.taskset.bounded:
        raise ValueError(f"env.id: taskset {type(env.taskset).__name__} is infinite; bound it with its own config")
    listed = getattr(env, "_dspo_tasks", None)
    if listed is None:
        listed = env._dspo_tasks = list(env.taskset)
    return listed


def verifiers_environment(
    id: str,  # noqa: A002  the key verifiers calls it by
    args: Mapping | None = None,
    max_turns: int = 8,
    instruction: str | None = None,
    max_agent_error_share: float = 0.05,
) -> Environment:
    """The `Environment` of `env=verifiers`: no dspo tool (the task's own run in verifiers), the episode as
    `env.agent`, and the trace's reward as the outcome."""
    args = plain(args)
    env = load(id, args, max_turns)  # fail at build time, naming the keys
    agent = functools.partial(verifiers_episode, taskset_id=id, args=args, max_turns=max_turns)
    functools.update_wrapper(agent, verifiers_episode)
    return Environment(
        proxy_tools(env),
        ExternalReward(METADATA_KEY),
        instruction=instruction,
        agent=agent,
        max_agent_error_share=max_agent_error_share,
    )


def proxy_tools(env: Any) -> dict[str, ProxyTool]:
    """The tools the task's toolsets serve, for the prompt and the parser (`dspo.env.external.ProxyTool`): listed by
    registering each toolset on an in-process MCP server, as verifiers' own server registers them, without serving."""
    import asyncio

    from mcp.server.mcpserver import MCPServer

    probe = MCPServer("dspo-probe")
    shared = type(env.taskset).toolsets(env.taskset.config)  # taskset-scoped: one server for every episode
    for toolset in [*shared, *env._task_cls.toolsets(env.taskset.config.task)]:
        toolset.register(probe)
    listed = asyncio.run(probe.list_tools())
    return {t.name: ProxyTool(t.name, t.description or "", t.input_schema or {}, "verifiers") for t in listed}


async def serving(env: Any) -> None:
    """Hold `env.serving()` (its interception server and the taskset's shared tool servers) open for the rest of this
    event loop's life, entered once: the endpoint runs every episode on one long-lived loop, `serving()` keeps its
    resources on the env object (concurrent episodes each entering it would replace each other's), and starting the
    interception per episode would cost a server per call. A loop the endpoint leaves behind keeps its own until
    exit."""
    import asyncio
    import contextlib
    import weakref

    per_loop = getattr(env, "_dspo_serving", None)
    if per_loop is None:
        per_loop = env._dspo_serving = weakref.WeakKeyDictionary()  # a loop left behind takes its entry with it
    loop = asyncio.get_running_loop()
    entry = per_loop.get(loop)
    if entry is None:
        entry = per_loop[loop] = {"lock": asyncio.Lock(), "stack": None}
    async with entry["lock"]:
        if entry["stack"] is None:
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(env.serving())
            entry["stack"] = stack


def trace_score(trace: Any) -> tuple[float, dict[str, float]]:
    """A trace's reward (verifiers' weighted sum) and each reward function's score, as dspo logs them."""
    parts = {f"verifiers/{name}": float(r.score) for name, r in trace.rewards.items() if r is not None}
    return float(trace.reward), parts


def _context(client: Any) -> Any:
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.configs.client import EvalClientConfig

    os.environ[KEY_VAR] = client.api_key  # read by verifiers' client; the run's key, never logged
    return ModelContext(client=EvalClientConfig(base_url=str(client.base_url), api_key_var=KEY_VAR), model="policy")


async def verifiers_episode(client: Any, item: Any, tools: Any, *, taskset_id: str, args: dict, max_turns: int) -> str:
    """One verifiers episode of the item's task, through the endpoint's `client` (module docstring)."""
    from verifiers.v1.env import RunSlot

    env = load(taskset_id, args, max_turns)
    source = item.metadata.get(METADATA_KEY)
    if not isinstance(source, Mapping):
        raise ValueError(f"env=verifiers plays verifiers tasks: question {item.id!r} has no metadata.{METADATA_KEY}")
    task = tasks(env)[int(source["index"])]
    await serving(env)
    episode = await env.run_slot(RunSlot(task), _context(client))
    if not episode.traces:
        raise RuntimeError(f"verifiers ran no agent on task {source['index']}: {episode.errors}")
    trace = episode.traces[-1]
    reward, parts = trace_score(trace)
    reply = trace.messages[-1].content if trace.messages else ""
    return ScoredAnswer(reply if isinstance(reply, str) else "", reward, parts)


def task_items(env: Any, benchmark: str) -> list[Any]:
    """Each task as a `QAItem`: its prompt's text as the question, its data's `answer` (if it has one) as the gold
    (for validation's subEM; the reward is the environment's), and its index, which the episode plays."""
    from dspo.types import QAItem

    items = []
    for index, task in enumerate(tasks(env)):
        prompt = task.data.prompt
        if not isinstance(prompt, str):  # Messages: the last user message is the question
            users = [m for m in prompt or [] if getattr(m, "role", None) == "user"]
            prompt = users[-1].content if users else ""
        answer = getattr(task.data, "answer", None)
        items.append(
            QAItem(
                id=f"{benchmark}-{index}",
                question=str(prompt),
                golden_answers=[str(answer)] if answer not in (None, "") else [],
                benchmark=benchmark,
                metadata={METADATA_KEY: {"index": index}},
            )
        )
    return items
