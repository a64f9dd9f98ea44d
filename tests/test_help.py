"""`dspo-<command> --help` helps (issue 71): what the command does, three examples that compose, where its outputs go,
its docs page (which exists, anchor included) and how to see the whole config, before anything of Hydra's own."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from dspo.testing import HYDRA_COMMANDS, compose_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = HYDRA_COMMANDS


@pytest.fixture(scope="module")
def help_texts() -> dict[str, str]:
    """Every command's `--help`, the six processes started together (each spends its seconds importing)."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "COLUMNS": "120"}
    running = {
        name: subprocess.Popen(
            [str(bin_dir / name), "--help"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for name in CONFIGS
    }
    texts = {}
    for name, process in running.items():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name} --help exited with {process.returncode}:\n{output.decode()}"
        texts[name] = output.decode()
    return texts


def examples(text: str, command: str) -> list[str]:
    """The example lines: the indented `dspo-...` lines of the Examples section, comments cut."""
    section = text.split("Examples", 1)[1].split("\n\n", 1)[0]
    lines = [line.strip() for line in section.splitlines()[1:]]
    return [re.sub(r"\s+#.*$", "", line) for line in lines if line.startswith(command)]


def overrides_of(example: str) -> tuple[list[str], bool]:
    """The Hydra overrides of an example command line, and whether it is a multirun (-m)."""
    words = shlex.split(example)[1:]
    return [w for w in words if not w.startswith("-")], "-m" in words or "--multirun" in words


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """A multirun's jobs, thinned: the i-th takes the i-th value of every swept key (each value in some job)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
        for o in OverridesParser.create().parse_overrides(overrides)
    ]
    return [[v[i % len(v)] for v in values] for i in range(max(len(v) for v in values))]


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_help_says_what_the_command_does_with_examples_outputs_and_docs(help_texts, command):
    text = help_texts[command]
    assert text.startswith(f"{command}: "), "the first line says what the command does"
    assert "is powered by Hydra" not in text, "Hydra's own header, not the command's"
    assert len(examples(text, command)) == 3, "three examples"
    assert "\nOutputs: " in text
    assert "--cfg job" in text, "how to see the whole config"
    docs = re.findall(r"\bdocs/[\w-]+\.md(?:#[\w-]+)?", text.split("Docs: ", 1)[1].split("\n\n", 1)[0])
    assert docs, "a docs page"
    for cited in docs:
        page, _, anchor = cited.partition("#")
        assert (REPO / page).is_file(), f"{cited}: no such page"
        headings = re.findall(r"^#{1,6}\s+(.*?)\s*$", (REPO / page).read_text(), re.MULTILINE)
        slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
        assert not anchor or anchor in slugs, f"{cited}: no such heading"


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_each_help_example_composes(help_texts, command):
    for example in examples(help_texts[command], command):
        overrides, multirun = overrides_of(example)
        for point in sweep_points(overrides) if multirun else [overrides]:
            compose_config(CONFIGS[command], point)  # raises, naming the override, if it does not compose


@pytest.mark.parametrize("command", ["dspo-eval", "dspo-rollout"])
def test_the_groups_a_help_says_its_command_reads_are_its_configs(help_texts, command):
    """Hydra lists every group of conf/; the help says which its command reads: those of its defaults list."""
    stated = re.search(rf"{command} reads ([\w/, ]+), the others", help_texts[command]).group(1).split(", ")
    defaults = OmegaConf.load(REPO / "conf" / f"{CONFIGS[command]}.yaml").defaults
    groups = [key for entry in defaults if isinstance(entry, DictConfig) for key in entry if " " not in key]
    assert sorted(stated) == sorted(groups), "see the test's docstring"
