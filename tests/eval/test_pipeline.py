"""Evaluation core: predictions from rollout groups, per-benchmark scores, and the files written."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from dspo.agent import AgentRollout
from dspo.eval.answer_metrics import benchmark_metrics
from dspo.eval.pipeline import (
    AVERAGE,
    JUDGE_KEYS,
    Prediction,
    macro_average,
    markdown_table,
    predict,
    read_predictions,
    read_results,
    score,
    update_metrics,
    write_results,
)
from dspo.types import QAItem, RolloutGroup, Trajectory


def make_trajectory(answer: str | None, turns: int = 2, calls: int = 1) -> Trajectory:
    return Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        response_mask=[1, 0, 1],
        engine_logprobs=[-0.1, 0.0, -0.2],
        answer=answer,
        num_turns=turns,
        num_tool_calls=calls,
        response_text=f"<answer>{answer}</answer>",
    )


class ScriptedAgent:
    """Answers each question with a fixed string; records how it was called."""

    def __init__(self, answers: dict[str, str | None]) -> None:
        self.answers = answers
        self.calls: list[tuple[int, int, int, bool]] = []

    def rollout(
        self, items: Sequence[QAItem], group_size: int, policy_version: int = 0, greedy: bool = False
    ) -> AgentRollout:
        self.calls.append((len(items), group_size, policy_version, greedy))
        return AgentRollout(
            [
                RolloutGroup(item=item, trajectories=[make_trajectory(self.answers[item.id], calls=len(item.id))])
                for item in items
            ]
        )


def items() -> list[QAItem]:
    return [
        QAItem("1", "who wrote hamlet", ["William Shakespeare"], "nq"),
        QAItem("22", "capital of france", ["Paris"], "nq"),
        QAItem("333", "largest planet", ["Jupiter"], "nq"),
        QAItem("4", "what year", ["1999", "nineteen ninety-nine"], "hotpotqa"),
        QAItem("55", "is it so", ["yes"], "hotpotqa"),
    ]


ANSWERS = {"1": "Shakespeare", "22": "The city of Paris", "333": None, "4": "1999", "55": "no"}


def test_predict_batches_greedy_in_order() -> None:
    agent = ScriptedAgent(ANSWERS)
    predictions = predict(agent, items(), batch_size=2, policy_version=7, progress=False)
    assert agent.calls == [(2, 1, 7, True), (2, 1, 7, True), (1, 1, 7, True)]
    assert [p.id for p in predictions] == ["1", "22", "333", "4", "55"]
    by_id = {p.id: p for p in predictions}
    assert by_id["22"].correct == 1.0 and by_id["22"].em == 0.0 and 0 < by_id["22"].f1 < 1
    assert by_id["1"].correct == 0.0 and by_id["1"].f1 == pytest.approx(2 / 3)  # gold is not inside the prediction
    assert by_id["333"].answer == "" and by_id["333"].correct == 0.0 and by_id["333"].f1 == 0.0
    assert by_id["4"].correct == by_id["4"].em == by_id["4"].f1 == 1.0
    assert by_id["55"].f1 == 0.0  # yes/no must match exactly
    assert by_id["333"].num_tool_calls == 3 and by_id["333"].num_turns == 2


def test_predict_rejects_bad_batch_size_and_mismatched_groups() -> None:
    with pytest.raises(ValueError, match="eval.batch_size"):
        predict(ScriptedAgent(ANSWERS), items(), batch_size=0, progress=False)

    class Reordering(ScriptedAgent):
        def rollout(self, items, group_size, policy_version=0, greedy=False):  # type: ignore[override]
            return AgentRollout(list(reversed(super().rollout(items, group_size, policy_version, greedy).groups)))

    with pytest.raises(RuntimeError, match="agent returned groups"):
        predict(Reordering(ANSWERS), items(), batch_size=5, progress=False)


def test_score_matches_hand_computation() -> None:
    predictions = predict(ScriptedAgent(ANSWERS), items(), batch_size=5, progress=False)
    results = score(predictions)
    assert list(results) == ["nq", "hotpotqa"]
    nq, hotpot = results["nq"], results["hotpotqa"]
    assert nq["n"] == 3 and nq["subem"] == 1 / 3 and nq["em"] == 0.0
    f1_22 = next(p.f1 for p in predictions if p.id == "22")
    assert nq["f1"] == pytest.approx((2 / 3 + f1_22 + 0.0) / 3, abs=1e-6)
    assert nq["mean_tool_calls"] == pytest.approx((1 + 2 + 3) / 3) and nq["mean_turns"] == 2.0
    assert hotpot == pytest.approx(
        {"subem": 0.5, "em": 0.5, "f1": 0.5, "n": 2, "mean_tool_calls": 1.5, "mean_turns": 2.0}
    )


def test_update_metrics_accumulates_and_rejects_unknown_benchmark() -> None:
    predictions = predict(ScriptedAgent(ANSWERS), items(), batch_size=5, progress=False)
    metrics = benchmark_metrics(["nq", "hotpotqa"], stage="val")
    update_metrics(metrics, predictions[:2])
    update_metrics(metrics, predictions[2:])
    assert float(metrics["nq"].compute()["val/nq/subem"]) == pytest.approx(1 / 3)
    with pytest.raises(KeyError, match="no metric collection for benchmark 'hotpotqa'"):
        update_metrics(benchmark_metrics(["nq"]), predictions)


def test_write_results_round_trip(tmp_path: Path) -> None:
    predictions = predict(ScriptedAgent(ANSWERS), items(), batch_size=5, progress=False)
    results = score(predictions)
    paths = write_results(tmp_path / "out", results, predictions)
    written = json.loads(paths["results"].read_text())
    assert list(written) == ["nq", "hotpotqa", AVERAGE]
    assert written[AVERAGE]["subem"] == pytest.approx((1 / 3 + 0.5) / 2) and written[AVERAGE]["n"] == 5
    assert {k: written[k] for k in results} == results
    back = read_predictions(paths["predictions"])
    assert back == predictions
    assert score(back) == results
    table = paths["table"].read_text()
    assert "| nq | 3 | 33.3 | 0.0 |" in table and "| **average** | 5 | 41.7 |" in table
    # One benchmark: no average row.
    single = [p for p in predictions if p.benchmark == "nq"]
    assert list(json.loads(write_results(tmp_path / "one", score(single), single)["results"].read_text())) == ["nq"]


def test_macro_average_and_table_errors() -> None:
    with pytest.raises(ValueError, match="no benchmark results"):
        macro_average({})
    row = {"subem": 1.0, "em": 0.5, "f1": 0.25, "n": 4, "mean_tool_calls": 1.0, "mean_turns": 3.0}
    assert markdown_table({"x": row}).splitlines()[-1] == "| x | 4 | 100.0 | 50.0 | 25.0 | 1.00 | 3.00 |"


def test_prediction_requires_single_trajectory() -> None:
    group = RolloutGroup(item=items()[0], trajectories=[make_trajectory("a"), make_trajectory("b")])
    with pytest.raises(ValueError, match="1 trajectory per group"):
        Prediction.from_group(group)


def judged_group(item: QAItem, answer: str, components: dict[str, float]) -> RolloutGroup:
    trajectory = make_trajectory(answer)
    trajectory.reward_components = dict(components)
    return RolloutGroup(item=item, trajectories=[trajectory])


def test_a_judged_run_reports_the_judge_beside_the_scores(tmp_path: Path) -> None:
    """Issue 73 (3): trajectories carrying the judge reward's components (`judge`, `judge_agrees`, `judge_error`, as
    dspo.env.judge logs them) give per benchmark the judge's mean verdict, its agreement with subEM and its failures;
    a failed verdict counts as an error only, never as a 0 in the judge's score."""
    qa = items()
    groups = [
        judged_group(qa[0], "Shakespeare", {"subem": 0.0, "judge": 1.0, "judge_agrees": 0.0, "judge_error": 0.0}),
        judged_group(qa[1], "The city of Paris", {"subem": 1.0, "judge": 1.0, "judge_agrees": 1.0, "judge_error": 0.0}),
        judged_group(qa[2], "Mars", {"subem": 0.0, "judge": 0.0, "judge_agrees": 1.0, "judge_error": 1.0}),  # failed
        judged_group(qa[3], "1999", {"subem": 1.0, "judge_error": 1.0}),
        judged_group(qa[4], "no", {"subem": 0.0, "judge_error": 1.0}),
    ]
    predictions = [Prediction.from_group(group) for group in groups]
    assert [(p.judge, p.judge_agrees, p.judge_error) for p in predictions[:3]] == [
        (1.0, 0.0, 0.0),
        (1.0, 1.0, 0.0),
        (None, None, 1.0),
    ]
    results = score(predictions)
    assert {k: results["nq"][k] for k in JUDGE_KEYS} == {"judge": 1.0, "judge_agreement": 0.5, "judge_errors": 1}
    assert {k: results["hotpotqa"][k] for k in JUDGE_KEYS} == {
        "judge": None,
        "judge_agreement": None,
        "judge_errors": 2,
    }
    assert "judge" not in macro_average(results)  # a benchmark without a verdict: no judged average
    paths = write_results(tmp_path, results, predictions, pinned={"schema": 1})
    table = paths["table"].read_text()
    assert "| judge (%) | judge agrees (%) | judge errors |" in table
    assert f"| nq | 3 | 33.3 | 0.0 | {100 * results['nq']['f1']:.1f} | 1.00 | 2.00 | 100.0 | 50.0 | 1 |" in table
    assert "| hotpotqa | 2 | 50.0 | 50.0 | 50.0 | 1.00 | 2.00 | - | - | 2 |" in table
    assert "| **average** | 5 | 41.7 |" in table and table.endswith("| - | - | - |\n")  # not every benchmark judged
    rows, pinned = read_results(paths["results"])
    assert pinned == {"schema": 1} and list(rows) == ["nq", "hotpotqa", AVERAGE]
    assert read_predictions(paths["predictions"]) == predictions
    both = score(predictions[:2] + [Prediction.from_group(judged_group(qa[3], "1999", {"judge": 1.0}))])
    assert both["hotpotqa"] == {**both["hotpotqa"], "judge": 1.0, "judge_agreement": None, "judge_errors": 0}
    assert "judge" not in macro_average(both)  # hotpotqa's verdict has no agreement: no judged average
    agreeing = {"judge": 0.0, "judge_agrees": 0.0, "judge_error": 0.0}
    both = score(predictions[:2] + [Prediction.from_group(judged_group(qa[3], "1999", agreeing))])
    average = macro_average(both)
    assert (average["judge"], average["judge_agreement"], average["judge_errors"]) == (0.5, 0.25, 0)


def test_reports_without_a_judge_keep_their_form(tmp_path: Path) -> None:
    predictions = predict(ScriptedAgent(ANSWERS), items(), batch_size=5, progress=False)
    paths = write_results(tmp_path, score(predictions), predictions)
    first = json.loads(paths["predictions"].read_text().splitlines()[0])
    assert not any(key.startswith("judge") for key in first) and "judge" not in paths["table"].read_text()
    rows, pinned = read_results(paths["results"])  # an old file: rows only
    assert pinned is None and list(rows) == ["nq", "hotpotqa", AVERAGE]
    with pytest.raises(ValueError, match="collides with results.json's pinned settings"):
        write_results(tmp_path, {"pinned": {}}, [])


def test_the_judge_scores_reach_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dspo.eval.pipeline import log_tensorboard

    row = {"subem": 0.5, "em": 0.5, "f1": 0.5, "n": 2, "mean_tool_calls": 1.0, "mean_turns": 2.0}
    table = {"nq": {**row, "judge": 0.75, "judge_agreement": 0.5, "judge_errors": 1}, "hotpotqa": dict(row)}
    table["hotpotqa"].update(judge=None, judge_agreement=None, judge_errors=2)  # every verdict failed
    log_tensorboard(tmp_path, table, step=3)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"test/nq/judge", "test/nq/judge_agreement", "test/nq/judge_errors", "test/hotpotqa/judge_errors"} <= tags
    assert "test/hotpotqa/judge" not in tags and "test/nq/subem" in tags
    assert [(e.step, e.value) for e in events.Scalars("test/nq/judge")] == [(3, 0.75)]
