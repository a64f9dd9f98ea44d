"""`dspo-index` and `dspo-serve` as a user runs them (subprocesses through the Hydra entry points), `workers=N`
included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hydra import compose, initialize_config_dir

from dspo.search.bm25 import BM25Index
from dspo.search.cli import run_index

REPO = Path(__file__).resolve().parents[2]
TINY_CORPUS = [
    {"id": "a", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "b", "title": "Berlin", "text": "Berlin is the capital of Germany."},
]


def run_cli(entry: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    code = f"from dspo.search.cli import {entry}; {entry}()"
    return subprocess.run(
        [sys.executable, "-c", code, *overrides], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in TINY_CORPUS))
    return path


@pytest.mark.slow
def test_dspo_index_builds_saves_and_refuses_overwrite(tmp_path: Path, corpus: Path) -> None:
    done = run_cli("index_main", "corpus=corpus.jsonl", "output=ix", "backend=rank_bm25", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "of 2 passages" in done.stdout and "digest" in done.stdout and "saved to" in done.stdout
    assert not (tmp_path / "outputs").exists() and not (tmp_path / ".hydra").exists()
    index = BM25Index.load(tmp_path / "ix")
    assert index.backend == "rank_bm25" and index.search(["germany"], 1)[0][0].id == "b"
    again = run_cli("index_main", "corpus=corpus.jsonl", "output=ix", cwd=tmp_path)
    assert again.returncode != 0 and "overwrite=true" in again.stderr


def test_index_config_composes_and_reports_missing_corpus(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("index", overrides=[f"corpus={tmp_path / 'nope.jsonl'}", f"output={tmp_path / 'ix'}"])
    assert (cfg.backend, cfg.k1, cfg.b, cfg.overwrite) == ("bm25s", 1.2, 0.75, False)
    with pytest.raises(FileNotFoundError, match="corpus file not found: .*nope.jsonl"):
        run_index(cfg)


def test_dspo_serve_answers_on_loopback(tmp_path: Path, corpus: Path, dead_port: int) -> None:
    overrides = [f"index={tmp_path / 'ix'}", f"corpus={corpus}", f"port={dead_port}"]
    code = "from dspo.search.cli import serve_main; serve_main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *overrides],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{dead_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "dspo-serve did not come up within 60 s"
            time.sleep(0.2)
        answer = httpx.post(
            f"{url}/retrieve", json={"queries": ["capital of France"], "topk": 1, "return_scores": True}
        )
        assert answer.json()["result"][0][0]["document"]["id"] == "a"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "loaded bm25s index" in out and "2 passages" in out


def test_the_retrieval_commands_start_without_torch() -> None:
    """dspo-index and dspo-serve (and the retriever client the trainer uses) import neither torch nor torchmetrics:
    importing them took 4.2 s before, 0.3 s after (dspo/metrics.py)."""
    code = (
        "import sys, dspo.search.cli, dspo.search.server, dspo.search.client\n"
        "print(sorted(m for m in ('torch', 'torchmetrics', 'transformers', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def _start_serve(tmp_path: Path, corpus: Path, port: int, *overrides: str) -> subprocess.Popen:
    """`dspo-serve` over the tiny corpus on loopback, in its own session; returns once /health answers."""
    code = "from dspo.search.cli import serve_main; serve_main()"
    args = [f"index={tmp_path / 'ix'}", f"corpus={corpus}", f"port={port}", *overrides]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"dspo-serve did not come up: {proc.communicate(timeout=30)[0]}")
        time.sleep(0.2)


def _children(pid: int, count: int, timeout_s: float = 10.0) -> set[int]:
    """The pids of process `pid`'s `count` children (forked one after the other: wait for the last)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while len(pids := {child.pid for child in psutil.Process(pid).children()}) < count:
        assert time.monotonic() < deadline, f"{pids} after {timeout_s}s, expected {count} workers"
        time.sleep(0.05)
    assert len(pids) == count, pids
    return pids


def _worker_pids(url: str, want: int, timeout_s: float = 30.0) -> set[int]:
    """The pids that answer /health (a new connection each time) until `want` distinct ones have answered."""
    pids: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(pids) < want and time.monotonic() < deadline:
        pids.add(httpx.get(f"{url}/health", timeout=5).json()["pid"])
    return pids


def test_dspo_serve_workers_share_one_port_and_stop_on_sigterm(tmp_path: Path, corpus: Path, dead_port: int) -> None:
    import psutil

    proc = _start_serve(tmp_path, corpus, dead_port, "workers=2")
    try:
        url = f"http://127.0.0.1:{dead_port}"
        workers = _children(proc.pid, 2)
        assert _worker_pids(url, 2) == workers  # both forked workers answer on the one port; the parent does not
        body = {"queries": ["capital of France"], "topk": 1}
        assert all(
            httpx.post(f"{url}/retrieve", json=body).json()["result"][0][0]["document"]["id"] == "a" for _ in "ab"
        )
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "from 2 worker processes" in out and "2 workers (pids" in out
    assert not [pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_dspo_serve_workers_die_with_a_killed_parent(tmp_path: Path, corpus: Path, dead_port: int) -> None:
    """Even when the parent is SIGKILLed (no chance to forward anything), no worker lingers holding the port."""
    import psutil

    proc = _start_serve(tmp_path, corpus, dead_port, "workers=2")
    workers = [psutil.Process(pid) for pid in _children(proc.pid, 2)]
    proc.kill()
    proc.communicate(timeout=30)
    try:
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive
    finally:
        for worker in workers:
            if worker.is_running():
                worker.kill()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("workers=0", "workers must be an integer >= 1"),
        ("workers=-1", "workers must be an integer >= 1"),
        ("workers=two", "workers must be an integer >= 1"),
        ("limits.max_pending=0", "limits.max_pending must be an integer >= 1"),
        ("limits.retry_after_s=-1", "limits.retry_after_s must be an integer >= 0"),
    ],
)
def test_dspo_serve_refuses_bad_settings_before_loading(tmp_path: Path, override: str, message: str) -> None:
    done = run_cli("serve_main", f"index={tmp_path / 'missing'}", override, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    key = override.split("=")[0]
    assert message in done.stderr and f"{key}=" in done.stderr.split(message)[1]  # says what to set
    assert "missing" not in done.stderr  # refused before the index was looked for
