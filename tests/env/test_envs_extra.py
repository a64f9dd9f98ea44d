"""The `envs` extra (pyproject.toml) and the packages scripts/setup.sh installs without their requirements (NO_DEPS):
what is installed is what they declare, and each standard imports with it."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _no_deps() -> list[Requirement]:
    text = (REPO / "scripts/setup.sh").read_text()
    (line,) = re.findall(r"^NO_DEPS=\((.*)\)$", text, flags=re.M)
    return [Requirement(name) for name in re.findall(r'"([^"]+)"', line)]


def test_setup_pins_the_standards_it_installs_without_requirements() -> None:
    pinned = {r.name: r for r in _no_deps()}
    assert set(pinned) == {"openenv-core", "verifiers"}
    for name, requirement in pinned.items():
        assert Version(metadata.version(name)) in requirement.specifier, f"{name} {metadata.version(name)} installed"


def test_every_requirement_of_the_envs_extra_is_installed() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for line in extras["envs"]:
        requirement = Requirement(line)
        assert Version(metadata.version(requirement.name)) in requirement.specifier, line


@pytest.mark.parametrize(
    "module", ["reasoning_gym", "openenv.core", "openenv.core.env_server.http_server", "verifiers.v1"]
)
def test_each_standard_imports(module: str) -> None:
    importlib.import_module(module)


def test_the_no_deps_packages_left_the_core_pins_alone() -> None:
    """verifiers asks for openai<3 and mcp==2.0.0, openenv-core for gradio (pillow<13): the versions dspo runs with
    stay (the reason they are installed with --no-deps)."""
    assert Version(metadata.version("openai")) >= Version("3")
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("gradio")
