"""Progress lines (`dspo.process.progress_log`): dropped by a console handler that writes to a terminal, kept by one
that writes to a file or a pipe and by the log file's; durations, phases and the periodic tick."""

from __future__ import annotations

import io
import logging
import os

import pytest

from dspo.process.progress_log import (
    DropWhereLive,
    Every,
    duration,
    phase,
    progress_logger,
    route_progress_lines,
    time_left,
)


@pytest.fixture()
def root_handlers(monkeypatch):
    """The root logger with only the handlers a test gives it (as Hydra's job logging gives it a console and a file
    handler); Rich's terminal overrides unset."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "FORCE_TERMINAL"):
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    root.handlers, root.level = [], logging.INFO
    yield root
    for handler in root.handlers:
        handler.close()
    root.handlers, root.level = saved, level


def test_a_terminal_console_drops_progress_lines_a_redirected_one_and_the_file_keep_them(root_handlers, tmp_path):
    main, replica = os.openpty()
    terminal = os.fdopen(replica, "w")
    piped = io.StringIO()  # not a terminal: what `dspo-train > log`, `| tee` and SLURM give the console handler
    handlers = {
        "terminal": logging.StreamHandler(terminal),
        "piped": logging.StreamHandler(piped),
        "file": logging.FileHandler(tmp_path / "train.log"),
    }
    root_handlers.handlers = list(handlers.values())
    route_progress_lines()
    route_progress_lines()  # idempotent
    assert [len(h.filters) for h in handlers.values()] == [1, 1, 0]  # a file handler keeps every line
    assert handlers["terminal"].filters[0].live and not handlers["piped"].filters[0].live
    line = progress_logger("train").makeRecord("dspo.progress.train", logging.INFO, "f", 1, "step 2/4", (), None)
    other = logging.getLogger("dspo.train").makeRecord("dspo.train", logging.INFO, "f", 1, "prepare", (), None)
    assert [h.filter(line) for h in handlers.values()] == [False, True, True]
    assert [h.filter(other) for h in handlers.values()] == [True, True, True]  # other lines: as before
    progress_logger("train").info("step 2/4 (round 1)")
    handlers["file"].flush()
    assert "step 2/4 (round 1)" in piped.getvalue() and "step 2/4 (round 1)" in (tmp_path / "train.log").read_text()
    terminal.close()
    os.close(main)


def test_the_progress_logger_family_only():
    drop = DropWhereLive(live=True)

    def record(name: str) -> logging.LogRecord:
        return logging.LogRecord(name, logging.INFO, "f", 1, "x", (), None)

    assert not drop.filter(record("dspo.progress")) and not drop.filter(record("dspo.progress.engine"))
    assert drop.filter(record("dspo.progressive")) and drop.filter(record("dspo.train"))
    assert DropWhereLive(live=False).filter(record("dspo.progress"))


def test_durations_read_as_a_person_says_them():
    assert [duration(s) for s in (0.42, 9.96, 45.4, 125.0, 3599.0, 3780.0, -1.0)] == [
        "0.4 s", "10.0 s", "45 s", "2m 05s", "59m 59s", "1h 03m", "0.0 s",
    ]  # fmt: skip


def test_a_phase_says_when_it_starts_and_ends_or_fails(caplog):
    logger = progress_logger("engine")
    with caplog.at_level(logging.INFO, logger="dspo.progress"):
        with phase("engine start (VLLMEngine)", logger):
            pass
        with pytest.raises(RuntimeError), phase("warm start rebuild", logger):
            raise RuntimeError("out of memory")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "engine start (VLLMEngine): started"
    assert messages[1].startswith("engine start (VLLMEngine): done in ")
    assert messages[3].startswith("warm start rebuild: stopped by an error after ")


def test_every_ticks_at_most_once_per_period_and_time_left_is_the_mean_speed():
    now = [0.0]
    every = Every(30.0, clock=lambda: now[0])
    ticks = []
    for t in (10.0, 29.9, 30.0, 45.0, 61.0, 200.0):
        now[0] = t
        ticks.append(every.due())
    assert ticks == [False, False, True, False, True, True]
    assert time_left(120.0, 400, 2800) == 120.0 / 400 * 2400 == 720.0
    assert time_left(0.0, 0, 10) is None
