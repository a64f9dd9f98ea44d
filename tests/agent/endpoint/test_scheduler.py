"""The scheduler batches every blocked episode's request, tool calls first, does not wait forever for an episode
running other code, and keeps rounds apart by their id."""

from __future__ import annotations

import threading
import time

import pytest

from dspo.agent.endpoint.episodes import RequestError
from dspo.agent.endpoint.scheduler import GENERATE, TOOLS, Scheduler


def test_a_batch_goes_once_every_live_episode_is_blocked():
    scheduler = Scheduler(batch_wait_s=30.0)
    scheduler.start("r1", [0, 1, 2])
    answers = []
    for episode in (2, 0):
        scheduler.submit(GENERATE, "r1", episode, f"p{episode}", answers.append)
    taken = []
    thread = threading.Thread(target=lambda: taken.append(scheduler.next_batch()))
    thread.start()
    time.sleep(0.2)
    assert not taken  # episode 1 still runs: its request would join the batch
    scheduler.submit(TOOLS, "r1", 1, ("search", {}), answers.append)
    thread.join(timeout=5)
    (batch,) = taken
    assert [(w.kind, w.episode) for w in batch] == [(TOOLS, 1)]  # tool calls first: their episodes then generate
    scheduler.resumed([1])
    scheduler.submit(GENERATE, "r1", 1, "p1", answers.append)
    batch = scheduler.next_batch()
    assert [w.episode for w in batch] == [0, 1, 2]  # sorted by episode: reproducible seeding
    for episode in (0, 1, 2):
        scheduler.finished("r1", episode)
    assert scheduler.next_batch() is None


def test_an_episode_busy_elsewhere_does_not_stall_the_others():
    scheduler = Scheduler(batch_wait_s=0.1)
    scheduler.start("r1", [0, 1])
    scheduler.submit(GENERATE, "r1", 0, "p0", lambda _: None)
    tic = time.monotonic()
    batch = scheduler.next_batch()
    assert [w.episode for w in batch] == [0]
    assert 0.09 <= time.monotonic() - tic < 2.0


def test_batch_wait_must_be_positive():
    with pytest.raises(ValueError, match="batch_wait_s"):
        Scheduler(batch_wait_s=0)


def test_abort_answers_every_queued_request():
    scheduler = Scheduler()
    scheduler.start("r1", [0, 1])
    answers = []
    scheduler.submit(GENERATE, "r1", 0, "p0", answers.append)
    scheduler.submit(TOOLS, "r1", 1, ("search", {}), answers.append)
    error = RuntimeError("engine down")
    scheduler.abort(error)
    assert answers == [error, error]
    assert scheduler.next_batch() is None


def test_work_of_an_earlier_round_never_reaches_the_next_rounds_episode():
    """A request admitted before its round ended, and a cancelled episode's late `finished`, used to act on the next
    round's episode of the same number."""
    scheduler = Scheduler(batch_wait_s=0.05)
    scheduler.start("r1", [0])
    scheduler.start("r2", [0, 1])
    answers = []
    scheduler.submit(GENERATE, "r1", 0, "late", answers.append)
    (refused,) = answers
    assert isinstance(refused, RequestError) and refused.status == 410 and "r1" in refused.message
    scheduler.finished("r1", 0)  # ignored: episode 0 of r2 still runs
    scheduler.submit(GENERATE, "r2", 1, "p1", answers.append)
    tic = time.monotonic()
    assert [w.payload for w in scheduler.next_batch()] == ["p1"]
    assert time.monotonic() - tic >= 0.04  # it waited for episode 0 of r2, which is still live
    scheduler.finished("r2", 1)
    scheduler.submit(GENERATE, "r2", 1, "after its end", answers.append)
    assert isinstance(answers[-1], RequestError) and answers[-1].status == 410


def test_next_batch_returns_empty_at_its_timeout_for_the_callers_deadlines():
    scheduler = Scheduler(batch_wait_s=30.0)
    scheduler.start("r1", [0])
    tic = time.monotonic()
    assert scheduler.next_batch(timeout_s=0.1) == []
    assert 0.09 <= time.monotonic() - tic < 2.0
