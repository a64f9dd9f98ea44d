"""An OpenEnv environment written with openenv-core's public API, as its echo example is (an `Environment` that answers
`list_tools` and `call_tool`), whose tool searches the toy world; served locally by uvicorn, no container.

`search(query)` answers with dspo's own search tool's text (so that an episode reads what the built-in loop's would),
`answer(answer)` ends the episode, paid 1 when a gold answer (sent with `reset`) is a substring of it (subEM)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_types import (
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    Tool,
    ToolError,
    ToolErrorType,
)
from openenv.core.env_server.types import Observation, State

from dspo.env.rewards import subem_reward
from dspo.env.tools import CallContext, InvalidCall

SEARCH = Tool(
    name="search",
    description="Search the toy world's encyclopedia.",
    input_schema={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
)
ANSWER = Tool(
    name="answer",
    description="Give the final answer.",
    input_schema={"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
)


class QuestionObservation(Observation):
    question: str = ""


def toy_environment(search_tool: Any) -> type:
    """An Environment class (the server builds one per session) over `search_tool` (a dspo SearchTool)."""

    class ToyWorldEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True
        answers: list = []  # every answer step, for the tests: (question, answer, reward)

        def __init__(self) -> None:
            super().__init__()
            self._state, self.gold, self.question = State(step_count=0), [], ""

        def reset(self, seed=None, episode_id=None, question="", golden_answers=(), **kwargs) -> QuestionObservation:
            self._state = State(episode_id=episode_id, step_count=0)
            self.question, self.gold = question, list(golden_answers)
            return QuestionObservation(question=question)

        def step(self, action, timeout_s=None, **kwargs) -> Observation:
            self._state.step_count += 1
            if isinstance(action, ListToolsAction):
                return ListToolsObservation(tools=[SEARCH, ANSWER])
            if not isinstance(action, CallToolAction):
                raise ValueError(f"unexpected action {action!r}")
            if action.tool_name == "answer":
                reward = subem_reward(str(action.arguments.get("answer", "")), self.gold)
                type(self).answers.append((self.question, action.arguments.get("answer"), reward))
                return CallToolObservation(tool_name="answer", result="recorded", done=True, reward=reward)
            try:
                call = search_tool.prepare(action.arguments)
            except InvalidCall as invalid:
                error = ToolError(error_type=ToolErrorType.INVALID_ARGS, message=invalid.message)
                return CallToolObservation(tool_name=action.tool_name, result=None, error=error)
            (result,) = search_tool.run([call], [CallContext(item=None, turn=0, episode_index=0)])
            return CallToolObservation(tool_name="search", result=result.text)

        @property
        def state(self) -> State:
            return self._state

    return ToyWorldEnv


@contextlib.contextmanager
def serve(search_tool: Any, sessions: int = 256) -> Iterator[tuple[str, type]]:
    """The toy OpenEnv server on 127.0.0.1 (a free port) in a thread: (its URL, its environment class)."""
    env_class = toy_environment(search_tool)
    app = create_app(env_class, CallToolAction, CallToolObservation, env_name="toy_world", max_concurrent_envs=sessions)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the toy OpenEnv server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", env_class
    finally:
        server.should_exit = True
        thread.join(timeout=10)
