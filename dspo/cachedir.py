"""Cache folders that several processes build and read at once (issue 70, item 4): a build lock and a swap.

On a multi-GPU node every rank runs `prepare` (Lightning's launcher re-runs the command for ranks 1..n) and every rank
and engine process loads the BM25 index of the toy world, building it when it is missing: they all meet on one cache.

- `build_lock(target)`: one process builds `target`, the others wait for it. The lock is an `fcntl.flock` on a hidden
  file beside the folder (`.NAME.lock`, kept: removing a lock file others may hold open would let two holders in).
  After getting it a process re-checks the folder's manifest and adopts what another built meanwhile. Liveness: the
  kernel releases a flock when the last descriptor of it closes, so a holder that crashes or is killed (`kill -9`)
  releases it at once, and a waiter then finds no finished manifest and builds itself (manifests are written last).
  A child forked while the lock is held shares it until that child exits too. No timeout by default: a legitimate
  build takes from seconds (the toy world) to hours (a 21M-passage index); a waiter logs who it waits for every
  `WAIT_LOG_S`, and `timeout_s` bounds the wait where a caller wants that.
- `staged_folder(target)`: build into a fresh sibling, then swap it into place. An existing folder is exchanged with
  the new one in one step (Linux `renameat2(RENAME_EXCHANGE)`), then the old one, now at the sibling's name, is
  removed: at no instant is `target` missing, and a reader that opened (or memory-mapped) files of the old folder keeps
  reading them. Where the file system has no atomic exchange (NFS, another OS) the old folder is renamed aside and the
  new one renamed in: a window of one rename remains there, which the build lock keeps builders out of but a reader
  that does not take the lock can meet.
- `write_atomically(path, text)`: a file written beside `path` and renamed over it (a reader sees the old or the new
  text, never a truncated one).

Stdlib only: any layer may use it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import logging
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often a waiter tries the lock again
WAIT_LOG_S = 60.0  # how often a waiter says it still waits
_held = threading.local()  # lock files this thread holds: a nested build_lock on one of them must not wait on itself


def lock_file(target: str | Path) -> Path:
    """The lock file of the cache folder `target`: `.NAME.lock` beside it (outside it, so a swap never moves it)."""
    target = Path(os.path.abspath(target))  # one key per folder for the re-entrance check, however it is spelled
    return target.parent / f".{target.name}.lock"


@contextmanager
def build_lock(target: str | Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the build lock of the cache folder `target` across processes of this machine (and threads of this one).

    Re-check the folder's manifest inside the block: another process may have finished the build while this one
    waited. Re-entrant within a thread. `timeout_s`: raise TimeoutError after waiting that long (None: wait while the
    holder lives, see the module docstring)."""
    path = lock_file(target)
    held: set[Path] = _held.__dict__.setdefault("paths", set())
    if path in held:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        _acquire(descriptor, Path(target), timeout_s)
        _record_holder(descriptor)
        held.add(path)
        try:
            yield
        finally:
            held.discard(path)
    finally:
        os.close(descriptor)  # releases the lock


def _acquire(descriptor: int, target: Path, timeout_s: float | None) -> None:
    if _try_lock(descriptor):
        return
    holder = _holder(descriptor)
    log.info(
        "%s: waiting for %s, which is building it (lock %s; released when that process exits, even if it crashes)",
        target, holder, lock_file(target),
    )  # fmt: skip
    start = time.monotonic()
    next_log = start + WAIT_LOG_S
    while not _try_lock(descriptor):
        now = time.monotonic()
        if timeout_s is not None and now - start > timeout_s:
            raise TimeoutError(
                f"{target}: {holder} has held the build lock {lock_file(target)} for over {timeout_s:.0f} s; if that "
                "process hangs, stop it (its lock is released when it exits) and run again"
            )
        if now >= next_log:
            log.info("%s: still waiting for %s after %.0f s", target, holder, now - start)
            next_log = now + WAIT_LOG_S
        time.sleep(POLL_S)
    waited = time.monotonic() - start
    log.info("%s: %s finished after %.1f s of waiting; re-checking what it built", target, holder, waited)


def _try_lock(descriptor: int) -> bool:
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _record_holder(descriptor: int) -> None:
    """Write this process into the lock file, for the log line of whoever waits for it."""
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)


def _holder(descriptor: int) -> str:
    """Who holds the lock, as its holder wrote it (best effort: it may not have written it yet)."""
    fields = os.pread(descriptor, 256, 0).decode(errors="replace").split()
    return f"process {fields[0]} on {fields[1]}" if len(fields) == 2 else "another process"


@contextmanager
def staged_folder(target: str | Path) -> Iterator[Path]:
    """A fresh empty folder beside `target` to build into: swapped into place at `target` when the block succeeds
    (`swap_into_place`), removed when it fails. The caller decides whether `target` may be replaced."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(target, "tmp")
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    swap_into_place(staging, target)


def swap_into_place(new: str | Path, target: str | Path) -> None:
    """Make the folder `new` the one at `target`, with no instant at which `target` is missing (where the file system
    can exchange two names atomically), and remove the folder it replaces."""
    new, target = Path(new), Path(target)
    if not os.path.lexists(target):
        try:
            os.rename(new, target)
            return
        except OSError as error:  # another writer put a folder there meanwhile: replace it like any other
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if _exchange(new, target):
        _remove(new)  # `new` names the old folder now; readers that opened its files keep them
        return
    aside = _sibling(target, "old")
    os.rename(target, aside)  # no atomic exchange here: `target` is missing until the next rename
    os.rename(new, target)
    _remove(aside)


def write_atomically(path: str | Path, text: str) -> None:
    """Write `text` to a file beside `path`, then rename it over `path`: readers see the old text or the new one."""
    path = Path(path)
    tmp = _sibling(path, "tmp")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _sibling(target: Path, kind: str) -> Path:
    """A hidden name beside `target` that no other process or build uses."""
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
# errors that say this file system or kernel cannot exchange names (not that something is wrong with the paths)
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _exchange(first: Path, second: Path) -> bool:
    """Swap the names `first` and `second` in one step; False where the system cannot (then nothing moved)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        log.info("%s: the file system cannot exchange names atomically; replacing by two renames", second)
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """glibc's renameat2 (2.28+), or None off Linux or on an older C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function
