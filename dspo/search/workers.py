"""`dspo-serve workers=N`: N processes serving one index on one port.

The parent loads the index once, binds the listening socket itself, then forks N workers that each run uvicorn on
that inherited socket (the kernel hands each new connection to one of the processes accepting on it). Forked after
the load, the workers share the index: bm25s matrices memory-mapped (`mmap: true`) share the page cache, and the
passages' Python objects are shared copy-on-write (`gc.freeze()` keeps the collector from writing to them; reference
counts still copy the pages a worker reads, a few at a time). Per worker: the back-pressure count
(`limits.max_pending` applies to each worker) and any cache the retriever keeps in-process.

Supervision: the parent forwards SIGINT/SIGTERM to the workers as SIGTERM (uvicorn's graceful shutdown answers the
requests in flight), waits up to `grace_s` for them, kills what is left, and returns; a second signal kills them at
once. A worker that dies unexpectedly after serving for `min_uptime_s` (the OOM killer, a crash) is restarted at once,
as a fresh fork of the parent with the index already loaded, so one worker's death does not take down the service a
training run depends on. A worker that dies sooner than that would only die again: the parent stops the others and
exits non-zero naming its exit status. On Linux the workers also die with the parent (PR_SET_PDEATHSIG), even when it
is SIGKILLed, so none lingers as an orphan holding the port.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import uvicorn

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def check_workers(workers: object) -> int:
    """`workers` as a validated count of worker processes."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(
            f"workers must be an integer >= 1 (processes serving the index), got {workers!r}; "
            "use workers=1 for one process, or workers=N for N processes on one port"
        )
    return workers


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket every worker accepts on (bound once, by the parent, before forking)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as err:
        raise ValueError(
            f"cannot listen on {host}:{port} ({err.strerror}); choose another port=PORT (or host=), or stop the "
            "process that uses it"
        ) from None


def describe(status: int) -> str:
    """A waitpid status in words."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with status {code}"


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this worker when the parent dies, even by SIGKILL, so it does not outlive it holding the port."""
    # no prctl (not Linux): the parent's own shutdown still stops the workers
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(run: Callable[[], object], parent: int) -> NoReturn:
    """The forked worker: default signal handling (uvicorn installs its own while it serves), then `run`. Never
    returns into the parent's stack (Hydra's, a test runner's): it leaves with os._exit."""
    status = 1
    try:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked by the parent around fork()
        _die_with_parent(parent)
        run()
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - a worker's crash is reported (and handled) by the parent
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _reap(children: dict[int, float]) -> list[tuple[int, int]]:
    """(pid, status) of the `children` that have exited, without blocking; only our own workers are waited for."""
    done = []
    for pid in list(children):
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # already reaped (cannot happen here, but never loop on it)
            reaped, status = pid, 0
        if reaped:
            done.append((pid, status))
    return done


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, sig)


def run_workers(
    run: Callable[[], object],
    workers: int,
    min_uptime_s: float = 10.0,
    grace_s: float = 30.0,
    log: Callable[[str], None] = lambda line: print(f"[dspo-serve] {line}", flush=True),
) -> None:
    """Fork `workers` processes that each call `run` (which serves until SIGTERM) and supervise them (module
    docstring) until SIGINT/SIGTERM; raises SystemExit (non-zero) when a worker dies within `min_uptime_s` of its
    start. Call it from the main thread of a process that has no other children to supervise."""
    check_workers(workers)
    parent = os.getpid()
    children: dict[int, float] = {}  # pid -> monotonic time it started
    stop: list[int] = []

    def spawn() -> int:
        # a stop signal must not reach the child before it resets its handlers (it would run ours and be lost)
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            pid = os.fork()
            if pid == 0:
                _worker_main(run, parent)
            children[pid] = time.monotonic()
            return pid
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)

    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.append(signum)) for sig in _STOP_SIGNALS}
    failure = ""
    try:
        gc.freeze()  # objects loaded so far (the index) move out of the collector's reach: its writes would copy pages
        for _ in range(workers):
            spawn()
        log(f"{workers} workers (pids {', '.join(map(str, children))}) on one socket; parent pid {parent}")
        while not stop and not failure:
            for pid, status in _reap(children):
                uptime = time.monotonic() - children.pop(pid)
                if uptime < min_uptime_s:
                    failure = (
                        f"worker {pid} {describe(status)} {uptime:.1f}s after it started (sooner than "
                        f"{min_uptime_s:.0f}s: it would die again); stopped the other workers. Its output says why."
                    )
                    break
                log(f"worker {pid} {describe(status)} after serving {uptime:.0f}s; restarted as pid {spawn()}")
            time.sleep(0.1)
        _stop_all(children, grace_s, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise SystemExit(f"[dspo-serve] {failure}")


def _stop_all(children: dict[int, float], grace_s: float, stop: list[int]) -> None:
    """SIGTERM every worker, wait up to `grace_s` (or until a second stop signal), SIGKILL what is left, reap all."""
    _kill(list(children), signal.SIGTERM)
    deadline, forced, signals_seen = time.monotonic() + grace_s, False, len(stop)
    while children:
        for pid, _status in _reap(children):
            children.pop(pid)
        if children and not forced and (time.monotonic() > deadline or len(stop) > signals_seen):
            _kill(list(children), signal.SIGKILL)
            forced = True
        time.sleep(0.05)


def serve_workers(config: uvicorn.Config, workers: int, **supervision: float) -> None:
    """Serve uvicorn `config` (`server_config`'s) from `workers` processes on one socket bound to its host and port;
    `supervision`: `run_workers`' min_uptime_s and grace_s."""
    import uvicorn

    sock = bind_socket(config.host, config.port, config.backlog)
    try:
        run_workers(lambda: uvicorn.Server(config).run(sockets=[sock]), workers, **supervision)
    finally:
        sock.close()
