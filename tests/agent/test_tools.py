"""The agent with plug-in tools and rewards (issue 27): several tools, one batched run per tool per turn, model faults
vs tool faults, tool metrics, the reward's outcome / step rewards / components on the trajectory, turn spans."""

from __future__ import annotations

import json

import pytest

from dspo.agent import AgentConfig
from dspo.agent.tool_calling import ToolCallingAgent, ToolFailureError
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment, SearchTool, SubEMReward
from dspo.env.rewards import RewardResult
from dspo.env.tools import Tool, ToolResult, ToolUnavailableError
from dspo.types import QAItem

PARIS = QAItem(id="q1", question="What is the capital of France?", golden_answers=["Paris"])
ANSWER = "<answer> Paris </answer>"


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class Calculator(Tool):
    """Evaluates nothing (model output is never evaluated): echoes the expression; records its batches."""

    name, description = "calc", "Echo an expression."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    tag_argument = "expression"

    def __init__(self, fail_on: str | None = None, unavailable: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.fail_on, self.unavailable = fail_on, unavailable

    def run(self, calls, contexts):
        if self.unavailable:
            raise ToolUnavailableError("the calculator service is down after its retries")
        self.batches.append([c["expression"] for c in calls])
        return [
            ToolResult(
                f"= {c['expression']}",
                error="overflow" if c["expression"] == self.fail_on else None,
                metrics={"length": len(c["expression"])},
            )
            for c in calls
        ]


class StepReward(SubEMReward):
    """SubEM plus a step reward of 0.5 on every turn that made a valid call, None elsewhere."""

    def score(self, episodes):
        return [
            RewardResult(
                self.outcome(e),
                step_rewards=[0.5 if t.call else None for t in e.turns],
                components={"subem": self.outcome(e), "calls": float(len(e.searches))},
            )
            for e in episodes
        ]


def agent(tokenizer, retriever, scripts, tools=None, reward=None, share=0.5, **config) -> ToolCallingAgent:
    tools = tools if tools is not None else {"search": SearchTool(retriever, topk=1), "calc": Calculator()}
    env = Environment(tools, reward or SubEMReward(), max_tool_error_share=share)
    return ToolCallingAgent(
        ScriptedEngine(tokenizer, scripts), tokenizer, env, AgentConfig(**{"max_turns": 4, **config})
    )


def test_two_tools_one_batched_run_each_per_turn(qwen_tokenizer, retriever):
    scripts = [
        [call("calc", {"expression": "1+1"}), call("search", {"query_list": ["France"]}), ANSWER],
        [call("search", {"query_list": ["Paris"]}), call("calc", {"expression": "2*3"}), ANSWER],
        [call("calc", {"expression": "7"}), ANSWER],
    ]
    runner = agent(qwen_tokenizer, retriever, scripts, reward=StepReward())
    result = runner.rollout([PARIS], group_size=3, policy_version=0)
    trajectories = result.groups[0].trajectories
    calc = runner.tools["calc"]
    assert calc.batches == [["1+1", "7"], ["2*3"]]  # turn 0: two calls in one run; turn 1: one
    assert retriever.calls == [["Paris"], ["France"]]
    assert [t.tool_calls for t in trajectories] == [{"calc": 1, "search": 1}, {"search": 1, "calc": 1}, {"calc": 1}]
    stats = result.stats
    assert stats["calls/calc"] == 1.0 and stats["calls/search"] == pytest.approx(2 / 3)
    assert stats["tool/calc/length"] == pytest.approx((3 + 1 + 3) / 3)  # the tool's own metric, over its calls
    prompt = qwen_tokenizer.decode(runner.first_prompt(PARIS))
    assert '"name": "calc"' in prompt and '"name": "search"' in prompt  # both schemas rendered
    first = trajectories[0]
    assert first.step_rewards == [0.5, 0.5, None] and first.outcome == 1.0 and first.reward == 2.0
    assert first.reward_components == {"subem": 1.0, "calls": 2.0} and stats["reward/calls"] == pytest.approx(5 / 3)
    # the turn spans are exactly the model's tokens (mask-1 runs)
    spans = [(s, e) for s, e in first.turn_spans]
    assert [first.response_mask[s:e] == [1] * (e - s) for s, e in spans] == [True] * 3
    assert sum(e - s for s, e in spans) == first.num_generated_tokens


def test_tags_of_several_tools_in_search_r1_format(qwen_tokenizer, retriever):
    turns = ["<think>x</think><calc> 6*7 </calc>", "<search> France </search>", ANSWER]
    instruction = "Use <calc> e </calc> or <search> q </search>, then <answer> a </answer>. Question: {question}"
    tools = {"search": SearchTool(retriever, topk=1), "calc": Calculator()}
    env = Environment(tools, SubEMReward(), instruction=instruction)
    runner = ToolCallingAgent(
        ScriptedEngine(qwen_tokenizer, [turns]), qwen_tokenizer, env, AgentConfig(tag_format="searchr1")
    )
    (trajectory,) = runner.rollout([PARIS], group_size=1, policy_version=0).groups[0].trajectories
    assert tools["calc"].batches == [["6*7"]] and retriever.calls == [["France"]]
    assert trajectory.tool_calls == {"calc": 1, "search": 1} and trajectory.reward == 1.0
    assert "Use <calc> e </calc>" in qwen_tokenizer.decode(trajectory.prompt_ids)  # env.instruction is the prompt


def test_tool_failures_are_messages_counted_and_bounded(qwen_tokenizer, retriever):
    scripts = [[call("calc", {"expression": "9**9**9"}), ANSWER], [call("calc", {"expression": "1"}), ANSWER]]
    tools = {"calc": Calculator(fail_on="9**9**9")}
    runner = agent(qwen_tokenizer, retriever, scripts, tools=tools, share=0.5)
    result = runner.rollout([PARIS], group_size=2, policy_version=0)
    failed, fine = result.groups[0].trajectories
    assert result.stats["tool_errors/calc"] == 1.0 and "invalid_calls" in result.stats
    assert failed.num_invalid_calls == 0 and failed.reward == 1.0  # the model's call was right: not its fault
    strict = agent(qwen_tokenizer, retriever, scripts, tools={"calc": Calculator(fail_on="9**9**9")}, share=0.25)
    with pytest.raises(
        ToolFailureError,
        match=r"tool 'calc' failed on 1 of 2 calls .*share 0.50 > env.max_tool_error_share=0.25.*overflow",
    ):
        strict.rollout([PARIS], group_size=2, policy_version=0)
    down = agent(qwen_tokenizer, retriever, scripts, tools={"calc": Calculator(unavailable=True)})
    with pytest.raises(ToolUnavailableError, match="down after its retries"):  # a backend that is down: at once
        down.rollout([PARIS], group_size=2, policy_version=0)


def test_a_tool_that_raises_fails_each_call_of_its_batch_with_a_message(qwen_tokenizer, failing_retriever):
    scripts = [[call("search", {"query_list": ["x"]}), ANSWER]]
    runner = agent(
        qwen_tokenizer, failing_retriever, scripts, tools={"search": SearchTool(failing_retriever)}, share=1.0
    )
    result = runner.rollout([PARIS], group_size=1, policy_version=0)
    (trajectory,) = result.groups[0].trajectories
    assert "Error: the search tool failed on this call (ConnectionError: retrieval service" in trajectory.response_text
    assert result.stats["tool_errors/search"] == 1.0


def test_a_reward_with_the_wrong_number_of_step_rewards_is_refused(qwen_tokenizer, retriever):
    class Broken(SubEMReward):
        def score(self, episodes):
            return [RewardResult(0.0, step_rewards=[1.0, 2.0, 3.0]) for _ in episodes]

    runner = agent(qwen_tokenizer, retriever, [[ANSWER]], reward=Broken())
    with pytest.raises(RuntimeError, match="3 step rewards for 1 turns"):
        runner.rollout([PARIS], group_size=1, policy_version=0)


class CalcShareReward(SubEMReward):
    """subEM + `calc_share` (the share of calls to calc), reported only by episodes that made a call."""

    def score(self, episodes):
        results = super().score(episodes)
        for episode, result in zip(episodes, results):
            if episode.searches:
                result.components["calc_share"] = sum(t.call[0] == "calc" for t in episode.searches) / len(
                    episode.searches
                )
        return results


def test_a_component_is_averaged_over_the_trajectories_that_report_it(qwen_tokenizer, retriever):
    scripts = [
        [call("calc", {"expression": "1"}), call("search", {"query_list": ["France"]}), ANSWER],  # 1/2
        [call("calc", {"expression": "2"}), ANSWER],  # 1
        [ANSWER],  # no call: no calc_share (a 0 here would read as "called the wrong tool")
    ]
    runner = agent(qwen_tokenizer, retriever, scripts, reward=CalcShareReward())
    result = runner.rollout([PARIS], group_size=3, policy_version=0)
    trajectories = result.groups[0].trajectories
    assert [t.reward_components.get("calc_share") for t in trajectories] == [0.5, 1.0, None]
    assert result.stats["reward/calc_share"] == pytest.approx(0.75)
    assert result.stats["reward/subem"] == 1.0
