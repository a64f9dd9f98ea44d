"""A verifiers (v1) harness that runs its chat loop in-process: `--env.agent.harness.id dspo.env.verifiers_harness`.

verifiers' own tool-less loop (`null`) and its `bash` loop launch a standalone chat program as a PEP 723 script,
provisioned with `uv sync --script` (it downloads `uv` and the script's requirements). dspo trains offline and in one
venv, so this harness follows the contract verifiers states for `Harness.launch`: "a harness may run its loop
in-process instead of launching a program, as long as every model call goes through `endpoint` + `secret`". Every
call reaches verifiers' interception server, which records it on the trace (the rubric reads it) and forwards it to
the client the rollout names: dspo's OpenAI-compatible endpoint, which records it by token ids.

The loop is the chat program's: the prompt (a string, or Messages), the task's MCP tools as functions, and calls
answered by the tools until a reply has none or `max_turns` replies were made. A tool's error is its result text.
"""

from __future__ import annotations

import json
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.runtimes import ProgramResult

__all__ = ["InProcessHarness"]


class InProcessHarnessConfig(HarnessConfig):
    max_turns: int = 8
    """Model replies per launch (each one call through the interception)."""


def _wire(message: Any) -> dict:
    """A vf `Message` (or a dict) as an OpenAI chat message."""
    from verifiers.v1.dialects.chat import message_to_wire

    return message if isinstance(message, dict) else message_to_wire(message)


async def _mcp_tools(mcp_urls: dict[str, str], stack: Any) -> tuple[list[dict], dict[str, Any]]:
    """The tools of the task's MCP servers as OpenAI function schemas, and {tool name: the client that runs it}."""
    if not mcp_urls:
        return [], {}
    from fastmcp import Client

    schemas, owners = [], {}
    for url in mcp_urls.values():
        client = await stack.enter_async_context(Client(url))
        for tool in await client.list_tools():
            schemas.append(
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description or "",
                        "parameters": _schema(tool),
                    },
                }
            )
            owners[tool.name] = client
    return schemas, owners


def _schema(tool: Any) -> dict:
    """A listed tool's input schema (MCP SDK 2 names it `input_schema`, 1 `inputSchema`)."""
    schema = getattr(tool, "input_schema", None) or tool.__dict__.get("inputSchema")
    return schema or {"type": "object", "properties": {}}


async def _call(owners: dict[str, Any], name: str, arguments: str) -> str:
    client = owners.get(name)
    if client is None:
        return f"Error: unknown tool {name!r}; the tools are {sorted(owners)}."
    try:
        parsed = json.loads(arguments or "{}")
        result = await client.call_tool(name, parsed, raise_on_error=False)
    except Exception as error:  # noqa: BLE001  the model sees the failure, as the chat program shows it
        return f"Error: {type(error).__name__}: {error}"
    texts = [getattr(part, "text", None) or str(part) for part in (result.content or [])]
    return "\n".join(texts)


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        import contextlib

        import openai

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(_wire(message) for message in prompt)
        async with contextlib.AsyncExitStack() as stack:
            schemas, owners = await _mcp_tools(mcp_urls, stack)
            client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            stack.push_async_callback(client.close)
            for _ in range(self.config.max_turns):
                try:
                    reply = await client.chat.completions.create(
                        model=ctx.model, messages=messages, **({"tools": schemas} if schemas else {})
                    )
                except openai.APIStatusError as error:  # a budget or a @stop refused the turn: the rollout ends
                    return ProgramResult(exit_code=0, stdout="", stderr=str(error)[:2000])
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    text = await _call(owners, call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        return ProgramResult(exit_code=0, stdout="", stderr="")
