"""Search self-play's solver items (issue 57, part 2): the proposer's questions kept only when the policy answers them
right from the proposer's documents (the retrieval-augmented check), refused proposals counted by reason, and the
proposer paid by the solver's failure rate, through real tool-calling agents on one scripted engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspo.agent import build_agent
from dspo.agent.roles import FailureRateReward, Role, RoleAgent, RolePart, derived_item, origin
from dspo.agent.selfplay import VerifiedProposals, off_topic
from dspo.engines.scripted import ScriptedEngine
from dspo.env import Environment
from dspo.env.proposals import proposer_environment
from dspo.types import QAItem, RolloutGroup, Trajectory

LOOP = {"_target_": "dspo.agent.tool_calling.ToolCallingAgent", "tag_format": "searchr1", "max_turns": 3}
FRANCE = "<question> What is the capital of France? </question>\n<answer> Paris </answer>"
WRONG = "<question> Which city of France has the Eiffel Tower? </question>\n<answer> Berlin </answer>"  # page: Paris


class Script:
    """Proposer episode e of the group: 0 searches and proposes a right question, 1 searches and proposes a wrong
    answer, 2 proposes without searching, 3 searches and writes no question. The check answers what the evidence
    says; the solver answers Paris in one episode of two."""

    def __init__(self) -> None:
        self.checks: list[str] = []

    def __call__(self, prompt: str, turn: int, index: int) -> str:
        if "Write a question" in prompt:
            if index == 2:
                return "<question> What is the largest city of France? </question>\n<answer> Lyon </answer>"
            if turn == 0:
                return "<think>read</think>\n<search> Paris </search>"
            return [FRANCE, WRONG, "", "<answer> Paris </answer>"][index]
        if "<information>" in prompt and "<search> Paris </search>" in prompt and prompt.count("Question:") == 1:
            self.checks.append(prompt)  # the check: the solver's prompt + the proposer's evidence
            return "<answer> Paris </answer>"
        return ["<answer> Paris </answer>", "<answer> Lyon </answer>"][index % 2]  # the solver, without searching


def _agent(qwen_tokenizer, retriever, script, check: bool = True, on_topic: bool = True) -> RoleAgent:
    env = Environment.search(retriever)
    roles = [
        Role("proposer", LOOP, proposer_environment(env.tools, "searchr1")),
        Role("solver", LOOP, None, VerifiedProposals("proposer", "searchr1", check=check, on_topic=on_topic)),
    ]
    return build_agent(
        lambda engine, tokenizer, env: RoleAgent(engine, tokenizer, env, roles, settle=FailureRateReward()),
        engine=ScriptedEngine(qwen_tokenizer, script),
        tokenizer=qwen_tokenizer,
        env=env,
    )


def test_only_checked_proposals_become_the_solvers_questions_and_refusals_are_counted(qwen_tokenizer, retriever):
    script = Script()
    result = _agent(qwen_tokenizer, retriever, script).rollout([QAItem("t0", "France", ["France"])], 4, 0)
    proposer, *solver = result.groups
    assert [g.role for g in result.groups] == ["proposer", "solver"]  # only episode 0's proposal passed
    (built,) = solver
    assert built.item.question == "What is the capital of France?" and built.item.golden_answers == ["Paris"]
    assert origin(built.item) == ("proposer", 0, 0)
    assert [t.reward for t in built.trajectories] == [1.0, 0.0, 1.0, 0.0]
    assert [t.reward for t in proposer.trajectories] == [0.5, 0.0, 0.0, 0.0]  # the solver failed 2 of 4
    stats = result.stats
    assert stats["proposer/invalid/check_failed"] == stats["proposer/invalid/no_search"] == 0.25
    assert stats["proposer/invalid/no_question"] == 0.25 and stats["proposer/invalid/answer_in_question"] == 0.0
    assert stats["proposer/invalid/off_topic"] == stats["proposer/invalid/malformed_question"] == 0.0
    assert stats["proposer/checked"] == 0.5 and stats["proposer/valid_share"] == 0.25
    assert stats["proposer/difficulty"] == 0.5
    assert stats["proposer/reward/proposal_formed"] == 0.75  # 0, 1 and 2 wrote a question and an answer
    # the check read the solver's first prompt for the question, then the proposer's episode up to its final turn
    assert len(script.checks) == 2
    for prompt in script.checks:
        assert "Write a question" not in prompt and "Answer the given question" in prompt
        assert prompt.rstrip().endswith("</information>")
    assert "Question: What is the capital of France?" in script.checks[0]
    assert "Question: Which city of France has the Eiffel Tower?" in script.checks[1]


def test_without_the_check_every_searched_well_formed_proposal_is_kept(qwen_tokenizer, retriever):
    script = Script()
    result = _agent(qwen_tokenizer, retriever, script, check=False).rollout([QAItem("t0", "France", ["France"])], 4, 0)
    solver = [g for g in result.groups if g.role == "solver"]
    assert [g.item.golden_answers for g in solver] == [["Paris"], ["Berlin"]] and not script.checks
    assert result.stats["proposer/invalid/check_failed"] == 0.0 and result.stats["proposer/checked"] == 0.0


def test_a_derive_outside_a_role_agent_says_how_to_build_it():
    with pytest.raises(RuntimeError, match="through RoleAgent"):
        VerifiedProposals().check_prompt_ids("q?", None)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        VerifiedProposals(max_new_tokens=0)
    with pytest.raises(ValueError, match="tag_format"):
        VerifiedProposals(tag_format="json")


@pytest.mark.parametrize(
    ("question", "reason"),
    [
        ("What is the capital of France?", ""),
        ("what is the capital of   france", ""),  # normalized: case, spaces, punctuation
        ("Where </ququestion>? </", "malformed_question"),  # what the toy's proposer learned without the rule
        ("Where was Ana Lopez born?", "off_topic"),
    ],
)
def test_a_question_must_name_its_topic_and_hold_no_markup(question, reason):
    assert off_topic(question, "France") == reason


def test_off_topic_proposals_are_refused_unless_the_rule_is_off(qwen_tokenizer, retriever):
    """A proposal about another page than the topic passes the check (the check reads the evidence) but is refused
    as `off_topic`; with `on_topic=False` it becomes a solver question."""
    script = Script()
    topic = [QAItem("t0", "Germany", ["Germany"])]  # no proposal names Germany
    strict = _agent(qwen_tokenizer, retriever, script).rollout(topic, 4, 0)
    assert [g.role for g in strict.groups] == ["proposer"] and strict.stats["proposer/invalid/off_topic"] == 0.75
    loose = _agent(qwen_tokenizer, retriever, Script(), on_topic=False).rollout(topic, 4, 0)
    assert [g.item.question for g in loose.groups if g.role == "solver"] == ["What is the capital of France?"]


# ------------------------------------------------------------------------------------------ crashed solver episodes
def episode(outcome: float, stop_reason: str = "finished", truncated: bool = False) -> Trajectory:
    return Trajectory([1], [], [], [], reward=outcome, stop_reason=stop_reason, truncated=truncated)


SOLVED, FAILED, OUT_OF_TURNS = episode(1.0), episode(0.0), episode(0.0, "max_turns", truncated=True)
CRASHED, TIMED_OUT = episode(0.0, "agent_error"), episode(0.0, "agent_timeout")  # stubs: outcome 0, no outcome really


def settled(solver_episodes: list[list[Trajectory]], proposals: int) -> tuple[list[float], dict[str, float]]:
    """`FailureRateReward` over one topic's `proposals` proposer episodes, the first len(solver_episodes) of which
    became solver items with these episodes; the proposer's rewards and the statistics."""
    topic = QAItem("t0", "France", ["France"])
    proposer = RolePart("proposer", [topic], [RolloutGroup(topic, [episode(0.0) for _ in range(proposals)])], {}, {})
    items = [derived_item(proposer, 0, e, f"q{e}?", ["a"]) for e in range(len(solver_episodes))]
    groups = [RolloutGroup(item, list(trajectories)) for item, trajectories in zip(items, solver_episodes)]
    stats = FailureRateReward()([proposer, RolePart("solver", items, groups, {}, {})])
    rewards = [t.reward for t in proposer.groups[0].trajectories]
    assert rewards == [t.outcome for t in proposer.groups[0].trajectories]  # the filter tests the same figure
    return rewards, stats


def test_a_crashed_solver_episode_pays_no_one_and_a_proposal_whose_solver_all_crashed_earns_nothing():
    rewards, stats = settled(
        [
            [SOLVED, FAILED, CRASHED, CRASHED],  # 1 failure of the 2 that ran (crashes counted: 3 of 4)
            [CRASHED, TIMED_OUT, CRASHED, CRASHED],  # none ran: not measured (crashes counted: 4 of 4)
            [OUT_OF_TURNS, FAILED, SOLVED, episode(1.0, "agent_timeout")],  # out of turns is a failure: 2 of 3
        ],
        proposals=4,  # episode 3's proposal was refused: 0
    )
    assert rewards == pytest.approx([1 / 2, 0.0, 2 / 3, 0.0])
    assert stats == pytest.approx(
        {"proposer/valid_share": 3 / 4, "proposer/difficulty": (1 / 2 + 2 / 3) / 2, "proposer/unmeasured": 1.0,
         "proposer/solver_crashed": 7.0}
    )  # fmt: skip


outcomes = st.lists(st.sampled_from([SOLVED, FAILED, OUT_OF_TURNS]), max_size=5)
crashes = st.lists(st.sampled_from([CRASHED, TIMED_OUT, episode(1.0, "agent_error")]), max_size=5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(outcomes, crashes, st.randoms()).filter(lambda p: p[0] or p[1]), min_size=1, max_size=4))
def test_crashes_added_anywhere_change_no_proposers_reward_unless_nothing_ran(proposals):
    """Whatever crashes join a proposal's solver episodes, in any order, its reward is the failure rate of those that
    ran, and 0 when none did."""
    with_crashes = []
    for ran, crashed, rng in proposals:
        mixed = ran + crashed
        rng.shuffle(mixed)
        with_crashes.append(mixed)
    rewards, stats = settled(with_crashes, proposals=len(proposals))
    for reward, (ran, _, _) in zip(rewards, proposals):
        assert reward == (sum(t.outcome == 0.0 for t in ran) / len(ran) if ran else 0.0)
    assert stats["proposer/solver_crashed"] == sum(len(crashed) for _, crashed, _ in proposals)
    assert stats["proposer/unmeasured"] == sum(not ran for ran, _, _ in proposals)
