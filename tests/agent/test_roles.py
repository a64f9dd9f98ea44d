"""Roles in a round (issue 57, part 1): one agent call plays several roles, a later role's items are built from an
earlier role's episodes, one role's reward is settled from another's outcomes, and the round treats every group alike
while logging `rollout/<role>/<stat>` (nothing more for an un-roled agent)."""

from __future__ import annotations

import pytest

from dspo.agent import AgentRollout, build_agent
from dspo.agent.roles import FailureRateReward, Role, RoleAgent, derived_item, origin
from dspo.agent.stats import Kind
from dspo.agent.tool_calling import ToolCallingAgent
from dspo.algorithms.config import AlgorithmConfig
from dspo.data.round_builder import build_round
from dspo.data.rounds import PromptSampler
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment
from dspo.eval.pipeline import predict
from dspo.rollout.cli import trajectory_records
from dspo.rollout.sampler import RoundSampler
from dspo.testing import ScriptedAgent, scripted_agent, toy_items, two_role_agent
from dspo.types import DEFAULT_ROLE, QAItem, RolloutGroup, Trajectory

PROPOSE = (
    "Write a question about a capital, then its answer, as <answer> question || answer </answer>. Topic: {question}"
)


def test_one_call_returns_both_roles_groups_the_solvers_built_from_the_proposers_episodes():
    items = toy_items(3)
    result = two_role_agent().rollout(items, group_size=4, policy_version=2, seed=5)
    proposer = [g for g in result.groups if g.role == "proposer"]
    solver = [g for g in result.groups if g.role == "solver"]
    assert result.groups[:3] == proposer and [g.item.id for g in proposer] == ["0", "1", "2"]  # items order first
    assert [g.prompt_index for g in proposer] == [0, 1, 2] and solver
    for group in solver:  # each built from one proposer episode, numbered by the round item it descends from
        role, g, e = origin(group.item)
        assert role == "proposer" and group.prompt_index == g and group.item.id == f"{g}/proposer{e}"
        failed = sum(t.outcome == 0 for t in group.trajectories) / 4
        assert proposer[g].trajectories[e].reward == failed == proposer[g].trajectories[e].outcome  # settled
    built = {origin(g.item)[1:] for g in solver}
    unbuilt = [t for g, group in enumerate(proposer) for e, t in enumerate(group.trajectories) if (g, e) not in built]
    assert unbuilt and all(t.reward == 0.0 for t in unbuilt)  # an invalid proposal earns 0
    assert result.stats["proposer/valid_share"] == len(solver) / 12
    assert all(t.policy_version == 2 for g in result.groups for t in g.trajectories)
    records = trajectory_records(result.groups)  # dspo-rollout's records name the role; an un-roled one's do not
    assert {r["role"] for r in records} == {"proposer", "solver"}
    assert "role" not in trajectory_records(ScriptedAgent().rollout(items, 2, 0).groups)[0]


def test_a_later_roles_items_are_read_from_the_earlier_roles_text(qwen_tokenizer, retriever):
    """Real tool-calling agents on one scripted engine (one policy): the proposer writes `question || answer`, the
    solver's prompt carries the proposed question, and the proposer is paid by the solver's failure rate."""

    def script(prompt: str, turn: int, index: int) -> str:
        if "Write a question" in prompt:  # the proposer: episode 1 writes no separator (an invalid proposal)
            return ["<answer> What is the capital of France? || Paris </answer>", "<answer> France </answer>"][
                index % 2
            ]
        assert "What is the capital of France?" in prompt  # the solver plays the proposed question
        return ["<answer> Paris </answer>", "<answer> Lyon </answer>", "<answer> Lyon </answer>"][index % 3]

    def proposals(parts) -> list[QAItem]:
        (part,) = parts
        out = []
        for g, group in enumerate(part.groups):
            for e, trajectory in enumerate(group.trajectories):
                if trajectory.answer and "||" in trajectory.answer:
                    question, answer = (s.strip() for s in trajectory.answer.split("||"))
                    out.append(derived_item(part, g, e, question, [answer]))
        return out

    engine = ScriptedEngine(qwen_tokenizer, script)
    env = Environment.search(retriever)
    propose = Environment(env.tools, env.reward, instruction=PROPOSE)
    loop = {"_target_": "dspo.agent.tool_calling.ToolCallingAgent", "tag_format": "searchr1"}
    roles = [Role("proposer", loop, propose), Role("solver", loop, None, proposals)]
    agent = build_agent(
        lambda engine, tokenizer, env: RoleAgent(engine, tokenizer, env, roles, settle=FailureRateReward()),
        engine=engine,
        tokenizer=qwen_tokenizer,
        env=env,
    )
    assert isinstance(agent.agents["solver"], ToolCallingAgent) and agent.agents["solver"].env is env
    result = agent.rollout([QAItem("t0", "capitals", ["-"])], group_size=3, policy_version=0)
    proposer, *solver = result.groups
    assert [g.role for g in result.groups] == ["proposer", "solver", "solver"]  # episodes 0 and 2 were valid
    assert [g.item.golden_answers for g in solver] == [["Paris"], ["Paris"]]
    assert [t.reward for t in solver[0].trajectories] == [1.0, 0.0, 0.0]  # the solver scored by subEM
    assert [t.reward for t in proposer.trajectories] == pytest.approx([2 / 3, 0.0, 2 / 3])
    assert result.stats["proposer/reward/subem"] == 0.0 and result.stats["solver/reward/subem"] == 1 / 3
    assert result.stats["reward/subem"] == pytest.approx((0 * 3 + 2 / 6 * 6) / 9)  # merged, by trajectories
    assert result.stats["proposer/valid_share"] == pytest.approx(2 / 3)


class ByRoleAgent:
    """Groups whose outcomes are set by the item: `all` items all right (the filter drops them), others mixed."""

    stat_kinds = {"calls/": Kind.MEAN}

    def __init__(self, mixed: bool) -> None:
        self.mixed, self.calls = mixed, []

    def rollout(self, items, group_size, policy_version, greedy=False, seed=None):
        self.calls.append([item.id for item in items])
        groups = []
        for item in items:
            rewards = [float(j % 2) if self.mixed else 1.0 for j in range(group_size)]
            trajectories = [
                Trajectory([1], [2, 3], [1, 1], [0.0, 0.0], reward=r, num_tool_calls=1, policy_version=policy_version)
                for r in rewards
            ]
            groups.append(RolloutGroup(item=item, trajectories=trajectories))
        return AgentRollout(groups, {"tool_calls_mean": 1.0, "invalid_calls": 1.0, "calls/search": 1.0})


def _copies(parts) -> list[QAItem]:
    (part,) = parts
    return [derived_item(part, g, 0, group.item.question, ["a"]) for g, group in enumerate(part.groups)]


def _role_agent(first_mixed: bool) -> RoleAgent:
    roles = [
        Role("proposer", lambda engine, tokenizer, env: ByRoleAgent(first_mixed)),
        Role("solver", lambda engine, tokenizer, env: ByRoleAgent(True), derive=_copies),
    ]
    return RoleAgent(None, None, None, roles)


def test_the_filter_treats_role_groups_as_any_groups_and_the_round_logs_each_role():
    agent = _role_agent(first_mixed=False)  # every proposer group all right: the filter drops them all
    sampler = RoundSampler(agent, AlgorithmConfig(group_size=4, batch_groups=4))
    groups, stats = sampler.sample_round(PromptSampler(toy_items(), seed=0), policy_version=0, seed=0)
    assert len(groups) == 4 and {g.role for g in groups} == {"solver"}
    assert stats["rollout/proposer/keep_rate"] == 0.0 and stats["rollout/solver/keep_rate"] == 1.0
    assert stats["rollout/proposer/groups_kept"] == 0.0 and stats["rollout/solver/groups_kept"] == 4.0
    assert stats["rollout/proposer/outcome_mean"] == 1.0 and stats["rollout/solver/outcome_mean"] == 0.5
    assert stats["rollout/groups_sampled"] == stats["rollout/proposer/groups_sampled"] * 2
    assert stats["rollout/keep_rate"] == 0.5 and stats["rollout/tool_calls_mean"] == 1.0
    assert stats["rollout/calls/search"] == 1.0 and stats["rollout/proposer/calls/search"] == 1.0
    assert stats["rollout/invalid_calls"] == 2.0 * (stats["rollout/engine_calls"])  # one per role per call
    assert {g.prompt_index for g in groups} <= set(range(50))  # numbered by the sampler's prompts
    # one group per prompt was the prior; two per prompt asks for half as many prompts in the next call
    mixed = RoundSampler(_role_agent(first_mixed=True), AlgorithmConfig(group_size=4, batch_groups=4))
    kept, both = mixed.sample_round(PromptSampler(toy_items(), seed=0), policy_version=0, seed=0)
    assert [g.role for g in kept] == ["proposer", "solver"] * 2  # the surplus is cut across roles, not after one
    round_ = build_round(kept, num_minibatches=1, micro_batch_size=4, pad_token_id=0, policy_version=0, seed=0)
    advantages = [b.advantages for mb in round_.minibatches for b in mb]
    assert sum(len(a) for a in advantages) == 16  # every role's group has its advantages, as any group


def test_an_unroled_agent_logs_no_role_statistics():
    sampler = RoundSampler(ScriptedAgent(), AlgorithmConfig(group_size=4, batch_groups=2))
    groups, stats = sampler.sample_round(PromptSampler(toy_items(), seed=0), policy_version=0, seed=0)
    assert {g.role for g in groups} == {DEFAULT_ROLE}
    assert not [key for key in stats if key.startswith(f"rollout/{DEFAULT_ROLE}/")]


def test_held_out_questions_are_answered_by_the_answering_role_alone():
    agent = _role_agent(first_mixed=True)
    assert agent.answer_role == "solver" and agent.answerer is agent.agents["solver"]
    answers = predict(agent, toy_items(5), batch_size=2, progress=False)  # one group per item, in order
    assert [a.id for a in answers] == ["0", "1", "2", "3", "4"]
    assert agent.agents["solver"].calls == [["0", "1"], ["2", "3"], ["4"]] and not agent.agents["proposer"].calls


def test_misconfigured_roles_fail_naming_the_key():
    with pytest.raises(ValueError, match="rollout.agent.roles.1.derive"):
        RoleAgent(None, None, None, [Role("a", scripted_agent), Role("b", scripted_agent)])
    with pytest.raises(ValueError, match="rollout.agent.roles.0.derive"):
        RoleAgent(None, None, None, [Role("a", scripted_agent, derive=_copies)])
    with pytest.raises(ValueError, match="unique"):
        RoleAgent(None, None, None, [Role("a", scripted_agent), Role("a", scripted_agent, derive=_copies)])
    with pytest.raises(ValueError, match="rollout.agent.answer_role='judge'"):
        RoleAgent(None, None, None, [Role("a", scripted_agent)], answer_role="judge")
    with pytest.raises(ValueError, match="without '/'"):
        Role("a/b")
    agent = RoleAgent(None, None, None, [Role("a", scripted_agent)], settle=FailureRateReward())
    with pytest.raises(ValueError, match="rollout.agent.settle: no role named 'proposer'"):
        agent.rollout(toy_items(1), 2, 0)


def test_a_role_agent_is_built_from_its_config_as_any_agent():
    """The form docs/extending.md shows: `rollout.agent` as a config, instantiated by `build_agent`."""
    config = {
        "_target_": "dspo.agent.roles.RoleAgent",
        "_partial_": True,
        "roles": [
            {
                "_target_": "dspo.agent.roles.Role",
                "name": "proposer",
                "agent": {"_target_": "dspo.testing.scripted_agent", "_partial_": True},
            },
            {
                "_target_": "dspo.agent.roles.Role",
                "name": "solver",
                "agent": {"_target_": "dspo.testing.scripted_agent", "_partial_": True},
                "derive": {"_target_": "dspo.testing.scripted_proposals", "_partial_": True},
            },
        ],
        "settle": {"_target_": "dspo.agent.roles.FailureRateReward", "proposer": "proposer", "solver": "solver"},
        "answer_role": "solver",
    }
    agent = build_agent(config, engine=None, tokenizer=None, env=None)
    assert isinstance(agent, RoleAgent) and list(agent.agents) == ["proposer", "solver"]
    result = agent.rollout(toy_items(2), 4, 0, seed=1)
    assert {g.role for g in result.groups} == {"proposer", "solver"} and "proposer/valid_share" in result.stats


def test_roles_without_an_agent_of_their_own_play_the_loop_with_the_settings_given_beside_them(
    qwen_tokenizer, retriever
):
    """`rollout.agent.max_turns=2` (a setting beside `roles`) reaches every role whose agent is unset; a role with an
    agent of its own keeps that agent's settings."""
    own = {"_target_": "dspo.agent.tool_calling.ToolCallingAgent", "tag_format": "searchr1", "max_turns": 5}
    roles = [Role("proposer"), Role("solver", own, derive=_copies)]
    engine = ScriptedEngine(qwen_tokenizer, lambda prompt, turn, index: "<answer> x </answer>")
    agent = RoleAgent(engine, qwen_tokenizer, Environment.search(retriever), roles, max_turns=2, tag_format="qwen")
    proposer, solver = agent.agents["proposer"], agent.agents["solver"]
    assert isinstance(proposer, ToolCallingAgent) and proposer.config.max_turns == 2
    assert proposer.config.tag_format == "qwen"
    assert solver.config.max_turns == 5 and solver.config.tag_format == "searchr1"
