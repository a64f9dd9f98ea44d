"""Progress lines for a console that shows no live display: a run whose output goes to a file (nohup, `| tee`, a
SLURM log, CI) and the run's own `train.log`.

Why: in a terminal, Rich's bar (`dspo.callbacks.progress.StepProgressBar`) and tqdm's (the warm start's SFT) redraw
themselves in place. Written to a file they print nothing until they end, so a redirected run was silent for as long
as it trained. Progress lines are ordinary `logging` records of the `dspo.progress` logger and its children: Hydra's
job logging (its defaults, conf/train.yaml) sends them to the console handler and to the run's `train.log`.

In a terminal the console stays as it was: `route_progress_lines` gives each console handler of the root logger a
filter that drops these records where that handler writes to a live display (a terminal, or Jupyter, as Rich judges
it: `FORCE_COLOR`, `TTY_COMPATIBLE` honoured), where the bars already show the same numbers. File handlers keep them:
`train.log` reads the same whether the run was started in a terminal or not, one short line per round, and is where
a question about an earlier round is answered.

Stdlib only at import (rich is imported when a handler is judged): any layer may use it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

PROGRESS = "dspo.progress"


def progress_logger(part: str | None = None) -> logging.Logger:
    """`dspo.progress` (or `dspo.progress.<part>`): the logger whose INFO records are progress lines."""
    return logging.getLogger(f"{PROGRESS}.{part}" if part else PROGRESS)


def duration(seconds: float) -> str:
    """`45 s`, `2m 05s`, `1h 03m`: a duration as a progress line reads it."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m {int(seconds % 60):02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m"


def shows_live_display(stream: IO | None) -> bool:
    """Whether `stream` is where Rich draws a live display: a terminal, or a Jupyter output (Rich's own judgement,
    which honours FORCE_COLOR and TTY_COMPATIBLE)."""
    if stream is None:
        return False
    from rich.console import Console

    console = Console(file=stream)
    return console.is_terminal or console.is_jupyter


class DropWhereLive(logging.Filter):
    """On a console handler: drops `dspo.progress` records when the handler's stream shows a live display."""

    def __init__(self, live: bool) -> None:
        super().__init__()
        self.live = live

    def filter(self, record: logging.LogRecord) -> bool:
        is_progress = record.name == PROGRESS or record.name.startswith(PROGRESS + ".")
        return not (self.live and is_progress)


def route_progress_lines() -> None:
    """Give every console handler of the root logger (Hydra's) a `DropWhereLive` judged on its stream; file handlers
    get none (they keep every progress line). Idempotent; call once Hydra set the job's handlers (each job of a
    sweep gets new ones)."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
            continue
        if not any(isinstance(f, DropWhereLive) for f in handler.filters):
            handler.addFilter(DropWhereLive(shows_live_display(getattr(handler, "stream", None))))


@contextmanager
def phase(what: str, logger: logging.Logger | None = None) -> Iterator[None]:
    """A progress line when `what` starts and one when it ends, with its duration (or fails, then re-raised)."""
    logger = logger or progress_logger()
    logger.info("%s: started", what)
    start = time.monotonic()
    try:
        yield
    except BaseException:
        logger.info("%s: stopped by an error after %s", what, duration(time.monotonic() - start))
        raise
    logger.info("%s: done in %s", what, duration(time.monotonic() - start))


class Every:
    """`due()` is True at most once per `seconds` (the first call after `seconds` from construction or the last True):
    a loop logs a progress line every so often, whatever its step takes."""

    def __init__(self, seconds: float, clock=time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self.last = clock()

    def due(self) -> bool:
        now = self.clock()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True


def time_left(elapsed: float, done: int, total: int) -> float | None:
    """Seconds left for `total - done` more units at the mean speed of the `done` units that took `elapsed` seconds
    (None before the first unit)."""
    if done <= 0 or not math.isfinite(elapsed):
        return None
    return elapsed / done * max(0, total - done)
