"""Issue 70, item 4: processes that build and read one cache at once never race (dspo/cachedir.py).

A rebuilt index is swapped into place in one step, so a process loading it in a loop meanwhile never finds it missing
or half removed (it used to: the old folder was deleted before the new one was renamed in, and `load_retriever` raised
FileNotFoundError); the build lock lets one process build while the others wait, and a killed holder releases it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dspo.cachedir import build_lock, lock_file, staged_folder, swap_into_place
from dspo.search.bm25 import build_index_streamed
from dspo.types import Passage

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 20
PASSAGES = [Passage(f"p{i}", f"Title {i}", f"text about topic {i % 7} and thing {i}") for i in range(300)]

# rebuilds the index ROUNDS times, alternating the two save paths (both go through staged_index_dir)
REBUILDER = """
import sys, time
from pathlib import Path
from dspo.search.bm25 import BM25Index, build_index_streamed
from dspo.types import Passage
index, rounds, start = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
passages = [Passage(f"p{i}", f"Title {i}", f"text about topic {i % 7} and thing {i}") for i in range(300)]
while not start.exists():
    time.sleep(0.01)
for round in range(rounds):
    if round % 2:
        BM25Index.build(passages, show_progress=False).save(index)
    else:
        build_index_streamed(passages, index, show_progress=False, workers=0)
"""
# loads and queries the index until told to stop; counts its loads
READER = """
import os, sys, time
from pathlib import Path
from dspo.search.bm25 import load_retriever
index, ready, stop = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
loads = 0
ready.touch()
while not stop.exists():
    hits = load_retriever(str(index), cache_size=0).search(["topic 3 thing"], 5)[0]
    assert len(hits) == 5 and all("topic 3" in hit.text for hit in hits), hits
    loads += 1
print("loads", loads)
"""
# checks in a tight loop that the path exists; counts its checks
WATCHER = """
import os, sys
from pathlib import Path
path, ready, stop = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
checks = 0
ready.touch()
while not stop.exists():
    for _ in range(1000):
        if not os.path.lexists(path):
            sys.exit(f"{path} was missing after {checks} checks")
        checks += 1
print("checks", checks)
"""


def start(code: str, *args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(paths: list[Path], processes: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for process in processes:
            if process.poll() is not None:
                pytest.fail(f"a helper process ended before it was ready: {process.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"helpers not ready after {timeout} s"
        time.sleep(0.05)


def finish(process: subprocess.Popen, timeout: float = 120) -> str:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-4000:]
    return out


def count(out: str, word: str) -> int:
    (line,) = [line for line in out.splitlines() if line.startswith(word)]
    return int(line.split()[1])


def test_an_index_rebuilt_20_times_stays_loadable_by_a_reader_in_a_loop(tmp_path):
    index = tmp_path / "bm25"
    build_index_streamed(PASSAGES, index, show_progress=False, workers=0)
    go, stop = tmp_path / "go", tmp_path / "stop"
    reader = start(READER, index, tmp_path / "reader-ready", stop)
    watcher = start(WATCHER, index, tmp_path / "watcher-ready", stop)
    rebuilder = start(REBUILDER, index, ROUNDS, go)
    wait_for([tmp_path / "reader-ready", tmp_path / "watcher-ready"], [reader, watcher])
    time.sleep(0.5)  # the reader's first loads (imports done) before the rebuilds start
    go.touch()
    try:
        finish(rebuilder)
    finally:
        stop.touch()
    loads, checks = count(finish(reader), "loads"), count(finish(watcher), "checks")
    assert loads >= ROUNDS / 2 and checks > 10_000, (loads, checks)  # they overlapped the rebuilds
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".bm25.")]  # no staged or old copy left


def test_a_swap_leaves_no_instant_without_the_folder_and_removes_the_old_one(tmp_path):
    target = tmp_path / "cache"
    (target).mkdir()
    (target / "version").write_text("0")
    stop = tmp_path / "stop"
    watcher = start(WATCHER, target, tmp_path / "ready", stop)
    wait_for([tmp_path / "ready"], [watcher])
    old = (target / "version").open()  # a reader that opened the old folder's file keeps it
    try:
        for round in range(1, 201):
            with staged_folder(target) as staging:
                (staging / "version").write_text(str(round))
    finally:
        stop.touch()
    assert count(finish(watcher), "checks") > 10_000
    assert (target / "version").read_text() == "200" and old.read() == "0"
    old.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no old copy left behind


def test_a_swap_into_a_missing_path_is_a_rename(tmp_path):
    new = tmp_path / "new"
    new.mkdir()
    (new / "f").write_text("x")
    swap_into_place(new, tmp_path / "cache")
    assert (tmp_path / "cache" / "f").read_text() == "x" and not new.exists()


HOLDER = """
import sys, time
from dspo.cachedir import build_lock
with build_lock(sys.argv[1]):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_the_build_lock_waits_for_its_holder_and_is_released_when_the_holder_is_killed(tmp_path, caplog):
    target = tmp_path / "cache"
    holder = start(HOLDER, target)
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert lock_file(target).read_text().split()[0] == str(holder.pid)  # who holds it, for the waiters' log
        late = pytest.raises(TimeoutError, match=f"process {holder.pid} on .* has held the build lock")
        with caplog.at_level("INFO", logger="dspo.cachedir"), late, build_lock(target, timeout_s=0.3):
            pass
        assert f"waiting for process {holder.pid} on" in caplog.text
        os.kill(holder.pid, signal.SIGKILL)  # a crashed builder: the kernel releases its flock
        started = time.monotonic()
        with build_lock(target, timeout_s=30):
            waited = time.monotonic() - started
            with build_lock(target, timeout_s=0.1):  # re-entrant in one thread: no wait on itself
                assert lock_file(target).read_text().split()[0] == str(os.getpid())
    finally:
        holder.kill()
        holder.communicate()
    assert waited < 10
