"""pyproject.toml: the minimum versions it declares can run the APIs dspo calls."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]

# (distribution, first version with the API, the file that uses it, the call as written there, what it is)
NEEDS = [
    ("lightning", "2.6", "dspo/train.py", "weights_only=True)", "Trainer.fit(weights_only=...)"),
    ("torch", "2.6", "dspo/models/fsdp.py", "from torch.distributed.fsdp import fully_shard", "public fully_shard"),
    (
        "torch",
        "2.8",
        "dspo/models/fsdp.py",
        "reshard_after_forward=True if frozen else None",
        "fully_shard(reshard_after_forward=None), and True honoured for a root module (pytorch#155319, #154704)",
    ),
    ("transformers", "4.56", "dspo/models/__init__.py", '{"dtype": config.torch_dtype', "from_pretrained(dtype=...)"),
    ("transformers", "4.56", "dspo/engines/hf.py", "dtype=getattr(torch, dtype)", "from_pretrained(dtype=...)"),
]


def _floors() -> dict[str, Version]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floors = {}
    for line in project["dependencies"]:
        requirement = Requirement(line)
        lows = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
        if lows:
            floors[requirement.name] = max(lows)
    return floors


@pytest.mark.parametrize(("name", "needed", "path", "call", "what"), NEEDS, ids=[n[4] for n in NEEDS])
def test_declared_minimum_versions_cover_the_apis_the_code_uses(name, needed, path, call, what):
    assert call in (REPO / path).read_text(), f"{path} no longer calls {call!r}: update NEEDS"
    floor = _floors()[name]
    assert floor >= Version(needed), f"pyproject.toml allows {name} {floor}, but {what} ({path}) needs {needed}"


def test_every_dependency_has_a_floor():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=~!\[ ]", line, maxsplit=1)[0] for line in project["dependencies"]}
    assert names == set(_floors())


def test_dev_installs_every_optional_extra() -> None:
    """`make setup` installs `.[dev]` and CI runs every test: an extra left out of dev would have its tests fail or
    skip there (issue 58: the cluster extra's launchers and Optuna)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (self_extra,) = [Requirement(r) for r in extras["dev"] if Requirement(r).name == "dspo"]
    assert set(extras) - {"dev", "cpu", "gpu"} <= self_extra.extras  # cpu / gpu: scripts/setup.sh picks one
