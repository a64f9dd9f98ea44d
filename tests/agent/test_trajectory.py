"""`build_trajectory`: the one episode -> `Trajectory` step of both agents (the tool-calling loop and the endpoint)."""

from __future__ import annotations

from collections import Counter

from dspo.agent.trajectory import EpisodeCounts, EpisodeEnd, EpisodeTokens, build_trajectory
from dspo.env.rewards import RewardResult
from dspo.types import QAItem, Segment


class Decoder:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


ITEM = QAItem("1", "Who?", ["Ada"])


def test_every_field_comes_from_the_episodes_facts():
    segment = Segment([1], [5], [1], [-0.5])
    tokens = EpisodeTokens([1, 2], [7, 8, 9], [1, 0, 1], [-1.0, 0.0, -2.0], [(0, 1), (2, 3)], [segment])
    counts = EpisodeCounts(2, Counter({"search": 2}), Counter({("search", "empty_query"): 1}))
    result = RewardResult(outcome=1.0, shaping=0.1, step_rewards=[0.2, None], components={"subem": 1.0})
    end = EpisodeEnd("finished", truncated=False, answer="Ada")
    t = build_trajectory(ITEM, tokens, result, counts, end, policy_version=3, tokenizer=Decoder())
    assert (t.prompt_ids, t.response_ids, t.response_mask, t.engine_logprobs) == (
        [1, 2],
        [7, 8, 9],
        [1, 0, 1],
        [-1, 0, -2],
    )
    assert (t.reward, t.outcome, t.step_rewards) == (1.0 + 0.1 + 0.2, 1.0, [0.2, None])
    assert (t.num_turns, t.num_tool_calls, t.num_invalid_calls, t.tool_calls) == (2, 2, 1, {"search": 2})
    assert (t.answer, t.truncated, t.stop_reason, t.policy_version) == ("Ada", False, "finished", 3)
    assert t.response_text == "7 8 9" and t.segments == [segment] and t.question == "Who?"


def test_a_failed_episode_has_no_score_and_an_agent_without_turns_keeps_its_total_only():
    counts = EpisodeCounts(0, Counter(), Counter())
    failed = build_trajectory(ITEM, EpisodeTokens([1]), None, counts, EpisodeEnd("agent_error", True), 0, Decoder())
    assert (failed.reward, failed.outcome, failed.failed, failed.response_text) == (0.0, 0.0, True, "")
    result = RewardResult(outcome=1.0, step_rewards=[0.5])
    end = EpisodeEnd("finished", False, "Ada")
    plain = build_trajectory(ITEM, EpisodeTokens([1]), result, counts, end, 0, Decoder(), per_turn=False)
    assert plain.step_rewards == [] and plain.reward == 1.5  # step rewards count in the total, not per turn
