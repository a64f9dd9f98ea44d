"""The reply channel (`dspo.rollout.channel`) in one process: `ReplySender` and `Replies` over a real
`multiprocessing.Pipe(duplex=False)`, the bytes in the pipe read with `os.read` where the framing is the point.
tests/rollout/test_channel.py spawns the engine process's side; here its code runs where a test sees it (issue 70)."""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
from multiprocessing import Pipe
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest

from dspo.rollout import channel, faults
from dspo.rollout.channel import Replies, ReplySender, _write_all
from dspo.rollout.faults import FaultInjected
from dspo.testing import within

ROUND = "engine.mid_write_round"
PREDICTIONS = "engine.mid_write_predictions"
PIPE_BUFFER = 65_536  # Linux's default pipe capacity


@pytest.fixture(autouse=True)
def no_fault(monkeypatch):
    """No DSPO_FAULT from the environment, and the harness's hit counts from zero."""
    monkeypatch.delenv("DSPO_FAULT", raising=False)
    monkeypatch.setattr(faults, "_hits", {})


@pytest.fixture
def pipe():
    """A one-way pipe as the engine process's replies travel over: (read end, write end); both closed afterwards."""
    reader, writer = Pipe(duplex=False)
    yield reader, writer
    for end in (writer, reader):
        if not end.closed:
            end.close()


@pytest.fixture
def replies(pipe):
    """`Replies` on the pipe's read end. Afterwards the write end closes first and its thread is joined before the
    read end closes: a read end closed under a thread about to read it, its number reused by the next test's pipe,
    would have that thread read the next test's bytes (what `Replies.close` avoids)."""
    reader, writer = pipe
    replies = Replies(reader)
    yield replies
    if not writer.closed:
        writer.close()
    replies._thread.join(5)
    replies.close()


def _framed(message) -> bytes:
    """`message` as `Connection.send_bytes` frames it: a 4-byte big-endian length, then its pickle."""
    data = bytes(ForkingPickler.dumps(message))
    return struct.pack("!i", len(data)) + data


def _buffered(fd: int) -> bytes:
    """Every byte in the pipe now, without waiting for more."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, PIPE_BUFFER):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.set_blocking(fd, True)
    return b"".join(chunks)


def _read_to_eof(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, PIPE_BUFFER):
        chunks.append(chunk)
    return b"".join(chunks)


def _explode(text: str):
    raise ValueError(text)


class _Unreadable:
    """Pickles fine; unpickling it raises ValueError("no such reply")."""

    def __reduce__(self):
        return _explode, ("no such reply",)


# ------------------------------------------------------------------------------------------------ ReplySender
@pytest.mark.parametrize("point", [None, ROUND])  # DSPO_FAULT unset: a named point is not armed
def test_a_put_writes_connections_own_frame_of_the_message(pipe, point):
    reader, writer = pipe
    message = {"answers": ["x", "y"], "n": 3}
    ReplySender(writer).put(message, point=point)
    assert _buffered(reader.fileno()) == _framed(message)


def test_messages_of_every_size_arrive_whole_and_in_order(pipe, replies):
    """Empty, small and several pipe buffers large (written from a thread: the pipe fills until the reader reads)."""
    _, writer = pipe
    messages = [b"", None, {}, {"round": 1}, b"r" * (4 * PIPE_BUFFER + 7), list(range(20_000)), "last"]
    sender = ReplySender(writer)
    thread = threading.Thread(target=lambda: [sender.put(message, point=ROUND) for message in messages])
    thread.start()
    assert [replies.get(timeout=10) for _ in messages] == messages
    thread.join(10)
    assert replies.closed is False


@pytest.mark.parametrize("point", [ROUND, PREDICTIONS])
@pytest.mark.parametrize("size", [1, 1_001, 20_000])
def test_the_armed_point_is_reached_with_the_header_and_half_the_bytes_written(pipe, monkeypatch, point, size):
    reader, writer = pipe
    monkeypatch.setenv("DSPO_FAULT", f"{point}=raise")
    message = b"m" * size
    data = bytes(ForkingPickler.dumps(message))
    with pytest.raises(FaultInjected, match=point):
        ReplySender(writer).put(message, point=point)
    assert _buffered(reader.fileno()) == struct.pack("!i", len(data)) + data[: len(data) // 2]


def test_a_reply_larger_than_the_pipe_is_cut_at_half_when_the_point_is_reached(pipe, monkeypatch):
    """The first half alone fills the pipe several times: it is written whole before the point."""
    reader, writer = pipe
    monkeypatch.setenv("DSPO_FAULT", f"{ROUND}=raise")
    message = {"answers": "a" * (6 * PIPE_BUFFER + 3)}
    data = bytes(ForkingPickler.dumps(message))
    raised = []

    def send() -> None:
        try:
            ReplySender(writer).put(message, point=ROUND)
        except FaultInjected as error:
            raised.append(error)
        finally:
            writer.close()

    thread = threading.Thread(target=send)
    thread.start()
    written = _read_to_eof(reader.fileno())
    thread.join(10)
    assert raised and written == struct.pack("!i", len(data)) + data[: len(data) // 2]


def test_an_armed_point_before_its_hit_passes_and_the_message_arrives_whole(pipe, replies, monkeypatch):
    """`#3`: the first two puts reach the point, write their second halves and arrive; the third is cut."""
    _, writer = pipe
    monkeypatch.setenv("DSPO_FAULT", f"{ROUND}#3=raise")
    sender = ReplySender(writer)
    first, second = {"round": 0, "tokens": "t" * 5_000}, {"round": 1, "tokens": "u" * 50_000}
    sender.put(first, point=ROUND)
    sender.put(second, point=ROUND)
    assert replies.get(timeout=5) == first and replies.get(timeout=5) == second
    with pytest.raises(FaultInjected, match=r"hit 3"):
        sender.put({"round": 2}, point=ROUND)
    writer.close()  # the third's EOF mid-message: never handed on, only the end
    with pytest.raises(queue.Empty):
        replies.get(timeout=5)
    assert replies.closed


@pytest.mark.parametrize("fault", [None, f"{PREDICTIONS}=raise"])
def test_a_point_dspo_fault_does_not_arm_is_never_reached(pipe, monkeypatch, fault):
    """Its message goes out as one `send_bytes`, and the harness counts no hit for it."""
    reader, writer = pipe
    if fault:
        monkeypatch.setenv("DSPO_FAULT", fault)
    reached = []
    monkeypatch.setattr(channel, "fault_point", reached.append)
    sender = ReplySender(writer)
    sender.put("round", point=ROUND)
    sender.put("failure")
    assert reached == []
    assert reader.recv() == "round" and reader.recv() == "failure"


def test_two_threads_putting_at_once_each_message_arrives_whole(pipe, replies):
    """The weight receiver thread reports on the pipe its main thread's rounds use: the lock keeps their frames
    whole (`send_bytes` writes a frame larger than 16 kB in two writes)."""
    _, writer = pipe
    sender = ReplySender(writer)
    count = 40

    def put_all(who: str) -> None:
        for index in range(count):
            sender.put((who, index, who * (17_000 + 311 * index)), point=ROUND)

    threads = [threading.Thread(target=put_all, args=(who,)) for who in "ab"]
    for thread in threads:
        thread.start()
    received = [replies.get(timeout=10) for _ in range(2 * count)]
    for thread in threads:
        thread.join(10)
    for who in "ab":
        mine = [message for message in received if message[0] == who]
        assert mine == [(who, index, who * (17_000 + 311 * index)) for index in range(count)]


def test_a_put_from_another_thread_waits_for_a_write_paused_at_the_armed_point(pipe, replies, monkeypatch):
    """The round's first half is in the pipe and its thread is at the point when the receiver thread reports a
    failure: the failure's frame follows the round's whole frame, never lands inside it."""
    _, writer = pipe
    paused, failure_sent = threading.Event(), threading.Event()

    def pause(point: str) -> None:  # the point holds the round's thread until the failure is out (at most 0.3 s)
        paused.set()
        failure_sent.wait(0.3)

    monkeypatch.setattr(channel, "armed", lambda point: point == ROUND)
    monkeypatch.setattr(channel, "fault_point", pause)
    sender = ReplySender(writer)
    round_reply = {"round": 3, "tokens": "r" * 9_000}
    rounds = threading.Thread(target=sender.put, args=(round_reply, ROUND))
    rounds.start()
    assert paused.wait(5)
    receiver = threading.Thread(target=lambda: (sender.put("the receiver failed"), failure_sent.set()))
    receiver.start()
    assert replies.get(timeout=5) == round_reply
    assert replies.get(timeout=5) == "the receiver failed"
    for thread in (rounds, receiver):
        thread.join(5)


def test_a_reply_of_2_gib_or_more_at_an_armed_point_goes_through_send_bytes(monkeypatch):
    """Connection's 4-byte header cannot say its length (`send_bytes` frames it with a longer one): it is sent whole,
    the point not reached. The bytes are calloc'ed zeros no page of which is touched; the writer records them."""
    monkeypatch.setenv("DSPO_FAULT", f"{ROUND}=raise")
    huge = bytes(0x80000000)
    monkeypatch.setattr(channel, "ForkingPickler", SimpleNamespace(dumps=lambda message: huge))
    sent = []
    writer = SimpleNamespace(send_bytes=sent.append, fileno=lambda: pytest.fail("written around send_bytes"))
    ReplySender(writer).put("a huge round", point=ROUND)
    assert len(sent) == 1 and sent[0] is huge


def test_write_all_writes_everything_across_partial_writes(monkeypatch):
    """`os.write` may write less than asked (a signal mid-write, a full pipe): the rest is written after it."""
    calls = []

    def short_write(fd: int, data) -> int:
        calls.append(len(data))
        return os.write(fd, bytes(data[:7]))

    monkeypatch.setattr(channel, "os", SimpleNamespace(write=short_write))
    read_fd, write_fd = os.pipe()
    try:
        data = bytes(range(256)) * 4 + b"tail"
        _write_all(write_fd, data)
        os.close(write_fd)
        assert _read_to_eof(read_fd) == data
        assert len(calls) == -(-len(data) // 7)
    finally:
        os.close(read_fd)


def test_a_put_at_an_armed_point_survives_partial_writes(pipe, monkeypatch):
    reader, writer = pipe
    monkeypatch.setenv("DSPO_FAULT", f"{ROUND}#2=raise")
    real_write = os.write
    monkeypatch.setattr(channel, "os", SimpleNamespace(write=lambda fd, data: real_write(fd, bytes(data[:5]))))
    message = {"round": 0, "tokens": list(range(300))}
    ReplySender(writer).put(message, point=ROUND)
    assert reader.recv() == message


def test_a_pickled_sender_writes_to_the_same_pipe_under_a_fresh_lock(pipe):
    """As spawn pickles it into the engine process (a duplicated write end; a lock is not picklable): the copy's
    lock is its own, free even while the original's is held."""
    reader, writer = pipe
    sender = ReplySender(writer)
    with sender._lock:
        copy = ForkingPickler.loads(ForkingPickler.dumps(sender))
        assert copy._lock is not sender._lock
        within(5, lambda: copy.put({"from": "the copy"}, point=ROUND))
    assert reader.recv() == {"from": "the copy"}
    copy.close()
    sender.put("the original still writes")
    assert reader.recv() == "the original still writes"


def test_a_closed_sender_is_an_eof_for_the_reader(pipe):
    reader, writer = pipe
    sender = ReplySender(writer)
    sender.cancel_join_thread()  # nothing to cancel; the sender still writes
    sender.put("last")
    sender.close()
    assert writer.closed and reader.recv() == "last"
    with pytest.raises(EOFError):
        reader.recv()


# ---------------------------------------------------------------------------------------------------- Replies
def test_the_reader_is_a_daemon_thread_named_for_thread_dumps(replies):
    """A daemon: a forked grandchild holding the write end open keeps it blocked, never the trainer's exit."""
    assert replies._thread.daemon is True and replies._thread.is_alive()
    assert replies._thread.name == "dspo-engine-replies"
    assert replies._thread in threading.enumerate()


def test_get_raises_empty_within_its_timeout_while_no_message_comes(pipe, replies):
    _, writer = pipe
    sender = ReplySender(writer)
    start = time.perf_counter()
    try:
        with pytest.raises(queue.Empty):
            within(2, lambda: replies.get(timeout=0.05))
    finally:
        sender.put("later")  # what a get that waited for ever would take
    assert time.perf_counter() - start < 1.0
    assert replies.closed is False
    assert replies.get(timeout=5) == "later"


def test_after_eof_get_raises_empty_at_once_and_the_replies_are_closed(pipe, replies):
    """What was written whole before the write end closed is still read, then the EOF: `closed`, and no wait."""
    _, writer = pipe
    sender = ReplySender(writer)
    sender.put("first")
    sender.put({"second": 2})
    assert replies.closed is False
    writer.close()
    assert replies.get(timeout=5) == "first" and replies.get(timeout=5) == {"second": 2}
    with pytest.raises(queue.Empty):
        replies.get(timeout=5)
    assert replies.closed is True
    start = time.perf_counter()
    for _ in range(3):
        with pytest.raises(queue.Empty):
            replies.get(timeout=30)
    assert time.perf_counter() - start < 3.0


def test_a_message_cut_short_by_eof_is_never_handed_on(pipe, replies):
    """The header and part of a message, then the write end closes (the engine process died mid-write)."""
    _, writer = pipe
    frame = _framed({"round": 7, "tokens": "z" * 1_000})
    _write_all(writer.fileno(), frame[: len(frame) // 2])
    with pytest.raises(queue.Empty):
        within(2, lambda: replies.get(timeout=0.1))
    assert replies.closed is False
    writer.close()
    with pytest.raises(queue.Empty):
        replies.get(timeout=5)
    assert replies.closed is True


def test_an_unreadable_message_is_raised_as_a_runtime_error_with_its_text(pipe, replies):
    _, writer = pipe
    sender = ReplySender(writer)
    sender.put("readable")
    sender.put(_Unreadable())
    assert replies.get(timeout=5) == "readable"
    with pytest.raises(
        RuntimeError, match=r"^a reply of the engine process could not be read: no such reply$"
    ) as raised:
        replies.get(timeout=5)
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(queue.Empty):  # the reader stopped there
        replies.get(timeout=5)
    assert replies.closed is True


def test_get_nowait_hands_on_what_has_arrived_and_never_waits(pipe, replies):
    _, writer = pipe
    start = time.perf_counter()
    with pytest.raises(queue.Empty):
        replies.get_nowait()
    assert time.perf_counter() - start < 1.0
    ReplySender(writer).put("arrived")
    deadline = time.perf_counter() + 5
    while replies._messages.empty() and time.perf_counter() < deadline:
        time.sleep(0.005)
    assert replies.get_nowait() == "arrived"
    writer.close()
    replies._thread.join(5)
    with pytest.raises(queue.Empty):
        replies.get_nowait()
    assert replies.closed is True


def test_close_after_eof_ends_the_thread_and_closes_the_read_end(pipe, replies):
    reader, writer = pipe
    writer.close()
    with pytest.raises(queue.Empty):
        replies.get(timeout=5)
    replies.close()
    assert not replies._thread.is_alive() and reader.closed


def test_close_while_the_write_end_is_open_returns_in_a_second_leaving_the_read_end_to_the_thread(pipe, replies):
    """A forked grandchild still holds the write end: `close` waits half a second for the thread, then leaves it
    (and the read end it is blocked on) alone; the EOF that comes later ends it."""
    reader, writer = pipe
    start = time.perf_counter()
    try:
        within(3, replies.close)
        assert time.perf_counter() - start < 1.25  # the thread's half second, not 1.5
        assert replies._thread.is_alive() and not reader.closed
    finally:
        writer.close()
    replies._thread.join(5)
    assert not replies._thread.is_alive()
    replies.close()
    assert reader.closed
