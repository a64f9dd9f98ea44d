"""The progress lines of a round (`RoundLines`, `RoundClock`, `round_line`), with hand-computed times: a slow round
(over Rich's 30 s speed window) keeps its time left, and a resumed run counts from its own start. The validation
table reads `val/` keys only. A redirected run's lines in stdout and train.log: tests/test_train.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from dspo.callbacks.progress import RoundClock, RoundLines, round_line, rounds_left, validation_table
from dspo.types import RoundReport


def test_round_line_reads_as_documented():
    line = round_line(4, 100, 2, 0.4123, 0.75, round_s=36.04, per_round_s=38.2, left_s=48 * 38.2)
    # 48 rounds left at 38.2 s = 1833.6 s = 30m 33s
    assert (
        line
        == "step 4/100 (round 2) · sampled reward 0.412 · keep 0.75 · 38.2 s/round (this one 36.0 s) · 30m 33s left"
    )
    assert round_line(100, 100, 50, 0.5, 0.5, 10.0, 12.0, 0.0).endswith(" · done")
    # nothing known but the step and the round's time (no step limit, no report)
    assert round_line(7, -1, 4, None, None, 9.5, None, None) == "step 7 (round 4) · this round 9.5 s"


def test_time_left_is_the_mean_after_the_first_round_and_survives_a_slow_round():
    clock = RoundClock()
    assert clock.time_left(10) is None  # no round ended yet
    clock.round_ended(0.0, 50.0)  # the first round: 50 s (the engine's first calls)
    assert clock.seconds_per_round() == 50.0  # the only estimate until a second round ends
    assert clock.time_left(rounds_left(2, 20, 2)) == 9 * 50.0
    clock.round_ended(60.0, 80.0)  # 30 s after the first ended (10 s of validation, then a 20 s round)
    clock.round_ended(80.0, 100.0)
    assert clock.seconds_per_round() == (100.0 - 50.0) / 2 == 25.0  # the first round left out
    assert clock.time_left(rounds_left(6, 20, 2)) == 7 * 25.0
    clock.round_ended(100.0, 195.0)  # a 95 s round: longer than Rich's 30 s speed window
    assert clock.seconds_per_round() == (195.0 - 50.0) / 3  # 48.33 s: still a time left
    assert clock.time_left(rounds_left(8, 20, 2)) == pytest.approx(6 * 145.0 / 3)


def test_rounds_left_rounds_up_and_knows_no_limit():
    assert rounds_left(0, 100, 2) == 50
    assert rounds_left(97, 100, 2) == 2  # a skipped step left the global step behind: 3 steps are 2 rounds
    assert rounds_left(100, 100, 2) == 0
    assert rounds_left(5, -1, 2) is None


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _report(round_index: int, reward: float) -> RoundReport:
    return RoundReport(round_index, reward, 0.0, 0.1, reward, round_index, round_index)


def _run_rounds(callback: RoundLines, trainer, first_round: int, durations: list[float], clock: Clock) -> None:
    """Drive the hooks as Lightning does: each round is `steps_per_round` steps of one second's update, its
    generation (the rest of its duration) before its first step."""
    for offset, seconds in enumerate(durations):
        round_index = first_round + offset
        for minibatch in range(callback.steps_per_round):
            report = _report(round_index, 0.25) if minibatch == 0 else None
            batch = SimpleNamespace(round_index=round_index, minibatch_index=minibatch, report=report)
            callback.on_train_batch_start(trainer, None, batch, 0)
            clock.t += seconds - callback.steps_per_round + 1 if minibatch == 0 else 1
            trainer.global_step += 1
            trainer.callback_metrics["rollout/keep_rate"] = 0.5
            callback.on_train_batch_end(trainer, None, None, batch, 0)
        clock.t += 10.0  # a validation between rounds


def _trainer(step: int, max_steps: int) -> SimpleNamespace:
    return SimpleNamespace(
        global_step=step, max_steps=max_steps, is_global_zero=True, callback_metrics={}, sanity_checking=False
    )


def test_round_lines_one_line_per_round_with_its_time_left(caplog):
    callback, clock, trainer = RoundLines(steps_per_round=2), Clock(), _trainer(0, 8)
    callback.now = clock
    callback.on_train_start(trainer, None)
    with caplog.at_level(logging.INFO, logger="dspo.progress"):
        _run_rounds(callback, trainer, 0, [40.0, 20.0, 35.0, 20.0], clock)
    lines = [r.getMessage() for r in caplog.records if r.name == "dspo.progress.train"]
    assert lines[0] == "step 0/8: the run's first round started (its line follows when it ends)"
    assert lines[1:] == [
        "step 2/8 (round 1) · sampled reward 0.250 · keep 0.50 · 40.0 s/round (this one 40.0 s) · 2m 00s left",
        # 20 s round + the 10 s validation before it: 30 s/round, 2 rounds left
        "step 4/8 (round 2) · sampled reward 0.250 · keep 0.50 · 30.0 s/round (this one 20.0 s) · 1m 00s left",
        "step 6/8 (round 3) · sampled reward 0.250 · keep 0.50 · 37.5 s/round (this one 35.0 s) · 38 s left",
        "step 8/8 (round 4) · sampled reward 0.250 · keep 0.50 · 35.0 s/round (this one 20.0 s) · done",
    ]


def test_a_resumed_run_counts_its_rounds_from_the_resume(caplog):
    """Resumed at step 40 of 100 (round 21 next): the first round of this process is its own first, whatever the
    run took before."""
    callback, clock, trainer = RoundLines(steps_per_round=2), Clock(), _trainer(40, 100)
    callback.now, clock.t = clock, 5000.0
    callback.on_train_start(trainer, None)
    with caplog.at_level(logging.INFO, logger="dspo.progress"):
        _run_rounds(callback, trainer, 20, [50.0, 30.0], clock)
    lines = [r.getMessage() for r in caplog.records if r.name == "dspo.progress.train"]
    assert lines[0] == "step 40/100: the resumed run's first round started (its line follows when it ends)"
    # 29 rounds left at 50 s = 1450 s; then 28 at (10 + 30) s = 1120 s
    assert lines[1:] == [
        "step 42/100 (round 21) · sampled reward 0.250 · keep 0.50 · 50.0 s/round (this one 50.0 s) · 24m 10s left",
        "step 44/100 (round 22) · sampled reward 0.250 · keep 0.50 · 40.0 s/round (this one 30.0 s) · 18m 40s left",
    ]


def test_only_rank_zero_writes_and_validation_has_a_start_and_an_end(caplog):
    callback, clock, trainer = RoundLines(steps_per_round=1), Clock(), _trainer(0, 4)
    callback.now = clock
    with caplog.at_level(logging.INFO, logger="dspo.progress"):
        callback.on_validation_start(trainer, None)
        clock.t += 75.0
        callback.on_validation_end(trainer, None)
        trainer.is_global_zero = False
        _run_rounds(callback, trainer, 0, [5.0], clock)
    assert [r.getMessage() for r in caplog.records] == [
        "validation at step 0: started",
        "validation at step 0: done in 1m 15s",
    ]


def test_steps_per_round_is_checked_with_its_key():
    with pytest.raises(ValueError, match="callbacks.round_lines.steps_per_round must be >= 1"):
        RoundLines(steps_per_round=0)


def test_the_validation_table_reads_validation_keys_only():
    """The reward's components are logged as `reward/<name>`: `reward/subem` once showed as a benchmark "rd"."""
    metrics = {"val/toy_1hop/subem": 0.75, "val/toy_2hop/subem": 0.5, "reward/subem": 0.25, "val/subem_mean": 0.625}
    assert validation_table(metrics, 2) == "step 2 · validation subEM  toy_1hop 0.750  toy_2hop 0.500  mean 0.625"
