"""`rollout.agent.overflow: compact` (dspo.agent.compaction): notes, rewriting, and the agent's samples, each model
token trained once in the context it was sampled from, on the real Qwen2.5 chat template."""

from __future__ import annotations

import json

import pytest

from dspo.agent import AgentConfig
from dspo.agent.compaction import Spliced, choose, compaction_note, rewrite
from dspo.agent.tool_calling import ToolCallingAgent
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment
from dspo.env.rewards import SubEMReward, TurnRecord
from dspo.env.tools import ToolResult
from dspo.types import Passage, QAItem

PARIS = QAItem(id="q1", question="What is the capital of France?", golden_answers=["Paris"])
QUERIES = ["capital of France", "Eiffel Tower city", "largest city of France"]


def search(query: str) -> str:
    body = json.dumps({"name": "search", "arguments": {"query_list": [query]}})
    return f"<think>I should search.</think>\n<tool_call>\n{body}\n</tool_call>"


ANSWER = "<think>Found it.</think>\n<answer> Paris </answer>"


def three_searches(prompt_text: str, turn: int, index: int) -> str:
    """Searches until three tool responses are in the context (compacted or not), then answers: the scripted
    trajectory index restarts when a compacted context does not extend the engine's history, the context does not."""
    seen = prompt_text.count("<tool_response>")
    return search(QUERIES[seen]) if seen < len(QUERIES) else ANSWER


class RecordingEngine(ScriptedEngine):
    """Scripted turns with distinct logprobs per generated token; remembers each prompt and what followed it."""

    def __init__(self, tokenizer, script) -> None:
        super().__init__(tokenizer, script)
        self.seen: list[tuple[list[int], list[int], list[float]]] = []

    def generate(self, prompts, sampling):
        out = super().generate(prompts, sampling)
        for prompt, gen in zip(prompts, out):
            gen.logprobs = [-0.001 * (len(self.seen) + 1) - 1e-6 * i for i in range(len(gen.token_ids))]
            self.seen.append((list(prompt), list(gen.token_ids), list(gen.logprobs)))
        return out


def rollout(tokenizer, retriever, **limits):
    engine = RecordingEngine(tokenizer, three_searches)
    config = AgentConfig(**{"max_turns": 5, "max_new_tokens_per_turn": 48, **limits})
    agent = ToolCallingAgent(engine, tokenizer, Environment.search(retriever, topk=2), config)
    result = agent.rollout([PARIS], group_size=1, policy_version=0)
    return result, result.groups[0].trajectories[0], engine


# ------------------------------------------------------------------------------------------------ pure functions
def test_rewrite_replaces_spans_and_moves_positions_by_hand() -> None:
    ids = list(range(10))  # replace [2, 5) by [90] (-2) and [7, 9) by [91, 92, 93] (+1)
    new = rewrite(ids, [(7, 9, [91, 92, 93]), (2, 5, [90])])
    assert new.response_ids == [0, 1, 90, 5, 6, 91, 92, 93, 9]
    assert new.response_mask == [0] * 9 and new.logprobs == [0.0] * 9
    assert [new.moved(p) for p in (0, 1, 5, 6, 9, 10)] == [0, 1, 3, 4, 8, 9]
    with pytest.raises(ValueError, match="overlap"):
        rewrite(ids, [(2, 5, []), (4, 6, [])])


def test_choose_takes_the_oldest_that_free_tokens_until_enough() -> None:
    notes = {"a": 3, "b": 3, "c": 20, "d": 3}
    spliced = [
        Spliced(0, 10, "a", compacted=True),  # already a note
        Spliced(20, 30, "b"),  # frees 7
        Spliced(40, 50, "c"),  # its note is longer: frees nothing
        Spliced(60, 70, "d"),  # frees 7
        Spliced(80, 90, "b"),
    ]
    ids = lambda obs: [0] * notes[obs.note]  # noqa: E731
    assert [o.start for o in choose(spliced, ids, 5)] == [20]
    assert [o.start for o in choose(spliced, ids, 8)] == [20, 60]
    assert [o.start for o in choose(spliced, ids, 100)] == [20, 60, 80]  # all that free any
    assert choose(spliced, ids, 0) == []


def test_note_names_the_queries_and_the_titles_once() -> None:
    passages = [Passage("1", "Paris", "x"), Passage("2", "France", "y"), Passage("3", "Paris", "z")]
    turn = TurnRecord(text="", call=("search", {"query_list": ["a  b\nc"]}), result=ToolResult("...", passages))
    assert compaction_note(turn) == '(search "a b c": Paris; France)'
    failed = TurnRecord(text="", call=("search", {"query": "q"}), result=ToolResult("Error", error="down"))
    assert compaction_note(failed) == '(search "q": failed)'
    long = TurnRecord(text="", call=("search", {"query": "w" * 200}), result=ToolResult("", []))
    assert compaction_note(long) == f'(search "{"w" * 77}...": nothing)'
    assert compaction_note(TurnRecord(text="", invalid="invalid_json")) == "(an invalid call)"
    assert compaction_note(TurnRecord(text="")) == "(a message)"

    class Calculator:
        def compaction_note(self, arguments, result):
            return f"calc {arguments['expr']} =\n{result.text}"

    calc = TurnRecord(text="", call=("calc", {"expr": "1+1"}), result=ToolResult("2"))
    assert compaction_note(calc, Calculator()) == "calc 1+1 = 2"


def test_query_list_arguments_are_shown() -> None:
    turn = TurnRecord(text="", call=("search", {"query_list": ["a", "b"]}), result=ToolResult("", []))
    assert compaction_note(turn) == '(search "a", "b": nothing)'


# ------------------------------------------------------------------------------------------------ the agent
def test_without_pressure_compact_changes_nothing(qwen_tokenizer, retriever) -> None:
    _, ended, _ = rollout(qwen_tokenizer, retriever, overflow="end")
    result, compacted, _ = rollout(qwen_tokenizer, retriever, overflow="compact")
    assert compacted.response_ids == ended.response_ids and compacted.response_mask == ended.response_mask
    assert compacted.segments == [] and result.stats["compactions"] == 0.0
    assert result.stats["samples_per_episode"] == 1.0


def tight_budget(tokenizer, retriever) -> int:
    """A cap that fits the prompt, the first two searches and their responses, but not the third and the answer."""
    _, full, _ = rollout(tokenizer, retriever)
    return len(full.prompt_ids) + len(full.response_ids) - 40


def test_end_truncates_where_compact_answers(qwen_tokenizer, retriever) -> None:
    cap = tight_budget(qwen_tokenizer, retriever)
    _, ended, _ = rollout(qwen_tokenizer, retriever, max_total_tokens=cap)
    assert ended.truncated and ended.reward == 0.0 and ended.segments == []
    result, traj, _ = rollout(qwen_tokenizer, retriever, max_total_tokens=cap, overflow="compact")
    assert not traj.truncated and traj.answer == "Paris" and traj.reward == 1.0
    assert traj.num_tool_calls == 3 and result.stats["compactions"] == len(traj.segments) >= 1
    assert result.stats["samples_per_episode"] == 1 + len(traj.segments)
    for sample in traj.samples():
        assert len(sample.prompt_ids) + len(sample.response_ids) <= cap
        assert sample.reward == traj.reward and sample.prompt_ids == traj.prompt_ids
    final = qwen_tokenizer.decode(traj.response_ids)
    assert f'(search "{QUERIES[0]}": Paris; Berlin)' in final
    assert "Paris is the capital and largest city of France." in final  # a later response kept whole


def test_every_model_token_is_trained_once_in_the_context_it_was_sampled_from(qwen_tokenizer, retriever) -> None:
    cap = tight_budget(qwen_tokenizer, retriever)
    _, traj, engine = rollout(qwen_tokenizer, retriever, max_total_tokens=cap, overflow="compact")
    samples = traj.samples()[1:] + traj.samples()[:1]  # contexts in the order they were closed, the final one last
    trained = []  # (sample, position) of each mask-1 token, in generation order
    for sample in samples:
        trained += [(sample, i) for i, m in enumerate(sample.response_mask) if m == 1]
    generated = [(prompt, ids, logprobs) for prompt, ids, logprobs in engine.seen]
    assert len(trained) == sum(len(ids) for _, ids, _ in generated)  # once each: no token trained twice or never
    cursor = 0
    for prompt, ids, logprobs in generated:
        sample, first = trained[cursor]
        context = sample.prompt_ids + sample.response_ids
        start = len(sample.prompt_ids) + first
        assert context[:start] == prompt  # the exact tokens the engine saw, never re-tokenized
        assert context[start : start + len(ids)] == ids
        assert sample.engine_logprobs[first : first + len(ids)] == logprobs
        cursor += len(ids)
    for sample in samples:  # nothing the model did not generate is trained
        assert all(lp == 0.0 for lp, m in zip(sample.engine_logprobs, sample.response_mask) if m == 0)


def test_compaction_with_turn_credit_or_a_bad_mode_is_refused(qwen_tokenizer, retriever) -> None:
    with pytest.raises(ValueError, match="rollout.agent.overflow='squash'"):
        AgentConfig(overflow="squash")
    env = Environment.search(retriever)
    env.reward = SubEMReward(credit="turn")
    with pytest.raises(ValueError, match="overflow=compact with env.reward.credit=turn"):
        ToolCallingAgent(ScriptedEngine(qwen_tokenizer, [[ANSWER]]), qwen_tokenizer, env, overflow="compact")
