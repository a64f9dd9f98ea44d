"""`env=openenv env.url=...`: an OpenEnv environment server (openenv-core, the `envs` extra) trained unchanged.

OpenEnv serves an environment as `reset` / `step(action)` over a WebSocket session, one session per episode. The
standard way to give an agent tools is its MCP actions: `list_tools` returns the tools' schemas, `call_tool` runs one
and its observation holds the result. TRL's OpenEnv recipes drive the client from a rollout function with their own
generation; here the episode is an `env.agent` (`dspo.env.external`): the policy is reached through dspo's
OpenAI-compatible endpoint, so every call is recorded by token ids and trained token for token, as the built-in loop.

One episode, mapped onto turns:
- `reset(episode_id, question, golden_answers, item_id)`: the dataset's item goes to the environment (OpenEnv's reset
  takes extra fields), so an environment can pose and judge dspo's questions; `env.send_item=false` sends only the
  episode id. The first user message is the instruction with the question (`env.instruction`, or dspo's default), or
  the reset observation's field `env.prompt_key` when the environment poses its own task.
- each model turn: every tool call is one `call_tool` step; its observation's `result` (or `error`) is the tool
  message. A turn without a call is the answer: the model's last `<answer>…</answer>` is sent as one `call_tool` step
  to `env.answer_tool` (when the environment has one), and the episode ends.
- the outcome is the reward of the step that ended the episode (`done`), else the last reward any step returned, else
  0. The endpoint's budgets (`rollout.agent.max_turns`, `max_total_tokens`) end an episode as truncated, scored on the
  rewards it got so far.

The tools are listed once, when the environment is built (a session opened and closed), and become `ProxyTool`s: the
prompt renders their schemas, and in Search-R1's tag format a tool whose one required argument is a string is called
as `<name> value </name>`. Not supported: OpenEnv actions other than MCP tool calls (a typed action such as a game
move: write its tool), observations with images, and `max_obs_tokens` (a tool's text is not cut; the endpoint's
`max_total_tokens` still bounds the episode).
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import Any

from dspo.env.environment import Environment
from dspo.env.external import ExternalReward, ProxyTool, ScoredAnswer, tool_message
from dspo.env.rewards import extract_answer


def list_tools(url: str, timeout_s: float) -> list[dict]:
    """The environment's tools (`list_tools` on a fresh session); fails naming `env.url` when no server answers."""
    from openenv.core.generic_client import GenericEnvClient

    client = GenericEnvClient(base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s).sync()
    try:
        with client:
            client.reset()
            result = client.step({"type": "list_tools"})
    except Exception as error:  # noqa: BLE001  whatever the client raises, the fix is the server or the URL
        raise ConnectionError(
            f"env.url={url}: no OpenEnv server answered list_tools ({type(error).__name__}: {error}); start the "
            "environment's server (e.g. uvicorn server.app:app --host 127.0.0.1 --port 8000) and point env.url at it"
        ) from error
    tools = result.observation.get("tools")
    if not isinstance(tools, list):
        raise ValueError(f"env.url={url}: list_tools returned no `tools` list ({result.observation!r})")
    return tools


def openenv_environment(
    url: str,
    answer_tool: str | None = "answer",
    answer_argument: str = "answer",
    prompt_key: str | None = None,
    send_item: bool = True,
    timeout_s: float = 60.0,
    instruction: str | None = None,
    max_agent_error_share: float = 0.05,
) -> Environment:
    """The `Environment` of `env=openenv`: the server's tools as proxies, the episode as `env.agent`, its reward.

    Args:
        url: the OpenEnv server (http:// or ws://).
        answer_tool: the tool the final answer is sent to (null: none; the outcome is then the steps' reward).
        answer_argument: that tool's argument holding the answer.
        prompt_key: null: the first message is the instruction with the item's question; a key: that field of the
            reset observation is.
        send_item: send the item's question, gold answers and id with `reset`.
        timeout_s: connect and per-message timeout of the OpenEnv client.
    """
    if not isinstance(url, str) or not url.startswith(("http://", "https://", "ws://", "wss://")):
        raise ValueError(f"env.url={url!r}: give the OpenEnv server's URL, e.g. env.url=http://127.0.0.1:8000")
    listed = list_tools(url, timeout_s)
    tools = {
        spec["name"]: ProxyTool(spec["name"], spec.get("description") or "", spec.get("input_schema") or {}, "openenv")
        for spec in listed
        if spec.get("name") != answer_tool
    }
    agent = functools.partial(
        openenv_episode,  # bound to this server; named as openenv_episode in the endpoint's errors (update_wrapper)
        url=url,
        answer_tool=answer_tool if any(spec.get("name") == answer_tool for spec in listed) else None,
        answer_argument=answer_argument,
        prompt_key=prompt_key,
        send_item=send_item,
        timeout_s=timeout_s,
    )
    functools.update_wrapper(agent, openenv_episode)
    return Environment(
        tools,
        ExternalReward("openenv"),
        instruction=instruction,
        agent=agent,
        max_agent_error_share=max_agent_error_share,
    )


class _Outcome:
    """The rewards an episode's steps returned: the outcome is the ending step's, else the last one seen."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.done, self.steps = False, 0

    def see(self, result: Any) -> Any:
        if result.reward is not None:
            self.last = float(result.reward)
        self.done = self.done or bool(result.done)
        return result

    @property
    def value(self) -> float:
        return self.last if self.last is not None else 0.0


def observation_text(observation: dict) -> str:
    """A `call_tool` observation as the tool message: its error, else its result; another observation as JSON."""
    error = observation.get("error")
    if error:
        return f"Error: {error.get('message', error) if isinstance(error, dict) else error}"
    if "result" in observation:
        return tool_message(observation["result"])
    return tool_message(observation)


async def openenv_episode(
    client: Any,
    item: Any,
    tools: Any,
    *,
    url: str,
    answer_tool: str | None,
    answer_argument: str,
    prompt_key: str | None,
    send_item: bool,
    timeout_s: float,
) -> ScoredAnswer:
    """One OpenEnv episode through the endpoint's `client` (module docstring)."""
    import openai
    from openenv.core.generic_client import GenericEnvClient

    schemas = [tool.schema for tool in tools.values()]
    outcome, answer = _Outcome(), None
    reset: dict[str, Any] = {"episode_id": uuid.uuid4().hex}
    if send_item:
        reset.update(question=item.question, golden_answers=list(item.golden_answers), item_id=item.id)
    async with GenericEnvClient(base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s) as env:
        first = outcome.see(await env.reset(**reset))
        prompt = tools.instruction if prompt_key is None else tool_message(first.observation.get(prompt_key, ""))
        messages: list[dict] = [{"role": "user", "content": prompt}]
        while not outcome.done:
            try:
                reply = await client.chat.completions.create(model="policy", messages=messages, tools=schemas)
            except openai.BadRequestError:  # the endpoint's budget is spent: truncated, scored on what it got
                break
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = extract_answer(message.content or "")
                if answer_tool is not None and answer is not None:
                    action = {"type": "call_tool", "tool_name": answer_tool, "arguments": {answer_argument: answer}}
                    outcome.see(await env.step(action))
                break
            for call in message.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    arguments = {"raw": call.function.arguments}  # the model's text: the environment answers it
                action = {"type": "call_tool", "tool_name": call.function.name, "arguments": arguments}
                result = outcome.see(await env.step(action))
                outcome.steps += 1
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": observation_text(result.observation)}
                )
                if outcome.done:
                    break
    return ScoredAnswer(answer, outcome.value, {"openenv/done": float(outcome.done), "openenv/steps": outcome.steps})
