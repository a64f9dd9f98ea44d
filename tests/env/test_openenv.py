"""`env=openenv`: an OpenEnv server's MCP tools trained through the endpoint. The episode a scripted policy plays
through it is the built-in loop's (same prompt, same model tokens, same tool text), the reward is what the environment
paid for the same answers, and the toy trains 4 steps against a locally served environment (slow)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("openenv.core")

from dspo.agent import AgentConfig  # noqa: E402
from dspo.agent.build import build_agent  # noqa: E402
from dspo.agent.endpoint import EndpointAgent  # noqa: E402
from dspo.agent.tool_calling import ToolCallingAgent  # noqa: E402
from dspo.engines.scripted import ScriptedEngine  # noqa: E402
from dspo.env import Environment, SearchTool, SubEMReward  # noqa: E402
from dspo.env.external import ScoredAnswer  # noqa: E402
from dspo.env.openenv import openenv_environment  # noqa: E402
from dspo.types import QAItem  # noqa: E402
from tests.env.openenv_toy import serve  # noqa: E402

PARIS = QAItem(id="q1", question="What is the capital of France?", golden_answers=["Paris"])
CALL = "<think>I should search.</think>\n<search> France </search>"


def script(prompt: str, turn: int, index: int) -> str:
    return CALL if turn == 0 else ("<answer> Paris </answer>" if index % 2 == 0 else "<answer> Lyon </answer>")


def trained(trajectory) -> list[int]:
    return [t for t, m in zip(trajectory.response_ids, trajectory.response_mask) if m]


def test_an_openenv_episode_is_the_built_in_loops_and_its_reward_the_environments(qwen_tokenizer, retriever):
    config = AgentConfig(max_turns=4, tag_format="searchr1")
    with serve(SearchTool(retriever, topk=1)) as (url, env_class):
        env = openenv_environment(url)
        assert sorted(env.tools) == ["search"] and env.tools["search"].tag_argument == "query"
        endpoint = build_agent(config, engine=ScriptedEngine(qwen_tokenizer, script), tokenizer=qwen_tokenizer, env=env)
        assert isinstance(endpoint, EndpointAgent)
        try:
            ours = endpoint.rollout([PARIS], group_size=4, policy_version=1, seed=0)
        finally:
            endpoint.close()
        paid = list(env_class.answers)
    builtin_env = Environment({"search": SearchTool(retriever, topk=1)}, SubEMReward())
    theirs = ToolCallingAgent(ScriptedEngine(qwen_tokenizer, script), qwen_tokenizer, builtin_env, config)
    theirs = theirs.rollout([PARIS], group_size=4, policy_version=1, seed=0)
    for a, b in zip(ours.groups[0].trajectories, theirs.groups[0].trajectories):
        assert a.prompt_ids == b.prompt_ids
        assert trained(a) == trained(b)
        assert qwen_tokenizer.decode(a.response_ids) == qwen_tokenizer.decode(b.response_ids)
        assert (a.reward, a.answer) == (b.reward, b.answer)
    rewards = [t.reward for t in ours.groups[0].trajectories]
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    # the environment's own payments for the same answers, in whatever order the sessions ended
    assert sorted(r for _, _, r in paid) == sorted(rewards) and len(paid) == 4
    assert all(t.reward_components["openenv/done"] == 1.0 for t in ours.groups[0].trajectories)
    assert ours.stats["prefix_breaks"] == 0 and ours.stats["agent_errors"] == 0


def test_the_scored_answer_survives_a_process_boundary():
    import pickle

    answer = pickle.loads(pickle.dumps(ScoredAnswer("Paris", 0.5, {"x": 1})))
    assert (str(answer), answer.reward, answer.components) == ("Paris", 0.5, {"x": 1.0})


def test_a_server_that_is_not_there_fails_naming_the_key():
    with pytest.raises(ConnectionError, match="env.url=http://127.0.0.1:9"):
        openenv_environment("http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(ValueError, match="env.url="):
        openenv_environment("localhost:8000")


SERVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    from hydra.utils import instantiate
    from dspo.testing import compose_config
    from tests.env.openenv_toy import serve
    cfg = compose_config("train", ["paths.cache={cache}", "output_dir=/tmp/unused"])
    tool = instantiate(cfg.env.tools.search)
    with serve(tool) as (url, env_class):
        print(url, flush=True)
        while True:
            time.sleep(1)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1], ids=["k0", "k1_engine_process"])
def test_train_four_steps_against_an_openenv_server(run_train, short_default, toy_cache, tmp_path, staleness):
    """The server runs in its own process, as a user's would; the filter needs mixed groups, so 4 steps taken means
    the environment's rewards differ within groups. At k = 1 the episodes run in the engine process, and their
    scored answers cross to the trainer."""
    from pathlib import Path

    from dspo.sweeps.analysis import find_runs, load_scalars

    code = SERVER.format(repo=str(Path(__file__).resolve().parents[2]), cache=str(toy_cache))
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        outputs = tmp_path / "outputs"
        args = [*short_default, "env=openenv", f"env.url={url}", "trainer.max_steps=4", "run_test=false"]
        run_train([*args, f"rollout.max_staleness={staleness}"], outputs)
    finally:
        server.terminate()
        server.wait(timeout=30)
    (run,) = find_runs(outputs)
    scalars = load_scalars(run.dir)
    tags = set(scalars.tag)
    for tag in ("reward/openenv", "reward/openenv/done", "rollout/agent_errors", "val/toy_2hop/subem"):
        assert tag in tags, f"{tag} missing; logged: {sorted(tags)}"
    value = scalars.set_index("tag").value
    assert (value["rollout/agent_errors"] == 0).all()
    assert (scalars[scalars.tag == "reward/openenv/steps"].value > 0).all()  # the warm start searches
    grads = scalars[scalars.tag == "train/grad_norm"].value
    assert len(grads) >= 4 and all(math.isfinite(g) for g in grads) and (grads > 0).any()


@pytest.mark.parametrize("env", ["env=openenv", "env=verifiers"])
def test_the_adapters_are_refused_what_an_endpoint_agent_is_refused(env):
    from dspo.testing import compose_config
    from dspo.training.combinations import check_combinations

    cfg = compose_config("train", [env, "rollout.partial_rollouts=true", "rollout.max_staleness=1", "paths.cache=/c"])
    with pytest.raises(ValueError, match="rollout.partial_rollouts.*env.agent"):
        check_combinations(cfg)
