"""`dspo-index` and `dspo-serve` as a user runs them (subprocesses through the Hydra entry points)."""

from __future__ import annotations

import json
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
