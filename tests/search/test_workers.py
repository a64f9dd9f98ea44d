"""dspo/search/workers.py's supervision, with stand-in workers (no index): a worker that dies after serving is
restarted, one that dies at once stops the service with a non-zero exit, a worker that ignores SIGTERM is killed after
the grace period, and no worker outlives the parent."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from dspo.search.workers import bind_socket, check_workers, describe

REPO = Path(__file__).resolve().parents[2]


def _supervise(run_body: str, tmp_path: Path, **supervision: float) -> subprocess.Popen:
    """A process whose `run_workers` forks 2 workers running `run_body` (the body of `run()`)."""
    script = tmp_path / "supervise.py"
    script.write_text(
        "import os, signal, sys, time\nfrom dspo.search.workers import run_workers\n\n"
        f"def run():\n{textwrap.indent(textwrap.dedent(run_body), '    ')}\n\n"
        f"run_workers(run, 2, **{supervision!r})\n"
    )
    return subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _children(proc: subprocess.Popen, count: int, timeout_s: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = {child.pid for child in psutil.Process(proc.pid).children() if child.status() != "zombie"}
        if len(pids) == count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"not {count} workers after {timeout_s}s")


def _gone(pids: set[int]) -> bool:
    return not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_a_worker_that_dies_after_serving_is_restarted_and_sigterm_stops_all(tmp_path: Path) -> None:
    proc = _supervise("time.sleep(3600)", tmp_path, min_uptime_s=0.3, grace_s=10.0)
    try:
        first = _children(proc, 2)
        time.sleep(0.5)  # past min_uptime_s: a worker that served
        victim = min(first)
        psutil.Process(victim).kill()
        deadline = time.monotonic() + 30
        while (now := _children(proc, 2)) == first or victim in now:
            assert time.monotonic() < deadline, "the killed worker was not replaced"
            time.sleep(0.05)
        assert len(now & first) == 1  # the other worker kept running
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"worker {victim} was killed by signal 9 (SIGKILL) after serving" in out and "restarted as pid" in out
    assert _gone(first | now)


def test_a_worker_that_dies_at_once_stops_the_service_non_zero(tmp_path: Path) -> None:
    marker = tmp_path / "survivor.pid"
    body = f"""
    try:  # the first worker here survives (and says who it is); the other dies at once, as a broken one would
        fd = os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        while not open({str(marker)!r}).read():  # the survivor's pid is written: the test can check it stopped
            time.sleep(0.01)
        sys.exit(3)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(3600)
    """
    proc = _supervise(body, tmp_path, min_uptime_s=5.0)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    assert "exited with status 3" in out and "it would die again" in out and "stopped the other workers" in out
    assert _gone({int(marker.read_text())})


def test_a_worker_that_ignores_sigterm_is_killed_after_grace_s(tmp_path: Path) -> None:
    body = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(3600)"
    proc = _supervise(body, tmp_path, grace_s=1.0)
    try:
        workers = _children(proc, 2)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and 1.0 <= time.monotonic() - start < 10, out
    assert _gone(workers)


def test_workers_and_port_errors_name_what_to_change() -> None:
    assert check_workers(3) == 3
    for bad in (0, -2, True, 1.5, "2"):
        with pytest.raises(ValueError, match="workers must be an integer >= 1"):
            check_workers(bad)
    with bind_socket("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port} .*port=PORT"):
            bind_socket("127.0.0.1", port)
    assert describe(3 << 8) == "exited with status 3" and describe(9) == "was killed by signal 9 (SIGKILL)"
