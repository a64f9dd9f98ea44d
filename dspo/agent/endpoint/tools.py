"""The environment's tools as the user's agent sees them (async callables taking the tool's arguments as keywords),
and the batched run of the calls that many episodes queued at once: one `run` per tool, as the built-in loop's turn.

A call whose arguments do not fit the tool (`prepare` raises `InvalidCall`) returns the tool's message as its text and
is counted as invalid, as a malformed call of the built-in loop is; a tool that fails is a counted tool error
(`dspo.agent.accounting`). As in the built-in loop, a tool's text is cut to `max_obs_tokens` tokens and, when the
episode has one call left, ends with the note that says so (`LAST_TURN_NOTE`: budgets are the environment's to tell).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from dspo.agent import parsing
from dspo.agent.accounting import run_tool_batch
from dspo.agent.config import AgentConfig
from dspo.agent.endpoint.episodes import Episode
from dspo.agent.endpoint.scheduler import Work
from dspo.env.prompting import LAST_TURN_NOTE
from dspo.env.tools import CallContext, InvalidCall, carried

Submit = Callable[[str, dict], Awaitable[str]]


class AgentTool:
    """`await tool(**arguments)` -> the tool's text. `schema` is its OpenAI function schema (pass a list of them as
    `tools=` to the chat API), `name` and `description` its own."""

    def __init__(self, tool: Any, submit: Submit) -> None:
        self.name, self.description = tool.name, tool.description
        self.schema = tool.schema()
        self._submit = submit

    async def __call__(self, **arguments: Any) -> str:
        return await self._submit(self.name, arguments)

    def __repr__(self) -> str:
        return f"AgentTool({self.name!r})"


class EpisodeTools(Mapping[str, AgentTool]):
    """The tools of one episode, by name. `instruction` is the first user message the built-in agent would send for
    this question (`env.instruction`, or dspo's default for `rollout.agent.tag_format`, with the question filled in)."""

    def __init__(self, tools: Mapping[str, Any], submit: Submit, instruction: str = "") -> None:
        self._tools = {name: AgentTool(tool, submit) for name, tool in tools.items()}
        self.instruction = instruction

    def __getitem__(self, name: str) -> AgentTool:
        if name not in self._tools:
            raise KeyError(f"no tool {name!r} in this environment (tools: {sorted(self._tools)})")
        return self._tools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)


def run_tool_work(
    batch: list[Work], episodes: list[Episode], tools: Mapping[str, Any], tokenizer: Any, config: AgentConfig
) -> None:
    """Answer every queued tool call of `batch`: one batched run per tool over the valid calls."""
    valid: dict[str, list[tuple[Work, dict]]] = {}
    for work in batch:
        name, arguments = work.payload
        episode = episodes[work.episode]
        tool = tools.get(name)
        if tool is None:
            episode.invalid[(parsing.NO_TOOL, parsing.UNKNOWN_TOOL)] += 1
            work.answer(f"Error: unknown tool {name!r}; the tools are {sorted(tools)}.")
            continue
        try:
            valid.setdefault(name, []).append((work, parsing.prepare_call(tool, arguments)))
        except InvalidCall as invalid:
            episode.invalid[(name, invalid.kind)] += 1
            work.answer(invalid.message)
    replies: list[tuple[Work, str]] = []
    for name, calls in valid.items():
        contexts = [
            CallContext(
                episodes[w.episode].item,
                max(len(episodes[w.episode].calls) - 1, 0),
                w.episode,
                list(episodes[w.episode].turns),
            )
            for w, _ in calls
        ]
        results = run_tool_batch(tools[name], [arguments for _, arguments in calls], contexts)
        for (work, arguments), result in zip(calls, results):
            episode = episodes[work.episode]
            episode.record_tool(name, arguments, result)
            last_turn = len(episode.calls) - 1 == config.max_turns - 2
            replies.append((work, result.text + (LAST_TURN_NOTE if last_turn else "")))
    texts = _cut([text for _, text in replies], tokenizer, config.max_obs_tokens)
    for (work, _), text in zip(replies, texts):  # answered together: an episode woken early would compete for the GIL
        work.answer(text)


def _cut(texts: list[str], tokenizer: Any, max_tokens: int) -> list[str]:
    """Each text cut to `max_tokens` tokens (one batched tokenizer call)."""
    if not texts:
        return []
    texts = [carried(text) for text in texts]  # what a tool echoed may not be encodable
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens]) for text, ids in zip(texts, encoded)]
