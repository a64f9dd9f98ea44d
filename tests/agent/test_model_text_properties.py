"""Issue 53 (3): text the model writes that no tokenizer, HTTP body or UTF-8 can carry is an invalid call, counted,
never an exception, along the whole path: the model's text -> the parsed call -> the tool (the built-in search tool
over a local retriever and over the remote retriever's HTTP client) -> its answer, or a compaction note, tokenized
into the context. JSON's `"\\ud800"` decodes to a lone surrogate (the tokenizer raised TypeError on the echoed query,
httpx UnicodeEncodeError on the request); `"\\u0000"` to NUL."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dspo.agent import AgentConfig
from dspo.agent.tool_calling import ToolCallingAgent
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment
from dspo.env.tools import BAD_CHARACTERS
from dspo.search.client import RemoteRetriever
from dspo.types import Passage, QAItem

ITEM = QAItem(id="q", question="Capital of France?", golden_answers=["Paris"])
PASSAGES = [Passage("1", "Paris", "Paris is the capital of France."), Passage("2", "Seine", "The Seine flows.")]
BAD = ["\ud800", "\udfff", "\x00", "a\udc80b"]


class Local:
    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        return [PASSAGES[:k] for _ in queries]


def remote() -> RemoteRetriever:
    """The HTTP client as a run uses it (its JSON encoding included), answered in memory."""

    def answer(request: httpx.Request) -> httpx.Response:
        queries = json.loads(request.content)["queries"]
        hit = {"document": {"id": "1", "contents": '"Paris"\nParis is the capital of France.'}, "score": 1.0}
        return httpx.Response(200, json={"result": [[hit] for _ in queries]})

    return RemoteRetriever(
        "http://search.test/retrieve", backoff_s=0.0, max_backoff_s=0.0, transport=httpx.MockTransport(answer)
    )


def rollout(qwen_tokenizer, turns: list[str], retriever, **config):
    def script(prompt: str, turn: int, index: int) -> str:
        return turns[turn] if turn < len(turns) else "<answer> Paris </answer>"

    settings_ = {"max_turns": len(turns) + 1, "max_new_tokens_per_turn": 64, **config}
    agent = ToolCallingAgent(
        ScriptedEngine(qwen_tokenizer, script), qwen_tokenizer, Environment.search(retriever, topk=1),
        AgentConfig(**settings_),
    )  # fmt: skip
    return agent.rollout([ITEM], group_size=1, policy_version=0)


def qwen_call(arguments) -> str:
    """A call as the model writes it: JSON text, non-ASCII as `\\uXXXX` escapes (how a lone surrogate gets in)."""
    return "<tool_call>\n" + json.dumps({"name": "search", "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.parametrize("retriever", ["local", "remote"])
@pytest.mark.parametrize("overflow", ["end", "compact"])
def test_the_reviews_lone_surrogate_is_a_counted_invalid_call(qwen_tokenizer, retriever, overflow) -> None:
    """The trigger, verbatim: `{"query_list": ["\\ud800", "x"]}`. Before: TypeError out of the tokenizer (the query
    echoed in the answer, or in the compaction note), or, remotely, a tool error for the whole turn's batch."""
    text = '<tool_call>\n{"name": "search", "arguments": {"query_list": ["\\ud800", "x"]}}\n</tool_call>'
    result = rollout(qwen_tokenizer, [text], Local() if retriever == "local" else remote(), overflow=overflow)
    assert result.stats[f"invalid/search/{BAD_CHARACTERS}"] == 1.0
    assert not [key for key, value in result.stats.items() if "tool_error" in key and value]


unicode_text = st.lists(st.text(max_size=6) | st.sampled_from(BAD), max_size=4).map("".join)
arguments = st.one_of(
    st.fixed_dictionaries({"query_list": st.lists(unicode_text, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"query": unicode_text}),
    st.dictionaries(unicode_text, unicode_text | st.lists(unicode_text, max_size=2), max_size=2),
)


def strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings(k) + strings(v)]
    return [s for v in value for s in strings(v)] if isinstance(value, list) else []


def carriable(value) -> bool:
    return not any("\x00" in s or any(0xD800 <= ord(c) <= 0xDFFF for c in s) for s in strings(value))


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(arguments, min_size=1, max_size=3), st.sampled_from(["end", "compact"]), st.booleans())
@example([{"query_list": ["\ud800", "x"]}], "compact", False)
@example([{"query": "\x00"}], "end", True)
def test_any_call_reaches_the_tokenized_context_or_is_counted(qwen_tokenizer, calls, overflow, is_remote) -> None:
    """Whatever strings the model's JSON holds: the rollout returns, every call the tools could not carry is counted
    as `bad_characters`, none as a tool error. A tight budget makes `compact` write notes of the earlier calls."""
    budget = {"max_total_tokens": 400, "max_obs_tokens": 40} if overflow == "compact" else {}
    result = rollout(
        qwen_tokenizer, [qwen_call(a) for a in calls], remote() if is_remote else Local(), overflow=overflow, **budget
    )
    bad = sum(not carriable(a) for a in calls)
    trajectory = result.groups[0].trajectories[0]
    assert result.stats.get(f"invalid/search/{BAD_CHARACTERS}", 0.0) == bad or trajectory.truncated
    assert not [key for key, value in result.stats.items() if "tool_error" in key and value]


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.text(max_size=12) | st.just("\x00"), min_size=1, max_size=3).map("".join))
def test_a_searchr1_query_with_nul_is_counted(qwen_tokenizer, query) -> None:
    result = rollout(qwen_tokenizer, [f"<search> {query} </search>"], Local(), tag_format="searchr1")
    if "\x00" in query:
        assert result.stats[f"invalid/search/{BAD_CHARACTERS}"] == 1.0
