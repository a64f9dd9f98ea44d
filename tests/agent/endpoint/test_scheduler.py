"""The scheduler batches every blocked episode's request, tool calls first, and does not wait forever for an episode
running other code."""

from __future__ import annotations

import threading
import time

import pytest

from dspo.agent.endpoint.scheduler import GENERATE, TOOLS, Scheduler


def test_a_batch_goes_once_every_live_episode_is_blocked():
    scheduler = Scheduler(batch_wait_s=30.0)
    scheduler.start([0, 1, 2])
    answers = []
    for episode in (2, 0):
        scheduler.submit(GENERATE, episode, f"p{episode}", answers.append)
    taken = []
    thread = threading.Thread(target=lambda: taken.append(scheduler.next_batch()))
    thread.start()
    time.sleep(0.2)
    assert not taken  # episode 1 still runs: its request would join the batch
    scheduler.submit(TOOLS, 1, ("search", {}), answers.append)
    thread.join(timeout=5)
    (batch,) = taken
    assert [(w.kind, w.episode) for w in batch] == [(TOOLS, 1)]  # tool calls first: their episodes then generate
    scheduler.resumed([1])
    scheduler.submit(GENERATE, 1, "p1", answers.append)
    batch = scheduler.next_batch()
    assert [w.episode for w in batch] == [0, 1, 2]  # sorted by episode: reproducible seeding
    for episode in (0, 1, 2):
        scheduler.finished(episode)
    assert scheduler.next_batch() is None


def test_an_episode_busy_elsewhere_does_not_stall_the_others():
    scheduler = Scheduler(batch_wait_s=0.1)
    scheduler.start([0, 1])
    scheduler.submit(GENERATE, 0, "p0", lambda _: None)
    tic = time.monotonic()
    batch = scheduler.next_batch()
    assert [w.episode for w in batch] == [0]
    assert 0.09 <= time.monotonic() - tic < 2.0


def test_batch_wait_must_be_positive():
    with pytest.raises(ValueError, match="batch_wait_s"):
        Scheduler(batch_wait_s=0)


def test_abort_answers_every_queued_request():
    scheduler = Scheduler()
    scheduler.start([0, 1])
    answers = []
    scheduler.submit(GENERATE, 0, "p0", answers.append)
    scheduler.submit(TOOLS, 1, ("search", {}), answers.append)
    error = RuntimeError("engine down")
    scheduler.abort(error)
    assert answers == [error, error]
    assert scheduler.next_batch() is None
