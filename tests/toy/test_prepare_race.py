"""Issue 70, item 4: two processes running the toy `prepare` step on one empty cache at once, as the ranks of a node
do, both succeed; each cache folder (world, tokenizer, model) is built or adopted by exactly one of them, and the other
waits for it (dspo.cachedir.build_lock) and then uses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# the `prepare` of `dspo-train` (every rank runs it), started by both processes at the same instant (the `go` file)
PREPARE = """
import logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
from hydra import compose, initialize_config_dir
import dspo.toy.warmstart  # imported before the start line: the two processes overlap in the builds themselves
from dspo.train import CONF_DIR, prepare
with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
    cfg = compose(config_name="train", overrides=["output_dir=/tmp"])
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
ready.touch()
while not go.exists():
    time.sleep(0.005)
prepare(cfg)
"""


def start_prepare(cache: Path, ready: Path, go: Path) -> subprocess.Popen:
    env = {**os.environ, "DSPO_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", PREPARE, str(ready), str(go)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_preparing_one_empty_cache_build_each_folder_once(tmp_path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    processes = [start_prepare(cache, flag, go) for flag in ready]
    deadline = time.monotonic() + 120
    while not all(flag.exists() for flag in ready):
        assert all(p.poll() is None for p in processes), [p.communicate()[1][-3000:] for p in processes]
        assert time.monotonic() < deadline, "the prepare processes did not start within 120 s"
        time.sleep(0.05)
    go.touch()
    logs = []
    for process in processes:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-4000:]
        logs.append(err)
    both = "\n".join(logs)
    root = cache / "toyworld" / "default"
    assert both.count("toy world: built") == 1, both
    assert both.count(f"into {root / 'tokenizer'} (shipped") == 1, both
    assert both.count(f"into {root / 'model'} (shipped") == 1, both
    assert "which is building it" in both, both  # the other process waited for a build, then used it
    assert json.loads((root / "world" / "manifest.json").read_text())["config_hash"]
    assert (root / "model" / "warmstart_manifest.json").is_file() and (root / "tokenizer" / "tokenizer.json").is_file()
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name]  # no staged copy left
