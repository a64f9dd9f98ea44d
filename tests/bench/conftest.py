"""Fixtures of the bench tests: `bench(name)` imports a script of bench/ as a module, fresh each time."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))

    def load(name: str):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load
