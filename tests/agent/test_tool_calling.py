"""ToolCallingAgent + ScriptedEngine on the real Qwen2.5 chat template: exact masks, tool turns, malformed calls."""

from __future__ import annotations

import json

import pytest

from dspo.agent import AgentConfig, parsing
from dspo.agent.prompts import SEARCH_TOOL_SCHEMA, build_messages
from dspo.agent.tool_calling import ToolCallingAgent, ToolFailureError
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment
from dspo.types import QAItem

PARIS = QAItem(id="q1", question="What is the capital of France?", golden_answers=["Paris"])
BERLIN = QAItem(id="q2", question="What is the capital of Germany?", golden_answers=["Berlin"])


def call(queries, name="search", key="query_list") -> str:
    body = json.dumps({"name": name, "arguments": {key: queries}})
    return f"<think>I should search.</think>\n<tool_call>\n{body}\n</tool_call>"


ANSWER = "<think>Found it.</think>\n<answer> Paris </answer>"


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def model_turns(tokenizer, traj) -> list[str]:
    return [tokenizer.decode(traj.response_ids[s:e]) for v, s, e in runs(traj.response_mask) if v == 1]


def env_turns(tokenizer, traj) -> list[str]:
    return [tokenizer.decode(traj.response_ids[s:e]) for v, s, e in runs(traj.response_mask) if v == 0]


def make_agent(tokenizer, retriever, scripts, **overrides) -> ToolCallingAgent:
    config = AgentConfig(**{"max_turns": 4, **overrides})
    env = Environment.search(retriever, topk=2)
    return ToolCallingAgent(ScriptedEngine(tokenizer, scripts), tokenizer, env, config)


def test_masks_decode_to_model_turns_and_match_chat_template(qwen_tokenizer, retriever):
    turns = [call(["capital of France"]), ANSWER]
    agent = make_agent(qwen_tokenizer, retriever, [turns])
    (group,) = agent.rollout([PARIS], group_size=1, policy_version=7).groups
    traj = group.trajectories[0]
    assert len(traj.response_ids) == len(traj.response_mask) == len(traj.engine_logprobs)
    assert model_turns(qwen_tokenizer, traj) == turns
    (tool_turn,) = env_turns(qwen_tokenizer, traj)
    observation = (
        "Doc 1 (Title: Paris) Paris is the capital and largest city of France.\n"
        "Doc 2 (Title: Berlin) Berlin is the capital of Germany."
    )
    # The full sequence is exactly what the chat template renders for this conversation.
    messages = build_messages(PARIS.question, "qwen") + [
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": observation},
    ]
    rendered = qwen_tokenizer.apply_chat_template(
        messages, tools=[SEARCH_TOOL_SCHEMA], add_generation_prompt=True, tokenize=False
    )
    assert qwen_tokenizer.decode(traj.prompt_ids + traj.response_ids) == rendered + turns[1]
    assert tool_turn.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n")
    assert tool_turn.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # No template / tool token is trained.
    special = {qwen_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    assert not any(t in special for t, m in zip(traj.response_ids, traj.response_mask) if m == 1)
    assert (traj.reward, traj.answer, traj.num_turns, traj.num_tool_calls) == (1.0, "Paris", 2, 1)
    assert (traj.num_invalid_calls, traj.truncated, traj.policy_version) == (0, False, 7)
    assert traj.stop_reason == "finished"  # every episode ends with a named reason
    assert traj.engine_logprobs == [0.0] * len(traj.response_ids)
    assert traj.response_text == qwen_tokenizer.decode(traj.response_ids)


def test_batched_groups_one_search_per_turn(qwen_tokenizer, retriever):
    scripts = [
        [call(["France"]), ANSWER],
        [call(["Paris", "Eiffel"]), call(["tower"]), ANSWER],
        ["<answer> Berlin </answer>"],
        [call(["Germany"]), "<answer> Berlin </answer>"],
    ]
    agent = make_agent(qwen_tokenizer, retriever, scripts)
    result = agent.rollout([PARIS, BERLIN], group_size=2, policy_version=3, seed=1)
    groups = result.groups
    assert [g.prompt_index for g in groups] == [0, 1]
    assert [g.item.id for g in groups] == ["q1", "q2"]
    assert [t.reward for g in groups for t in g.trajectories] == [1.0, 1.0, 1.0, 1.0]
    assert [t.num_tool_calls for g in groups for t in g.trajectories] == [1, 2, 0, 1]
    assert [model_turns(qwen_tokenizer, t) for g in groups for t in g.trajectories] == scripts
    # turn 0: three trajectories search (4 queries) in ONE retriever call; turn 1: one call.
    assert retriever.calls == [["France", "Paris", "Eiffel", "Germany"], ["tower"]]
    assert groups[0].policy_version == 3
    multi = groups[0].trajectories[1]
    obs = env_turns(qwen_tokenizer, multi)[0]
    assert 'Results for "Paris":\nDoc 1 (Title: Paris)' in obs and 'Results for "Eiffel":' in obs
    stats = result.stats
    assert stats["tool_calls_mean"] == 1.0 and stats["turns_mean"] == 2.0 and stats["invalid_calls"] == 0
    assert stats["generated_tokens"] == sum(t.num_generated_tokens for g in groups for t in g.trajectories)
    for key in ("generation_s", "tool_s", "other_s", "tokens_per_s", "response_len_mean", "truncated_share"):
        assert key in stats


MALFORMED = {
    parsing.INVALID_JSON: '<tool_call>\n{"name": "search", "arguments": {"query_list": ["x"]}\n</tool_call>',
    parsing.NOT_AN_OBJECT: '<tool_call>\n["search", "x"]\n</tool_call>',
    parsing.UNKNOWN_TOOL: call(["x"], name="browse"),
    parsing.BAD_ARGUMENTS: call(42),
    parsing.EMPTY_QUERY: call([]),
    parsing.TOO_MANY_QUERIES: call(["a", "b", "c", "d"]),
    parsing.QUERY_TOO_LONG: call(["word " * 200]),
    parsing.MISSING_OPEN_TAG: '{"name": "search", "arguments": {"query_list": ["x"]}}\n</tool_call>',
}


SEARCH_TOOL_KINDS = {parsing.BAD_ARGUMENTS, parsing.EMPTY_QUERY, parsing.TOO_MANY_QUERIES, parsing.QUERY_TOO_LONG}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_call_becomes_observation_and_episode_continues(qwen_tokenizer, retriever, kind):
    agent = make_agent(qwen_tokenizer, retriever, [[MALFORMED[kind], ANSWER]])
    result = agent.rollout([PARIS], group_size=1, policy_version=0)
    traj = result.groups[0].trajectories[0]
    assert model_turns(qwen_tokenizer, traj) == [MALFORMED[kind], ANSWER]
    (tool_turn,) = env_turns(qwen_tokenizer, traj)
    assert "<tool_response>\nError: " in tool_turn
    assert (traj.num_invalid_calls, traj.num_tool_calls, traj.reward) == (1, 0, 1.0)
    tool = "search" if kind in SEARCH_TOOL_KINDS else parsing.NO_TOOL  # counted per tool once one can be told
    assert result.stats[f"invalid/{tool}/{kind}"] == 1.0 and result.stats["invalid_calls"] == 1.0
    assert retriever.calls == []


def test_call_in_last_turn_ends_episode(qwen_tokenizer, retriever):
    agent = make_agent(qwen_tokenizer, retriever, [[call(["a"]), call(["b"])]], max_turns=2)
    result = agent.rollout([PARIS], group_size=1, policy_version=0)
    traj = result.groups[0].trajectories[0]
    assert (traj.num_turns, traj.num_tool_calls, traj.num_invalid_calls, traj.truncated) == (2, 1, 1, True)
    assert traj.stop_reason == "max_turns"
    assert result.stats[f"invalid/{parsing.NO_TOOL}/{parsing.CALL_AFTER_LAST_TURN}"] == 1.0
    assert "one turn left" in env_turns(qwen_tokenizer, traj)[0]
    assert traj.response_mask[-1] == 1 and traj.reward == 0.0 and traj.answer is None


def test_plain_query_string_accepted(qwen_tokenizer, retriever):
    agent = make_agent(qwen_tokenizer, retriever, [[call("Eiffel Tower", key="query"), ANSWER]])
    traj = agent.rollout([PARIS], group_size=1, policy_version=0).groups[0].trajectories[0]
    assert retriever.calls == [["Eiffel Tower"]] and traj.num_tool_calls == 1


def test_failing_retriever_fails_round_clearly(qwen_tokenizer, failing_retriever):
    """Every call failing inside the tool is above env.max_tool_error_share: the round fails naming the tool."""
    agent = make_agent(qwen_tokenizer, failing_retriever, [[call(["x"]), ANSWER]])
    message = r"tool 'search' failed on 1 of 1 calls .*env.max_tool_error_share=0.05.*ConnectionError: .*unreachable"
    with pytest.raises(ToolFailureError, match=message):
        agent.rollout([PARIS], group_size=1, policy_version=0)


def test_observation_truncated_and_total_length_capped(qwen_tokenizer, retriever):
    agent = make_agent(qwen_tokenizer, retriever, [[call(["Paris"]), ANSWER]], max_obs_tokens=5)
    traj = agent.rollout([PARIS], group_size=1, policy_version=0).groups[0].trajectories[0]
    wrapper = len(agent.tool_turn.prefix_ids) + len(agent.tool_turn.suffix_ids)
    assert [e - s for v, s, e in runs(traj.response_mask) if v == 0] == [wrapper + 5]
    prompt_len = len(agent.first_prompt(PARIS))
    capped = make_agent(qwen_tokenizer, retriever, [[call(["Paris"]), ANSWER]], max_total_tokens=prompt_len + 10)
    traj = capped.rollout([PARIS], group_size=1, policy_version=0).groups[0].trajectories[0]
    assert len(traj.prompt_ids) + len(traj.response_ids) == prompt_len + 10
    assert traj.truncated and set(traj.response_mask) == {1} and traj.num_turns == 1
    assert traj.stop_reason == "max_tokens"


def test_answer_inside_retrieved_document_does_not_score(qwen_tokenizer, retriever):
    agent = make_agent(qwen_tokenizer, retriever, [[call(["says this document"]), "I am not sure."]])
    traj = agent.rollout([PARIS], group_size=1, policy_version=0).groups[0].trajectories[0]
    assert "<answer> Paris </answer>" in traj.response_text
    assert traj.answer is None and traj.reward == 0.0
    assert model_turns(qwen_tokenizer, traj)[-1] == "I am not sure.<|im_end|>"  # EOS appended, mask 1


def test_searchr1_format(qwen_tokenizer, retriever):
    turns = ["<think>hm</think>\n<search> capital of France </search>", ANSWER]
    agent = make_agent(qwen_tokenizer, retriever, [turns, ["<search>  </search>", ANSWER]], tag_format="searchr1")
    good, bad = agent.rollout([PARIS], group_size=2, policy_version=0).groups[0].trajectories
    assert model_turns(qwen_tokenizer, good) == turns
    (info,) = env_turns(qwen_tokenizer, good)
    assert info.startswith("\n\n<information>Doc 1 (Title: Paris)") and info.endswith("</information>\n\n")
    assert retriever.calls == [["capital of France"]]
    assert (good.reward, good.num_tool_calls, bad.num_invalid_calls, bad.reward) == (1.0, 1, 1, 1.0)
    assert "<tool_call>" not in qwen_tokenizer.decode(good.prompt_ids)


@pytest.mark.parametrize("top_p", [0.9, 0.0, 1.5])
def test_top_p_other_than_one_is_refused_naming_the_key(top_p):
    """Engine logprobs under a nucleus are not comparable with the trainer's full-vocabulary logprobs (issue 16)."""
    with pytest.raises(ValueError, match="rollout.agent.top_p"):
        AgentConfig(top_p=top_p)
    assert AgentConfig(top_p=1.0).top_p == 1.0


@pytest.mark.parametrize("spare", [-1, 0, 1])
def test_an_observation_that_leaves_no_room_to_answer_ends_the_episode(qwen_tokenizer, retriever, spare):
    """The cap check before a tool turn: prompt + turn 1 + tool turn must stay below max_total_tokens, else the
    episode ends after turn 1 (no mask-0 tokens the model could never follow up on)."""
    turns = [call(["Paris"]), ANSWER]
    full = make_agent(qwen_tokenizer, retriever, [turns]).rollout([PARIS], 1, 0).groups[0].trajectories[0]
    (first, observation, _) = [e - s for _, s, e in runs(full.response_mask)]
    cap = len(full.prompt_ids) + first + observation + spare
    traj = (
        make_agent(qwen_tokenizer, retriever, [turns], max_total_tokens=cap)
        .rollout([PARIS], 1, 0)
        .groups[0]
        .trajectories[0]
    )
    assert len(traj.prompt_ids) + len(traj.response_ids) <= cap
    if spare <= 0:  # the tool turn would fill the cap: it is not appended
        assert traj.truncated and traj.num_turns == 1 and set(traj.response_mask) == {1}
        assert len(traj.response_ids) == first
    else:  # one token of room: the tool turn goes in, the model's answer is cut to that token
        assert (
            traj.truncated
            and traj.num_turns == 2
            and traj.response_mask[first : first + observation] == [0] * observation
        )
        assert len(traj.response_ids) == first + observation + 1
