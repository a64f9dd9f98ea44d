"""Issue 41: the layers depend only downward. The agent (`dspo.agent`), the environment (`dspo.env`) and the rollout
orchestration (`dspo.rollout`: sampler, producer, engine sides, engine process, transfer, placement) import no
Lightning, so a producer can run outside a Lightning trainer (tests/rollout/test_producer.py drives one); and each
layer imports only those below it: engines, then the environment and the agent, then the rollout orchestration."""

from __future__ import annotations

import json
import subprocess
import sys

ROLLOUT_LAYERS = [
    "dspo.agent",
    "dspo.agent.accounting",
    "dspo.agent.config",
    "dspo.agent.endpoint",
    "dspo.agent.endpoint.formats",
    "dspo.agent.parsing",
    "dspo.agent.prompts",
    "dspo.agent.protocol",
    "dspo.agent.roles",
    "dspo.agent.tool_calling",
    "dspo.env",
    "dspo.env.simulated",
    "dspo.data.rounds",
    "dspo.rollout",
    "dspo.rollout.cli",
    "dspo.engines",
    "dspo.engines.base",
    "dspo.engines.hf",
    "dspo.engines.scripted",
    "dspo.engines.vllm",
    "dspo.rollout.sampler",
    "dspo.rollout.roles",
    "dspo.rollout.faults",
    "dspo.rollout.link",
    "dspo.rollout.messages",
    "dspo.rollout.placement",
    "dspo.rollout.producer",
    "dspo.rollout.serve",
    "dspo.rollout.sides",
    "dspo.rollout.transfer",
    "dspo.rollout.worker",
]


def imported_after(modules: list[str]) -> list[str]:
    """Every module loaded by importing `modules` in a fresh interpreter."""
    code = "import importlib, json, sys\n"
    code += f"for m in {modules!r}: importlib.import_module(m)\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def test_no_rollout_layer_imports_lightning():
    loaded = imported_after(ROLLOUT_LAYERS)
    lightning = [m for m in loaded if m.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert not lightning, f"imported by the rollout layers: {lightning[:5]}"
    assert "dspo.module" not in loaded and not [m for m in loaded if m.startswith("dspo.callbacks")]


def test_each_layer_imports_only_the_layers_below_it():
    """engines <- environment <- agent <- rollout orchestration: no module imports a layer above its own."""
    engines = imported_after(["dspo.engines"])
    assert not [m for m in engines if m.startswith(("dspo.agent", "dspo.env", "dspo.rollout"))]
    agent = imported_after(["dspo.agent", "dspo.agent.tool_calling", "dspo.agent.roles", "dspo.env.simulated"])
    assert not [m for m in agent if m.startswith("dspo.rollout")]
