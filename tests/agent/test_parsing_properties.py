"""Issue 39 (3): what the model writes is data. Random text and random JSON, in both tag formats, go through tool-call
parsing, the answer extraction and every shipped reward's `score`: each returns, never raises, and every invalid call
has a kind the agent counts (`rollout/invalid/<tool>/<kind>`). Example counts stay small (the suite's time budget)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dspo.agent import parsing
from dspo.env import SearchTool, SubEMReward
from dspo.env.rewards import EpisodeRecord, TurnRecord, extract_answer
from dspo.env.search_rewards import IkeaReward, StepSearchReward
from dspo.env.search_tool import EMPTY_QUERY, QUERY_TOO_LONG, TOO_MANY_QUERIES
from dspo.env.tools import BAD_ARGUMENTS, BAD_CHARACTERS, Tool, ToolResult
from dspo.toy.sources import SourceAwareSubEM
from dspo.types import Passage, QAItem

# derandomized, no example database: the same examples on every run and machine, nothing written into the checkout
FAST = settings(
    max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


class Pick(Tool):
    """A tool with the schema features `check_arguments` handles: an enum, an integer, an array of strings."""

    name, tag_argument = "pick", "choice"
    parameters = {
        "type": "object",
        "properties": {
            "choice": {"type": "string", "enum": ["a", "b"]},
            "n": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["choice"],
    }


TOOLS = {"search": SearchTool(retriever=None, max_queries_per_call=2, max_query_chars=30), "pick": Pick()}
KINDS = {
    parsing.MISSING_OPEN_TAG,
    parsing.INVALID_JSON,
    parsing.NOT_AN_OBJECT,
    parsing.UNKNOWN_TOOL,
    parsing.TOO_DEEP,
    BAD_ARGUMENTS,
    BAD_CHARACTERS,
    EMPTY_QUERY,
    TOO_MANY_QUERIES,
    QUERY_TOO_LONG,
}
REWARDS = [
    SubEMReward(),
    SubEMReward(max_answer_words=3),
    StepSearchReward(credit="turn"),
    IkeaReward(),
    SourceAwareSubEM(sources={"search": ("person", "company", "city", "country", "river", "landmark")}),
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
names = st.sampled_from(["search", "pick", "calc"]) | json_values
tag_words = st.sampled_from(
    ["<tool_call>", "</tool_call>", "<search>", "</search>", "<pick>", "</pick>", "<answer>", "</answer>", "{", "["]
)
model_text = st.lists(st.text(max_size=30) | tag_words, max_size=12).map("".join)


def assert_counted(call: parsing.ParsedCall) -> None:
    assert isinstance(call, parsing.ParsedCall) and isinstance(call.tool, str)
    hash((call.tool, call.error_kind))  # the agent's Counter key
    if call.ok:
        assert call.tool in TOOLS and isinstance(call.arguments, dict)
    else:
        assert call.error_kind in KINDS and isinstance(call.error, str) and call.error.startswith("Error")


def parse_everyway(text: str) -> list[parsing.ParsedCall]:
    calls = [parsing.parse_call(text, TOOLS, "qwen", parsing.QWEN_CLOSE)]
    calls += [parsing.parse_call(text, TOOLS, "searchr1", c) for c in parsing.call_closes(TOOLS, "searchr1")]
    return calls


@FAST
@given(model_text)
@example('<tool_call>{"name": ["search"]}</tool_call>')  # an unhashable name (a TypeError before)
@example("<tool_call>" + "[" * 100_000 + "</tool_call>")  # deeper than the decoder's recursion (RecursionError)
@example('<tool_call>{"name": "search", "arguments": "' + "[" * 100_000 + '"}</tool_call>')
@example("<tool_call>" + "9" * 5000 + "</tool_call>")  # past Python's digit limit (a ValueError, no JSONDecodeError)
def test_random_text_parses_to_a_call_or_a_counted_invalid_call(text: str) -> None:
    for call in parse_everyway(text):
        assert_counted(call)


@FAST
@given(names, json_values, st.sampled_from(["", "<think>x</think>", "<tool_call>{}</tool_call>"]))
@example(["search"], {"query_list": ["a"]}, "")
@example("search", [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], "")
def test_random_json_calls_in_both_formats(name, arguments, before: str) -> None:
    body = json.dumps({"name": name, "arguments": arguments})
    for call in parse_everyway(f"{before}<tool_call>{body}</tool_call>"):
        assert_counted(call)
    for tool in ("search", "pick"):
        text = json.dumps(arguments) if not isinstance(arguments, str) else arguments
        assert_counted(parsing.parse_call(f"{before}<{tool}>{text}</{tool}>", TOOLS, "searchr1", f"</{tool}>"))


@FAST
@given(model_text)
@example("<answer>Lyon <answer>Paris</answer>")
@example("<answer>" * 10_000 + "</answer>")
def test_the_answer_extraction_returns_text_or_none(text: str) -> None:
    answer = extract_answer(text)
    assert answer is None or isinstance(answer, str)
    for reward in REWARDS:
        assert reward.extract_answer(text) == answer


passages = st.builds(Passage, id=st.text(max_size=5), title=st.text(max_size=15), text=st.text(max_size=15))
results = st.none() | st.builds(
    ToolResult, text=st.text(max_size=20), passages=st.lists(passages, max_size=3), error=st.none() | st.text()
)


@st.composite
def episodes(draw) -> EpisodeRecord:
    turns = []
    for text in draw(st.lists(model_text, min_size=1, max_size=4)):
        call = parsing.parse_call(text, TOOLS, "qwen", parsing.QWEN_CLOSE)
        turns.append(
            TurnRecord(
                text=text,
                call=(call.tool, call.arguments) if call.ok else None,
                invalid=call.error_kind,
                result=draw(results) if call.ok else None,
            )
        )
    chain = draw(st.lists(st.text(max_size=10), min_size=1, max_size=3))
    metadata = {
        "supporting_titles": draw(st.lists(st.text(max_size=10), max_size=3) | st.text(max_size=10)),
        "chain": chain,
        "entity_type": "person",
        "relations": draw(st.lists(st.sampled_from(["born_in", "founded_by", "country", "capital"]), min_size=2)),
    }
    golds = draw(st.lists(st.text(max_size=12), min_size=1, max_size=3))
    item = QAItem(id="q", question=draw(st.text(max_size=20)), golden_answers=golds, metadata=metadata)
    answer = extract_answer("".join(turn.text for turn in turns))
    return EpisodeRecord(item=item, turns=turns, answer=answer, truncated=draw(st.booleans()))


@FAST
@given(st.lists(episodes(), min_size=1, max_size=3))
def test_every_shipped_reward_scores_random_episodes(batch: list[EpisodeRecord]) -> None:
    for reward in REWARDS:
        scored = reward.score(batch)
        assert len(scored) == len(batch)
        for episode, result in zip(batch, scored):
            assert result.outcome in (0.0, 1.0) and isinstance(result.total, float)
            assert not result.step_rewards or len(result.step_rewards) == len(episode.turns)
