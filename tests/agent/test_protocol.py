"""The agent seam (issue 41): one `build_agent` for every way `rollout.agent` is given, results returned (no state
left on the agent), the hooks that vary an agent, and the settings that moved to the environment failing by name."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dspo.agent import AgentConfig, AgentRollout, agent_setting, build_agent
from dspo.agent.config import MovedSettingError, check_moved_overrides
from dspo.agent.tool_calling import ToolCallingAgent
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment
from dspo.testing import ScriptedAgent, compose_config
from dspo.types import QAItem

PARIS = QAItem(id="q1", question="What is the capital of France?", golden_answers=["Paris"])
SEARCH = "<search> capital of France </search>"
ANSWER = "<answer> Paris </answer>"


def test_the_configured_agent_is_a_constructor_that_build_agent_completes(qwen_tokenizer, retriever):
    cfg = compose_config("train", ["output_dir=/tmp/x"])
    made = instantiate(cfg.rollout.agent)  # what dspo-train hands the producer: a partial constructor
    assert isinstance(made, functools.partial) and made.func is ToolCallingAgent
    assert agent_setting(made, "max_turns") == 3 and agent_setting(made, "tag_format") == "searchr1"
    engine, env = ScriptedEngine(qwen_tokenizer, [[ANSWER]]), Environment.search(retriever)
    for given in (made, cfg.rollout.agent, OmegaConf.to_container(cfg.rollout.agent)):  # built or as a config
        agent = build_agent(given, engine=engine, tokenizer=qwen_tokenizer, env=env)
        assert isinstance(agent, ToolCallingAgent) and agent.config.max_turns == 3 and agent.env is env
    default = build_agent(None, engine=engine, tokenizer=None, env=env)  # no tokenizer: the engine's
    assert default.config == AgentConfig() and default.tokenizer is qwen_tokenizer
    limits = build_agent(AgentConfig(max_turns=2), engine=engine, tokenizer=qwen_tokenizer, env=env)
    assert limits.config.max_turns == 2 and agent_setting(AgentConfig(temperature=0.5), "temperature") == 0.5
    plug_in = build_agent(
        lambda engine, tokenizer, env: ScriptedAgent(env=env), engine=engine, tokenizer=qwen_tokenizer, env=env
    )  # any constructor
    assert isinstance(plug_in, ScriptedAgent) and plug_in.env is env
    with pytest.raises(TypeError, match="rollout.agent: expected an agent constructor"):
        build_agent(3, engine=engine, tokenizer=qwen_tokenizer, env=env)


def test_rollout_returns_groups_and_statistics_and_keeps_no_state(qwen_tokenizer, retriever):
    scripts = [[SEARCH, ANSWER], ["<answer> Lyon </answer>"]]
    agent = ToolCallingAgent(ScriptedEngine(qwen_tokenizer, scripts), qwen_tokenizer, retriever, tag_format="searchr1")
    result = agent.rollout([PARIS], group_size=2, policy_version=0)
    assert isinstance(result, AgentRollout) and [t.reward for t in result.groups[0].trajectories] == [1.0, 0.0]
    assert result.stats["tool_calls_mean"] == 0.5 and result.stats["reward_mean"] == 0.5
    assert not hasattr(agent, "last_stats")
    with pytest.raises(AttributeError):  # frozen: a result is what the call returned, nobody changes it later
        result.stats = {}


class Planning(ToolCallingAgent):
    """A first turn that plans (stops at </plan>) and continues, through the hooks only."""

    def stop_strings(self, turn: int) -> list[str]:
        return ["</plan>", *super().stop_strings(turn)] if turn == 0 else super().stop_strings(turn)

    def next_message(self, text: str, turn: int) -> str | None:
        return "Now search as planned." if turn == 0 and text.endswith("</plan>") else None


def test_hooks_vary_the_loop_without_branches(qwen_tokenizer, retriever):
    plan = "<plan> search the capital </plan>"
    engine = ScriptedEngine(qwen_tokenizer, [[plan, SEARCH, ANSWER], [ANSWER]])
    agent = Planning(engine, qwen_tokenizer, Environment.search(retriever, topk=1), tag_format="searchr1", max_turns=4)
    planned, direct = agent.rollout([PARIS], group_size=2, policy_version=0).groups[0].trajectories
    assert planned.num_turns == 3 and planned.num_tool_calls == 1 and planned.reward == 1.0
    assert "Now search as planned." in planned.response_text and not planned.truncated
    assert direct.num_turns == 1 and direct.reward == 1.0  # an answer in the first turn still ends the episode
    base = ToolCallingAgent(ScriptedEngine(qwen_tokenizer, [[plan, ANSWER]]), qwen_tokenizer, retriever)
    assert base.rollout([PARIS], 1, 0).groups[0].trajectories[0].num_turns == 1  # no hook: a plan ends it


@pytest.mark.parametrize(
    ("key", "new"),
    [
        ("topk", "env.tools.search.topk"),
        ("max_queries_per_call", "env.tools.search.max_queries_per_call"),
        ("max_query_chars", "env.tools.search.max_query_chars"),
        ("max_answer_words", "env.reward.max_answer_words"),
    ],
)
def test_settings_that_moved_to_the_environment_fail_naming_the_new_key(key, new, qwen_tokenizer, retriever):
    engine = ScriptedEngine(qwen_tokenizer, [[ANSWER]])
    with pytest.raises(MovedSettingError, match=rf"rollout.agent.{key} moved to the environment: set {new}=5"):
        ToolCallingAgent(engine, qwen_tokenizer, retriever, **{key: 5})  # a config file's rollout.agent.<key>
    for override in (f"rollout.agent.{key}=5", f"+rollout.agent.{key}=5"):  # the command line
        with pytest.raises(MovedSettingError, match=rf"set {new}=5"):
            check_moved_overrides(["algorithm=gspo", override])
    check_moved_overrides([f"{new}=5", "rollout.agent.max_turns=2"])  # the new keys pass
    with pytest.raises(ValueError, match="rollout.agent.topk_typo: not an agent setting"):
        AgentConfig.from_settings({"topk_typo": 1})


def test_the_commands_name_the_new_key_before_hydra_composes():
    """`dspo-train rollout.agent.topk=5` ends with one line naming env.tools.search.topk, not Hydra's "not in
    struct"."""
    result = subprocess.run(
        [sys.executable, "-m", "dspo.train", "rollout.agent.topk=5"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert "error: rollout.agent.topk moved to the environment: set env.tools.search.topk=5" in result.stderr
    assert "not in struct" not in result.stderr


def test_the_renamed_callback_node_is_named_by_its_old_key():
    with pytest.raises(MovedSettingError, match="callbacks.environment.sample_every_n_rounds is now callbacks.rollout"):
        check_moved_overrides(["callbacks.environment.sample_every_n_rounds=1"])
    with pytest.raises(MovedSettingError, match="callbacks.environment is now callbacks.rollout"):
        check_moved_overrides(["~callbacks.environment"])
    check_moved_overrides(["callbacks.rollout.sample_every_n_rounds=1", "+callbacks.environment_extra.x=1"])


def test_a_config_file_that_keeps_a_moved_key_fails_when_the_run_is_built():
    """`rollout.agent.topk: 1` in a user's experiment YAML reaches the agent's constructor call, which runs only where
    the agent is built (after the engine starts): `RolloutCallback` refuses it when the run is built instead."""
    from dspo.agent import check_agent_settings
    from dspo.algorithms.config import AlgorithmConfig
    from dspo.callbacks.rollout_callback import RolloutCallback
    from dspo.models import ModelConfig

    made = functools.partial(ToolCallingAgent, max_turns=3, topk=1)
    with pytest.raises(MovedSettingError, match="set env.tools.search.topk=1"):
        RolloutCallback(None, made, None, AlgorithmConfig(), ModelConfig(path="unused"))
    with pytest.raises(MovedSettingError, match="set env.reward.max_answer_words=5"):
        check_agent_settings({"_target_": "dspo.agent.tool_calling.ToolCallingAgent", "max_answer_words": 5})
    check_agent_settings(functools.partial(ToolCallingAgent, max_turns=3))
