"""The benchmark scripts write to the user's outputs/bench/, and the tracked bench/results/ only with --update-shipped
(their argument parsing; the benchmarks themselves take minutes and are not run here)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# script -> (the JSON it writes, its output flag)
BENCHES = {
    "async": ("async.json", "--out"),
    "retrieval": ("retrieval.json", "--out"),
    "rollout": ("rollout.json", "--out"),
    "train_step": ("train_step.json", "--output"),
    "vs_trl": ("vs_trl.json", "--out"),
}


@pytest.fixture()
def bench_module(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # as when the script runs: its siblings import by name

    def load(name: str):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load


@pytest.mark.parametrize("script", sorted(BENCHES))
def test_bench_output_defaults_to_the_users_outputs(script: str, bench_module) -> None:
    name, flag = BENCHES[script]
    module = bench_module(script)
    attribute = flag.lstrip("-")
    default = Path(getattr(module.parse_args([]), attribute))
    assert default == Path("outputs") / "bench" / name  # relative to the working directory, like dspo-train's
    assert "outputs/" in (REPO / ".gitignore").read_text().splitlines()  # never a tracked file
    shipped = Path(getattr(module.parse_args(["--update-shipped"]), attribute))
    assert shipped == REPO / "bench" / "results" / name
    assert Path(getattr(module.parse_args([flag, "/tmp/x.json"]), attribute)) == Path("/tmp/x.json")
    with pytest.raises(SystemExit):
        module.parse_args([flag, "/tmp/x.json", "--update-shipped"])
