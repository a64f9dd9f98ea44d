"""The engine process's replies to its trainer, read where a half-written message cannot block (issue 53, point 4).

A `multiprocessing.Queue` read with `get(timeout=...)` polls, sees the first bytes of a message, and `recv_bytes` then
waits for the rest. An engine process killed while it wrote a round never sends the rest, and no EOF comes because the
trainer's own queue object keeps the pipe's write end open: the trainer hung in `EngineProcess._wait` (4 of 5 kills
during a k = 1 run did). Here:

- the replies travel over a one-way pipe whose write end only the engine process holds (the trainer closes its copy
  right after the spawn), so its death is an EOF;
- a thread of the trainer reads them (`Replies`) and hands whole messages to a local queue; the trainer's main thread
  waits on that queue in slices and checks the engine process's liveness between them, so a message cut short (or an
  EOF that never comes, a forked grandchild holding the write end) blocks only that thread;
- the engine process writes under a lock (`ReplySender`): its weight receiver thread reports a failure on the same
  pipe as its main thread's rounds.

`ReplySender.put(message, point)` is where the fault harness kills the engine process mid-write (`engine.mid_write_*`,
`dspo.rollout.faults`): the frame's header and half its bytes are written, then the point is reached.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from dspo.rollout.faults import armed, fault_point

_CLOSED = object()  # what the reader thread hands on at EOF


class Replies:
    """Trainer side: whole messages of the engine process, read by a thread (`get` never blocks on a partial one)."""

    def __init__(self, reader: Connection) -> None:
        self._reader = reader
        self._messages: queue.Queue = queue.Queue()
        self.closed = False  # EOF seen: the write end is closed everywhere
        self._thread = threading.Thread(target=self._read, name="dspo-engine-replies", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while True:
                self._messages.put(self._reader.recv())
        except (EOFError, OSError):  # the engine process ended (its write end closed), or `close` closed ours
            pass
        except Exception as error:  # noqa: BLE001 - an unreadable message: the trainer raises it at its next wait
            self._messages.put(error)
        self._messages.put(_CLOSED)

    def get(self, timeout: float) -> Any:
        """The next message within `timeout` seconds; `queue.Empty` if none (none yet, or none will come: EOF)."""
        if self.closed:
            raise queue.Empty
        message = self._messages.get(timeout=timeout)
        if message is _CLOSED:
            self.closed = True
            raise queue.Empty
        if isinstance(message, Exception):
            raise RuntimeError(f"a reply of the engine process could not be read: {message}") from message
        return message

    def get_nowait(self) -> Any:
        if self._messages.empty():
            raise queue.Empty
        return self.get(timeout=0.0)

    def close(self) -> None:
        """After the engine process ended: its EOF ends the thread (a forked grandchild still holding the write end
        would keep it blocked, as a daemon thread, until that one exits)."""
        self._thread.join(0.5)
        if not self._thread.is_alive():
            self._reader.close()


class ReplySender:
    """Engine side: the write end, pickled into the engine process at spawn. `put` as a queue's, but synchronous: when
    it returns the message is in the pipe, whole, and the trainer reads it even if this process dies next."""

    def __init__(self, writer: Connection) -> None:
        self._writer = writer
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"writer": self._writer}

    def __setstate__(self, state: dict) -> None:
        self._writer, self._lock = state["writer"], threading.Lock()

    def put(self, message: Any, point: str | None = None) -> None:
        """Send `message`; `point`: the fault point reached mid-write (only when DSPO_FAULT arms it)."""
        data = bytes(ForkingPickler.dumps(message))
        with self._lock:
            if point is None or not armed(point):
                self._writer.send_bytes(data)
                return
            # Connection's own framing (a 4-byte big-endian length, then the bytes), written in two parts
            frame = struct.pack("!i", len(data)) + data if len(data) < 0x7FFFFFFF else None
            if frame is None:
                self._writer.send_bytes(data)
                return
            half = 4 + len(data) // 2
            _write_all(self._writer.fileno(), frame[:half])
            fault_point(point)
            _write_all(self._writer.fileno(), frame[half:])

    def cancel_join_thread(self) -> None:
        """Nothing to cancel: no feeder thread (kept so the engine process treats it as it treated its queue)."""

    def close(self) -> None:
        self._writer.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
