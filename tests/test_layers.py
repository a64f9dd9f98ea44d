"""Issue 41: the layers depend only downward. The agent (`dspo.agent`), the environment (`dspo.env`) and the rollout
orchestration (`dspo.rollout`: sampler, producer, engine sides, engine process, transfer, placement) import no
Lightning, so a producer can run outside a Lightning trainer (tests/rollout/test_producer.py drives one); and each
layer imports only those below it: engines, then the environment and the agent, then the rollout orchestration."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

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
    "dspo.env.prompting",
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
    "dspo.rollout.engine_process_main",
    "dspo.rollout.settings",
    "dspo.rollout.sides",
    "dspo.rollout.tally",
    "dspo.rollout.transfer",
    "dspo.rollout.engine_process",
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
    assert "dspo.training.module" not in loaded and not [m for m in loaded if m.startswith("dspo.callbacks")]


def test_each_layer_imports_only_the_layers_below_it():
    """engines <- environment <- agent <- rollout orchestration: no module imports a layer above its own."""
    engines = imported_after(["dspo.engines"])
    assert not [m for m in engines if m.startswith(("dspo.agent", "dspo.env", "dspo.rollout"))]
    agent = imported_after(["dspo.agent", "dspo.agent.tool_calling", "dspo.agent.roles", "dspo.env.simulated"])
    assert not [m for m in agent if m.startswith("dspo.rollout")]


# the folders in their order, lowest first: a module imports only from its own folder and those before it
LAYER_ORDER = ["dspo.engines", "dspo.env", "dspo.agent", "dspo.rollout"]


def layer_of(module: str) -> int | None:
    return next((i for i, layer in enumerate(LAYER_ORDER) if module == layer or module.startswith(f"{layer}.")), None)


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """`module -> imported` for every import of a higher layer's module, read from the source (`module_imports`)."""
    return sorted(
        f"{module} -> {other}"
        for module, imported in edges.items()
        for other in imported
        if layer_of(module) is not None and layer_of(other) is not None and layer_of(other) > layer_of(module)
    )


def test_no_layer_imports_a_higher_one_even_lazily(tmp_path):
    """Issue 71: the import graph read from the source, not only what importing loads (the test above), so that an
    import inside a function, run only when it is called, counts too. An environment that imports the agent loop
    lazily (the answerer's prompt did, until the prompt moved to `dspo.env.prompting`) breaks the layers as surely as
    one at the top of its file, and no cycle need show it (none of the agent modules it imported imports it back)."""
    sources = {"env/x.py": "def f():\n    from dspo.agent.loop import run\n", "agent/loop.py": "import dspo.env.x\n"}
    for name, source in sources.items():
        (tmp_path / "dspo" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dspo" / name).write_text(source)
    assert upward_imports(module_imports(tmp_path / "dspo")) == ["dspo.env.x -> dspo.agent.loop"]  # finds a lazy one
    upward = upward_imports(module_imports(Path(__file__).resolve().parents[1] / "dspo"))
    assert not upward, f"imports of a higher layer (layers: {' <- '.join(LAYER_ORDER)}): {upward}"


def module_imports(root: Path) -> dict[str, set[str]]:
    """{module: the dspo modules it imports}, read from the source: every import statement, at module level or inside
    a function (a lazy import is a dependency all the same). `from package import submodule` is an edge to the
    submodule; `from package import name` one to the package."""
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                base = ".".join([*parts, node.module] if node.module else parts)
                subs = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
                found |= subs | ({base} if len(subs) < len(node.names) else set())
        edges[name] = {other for other in found if other in modules and other != name}
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other through imports (strongly connected, more than one module)."""
    order, low, stack, cycles, counter = {}, {}, [], [], iter(range(len(edges) + 1))

    def visit(node: str) -> None:
        order[node] = low[node] = next(counter)
        stack.append(node)
        for other in edges[node]:
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            group = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(edges):
        if node not in order:
            visit(node)
    return cycles


def test_no_module_imports_one_that_imports_it_back():
    """A folder is a layer: a lower module never imports a higher one, not even lazily inside a function, so no
    group of dspo modules imports itself round (the circles broken: metrics / metric_collections, models.lora /
    models.weights, rollout.engine_process_main / rollout.engine_process, toy.demos / toy.sources, toy.sft /
    toy.warmstart, the agent protocol / its agents, search.backends / search.streamed, ablation / front)."""
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check finds one
    cycles = import_cycles(module_imports(Path(__file__).resolve().parents[1] / "dspo"))
    assert not cycles, f"modules that import each other round: {cycles}"


def test_a_runs_files_and_the_process_setup_import_no_lightning():
    """`dspo.runs` (record, trust, resume, checkpoint files) and `dspo.process` (runtime, console, errors, resources)
    are read by tools that run no trainer (dspo-eval's gate, the sweep report, the status reader): no Lightning, read
    from the source (lazy imports included) and checked in a fresh interpreter."""
    root = Path(__file__).resolve().parents[1] / "dspo"
    for folder in ("runs", "process"):
        for path in (root / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                assert not [n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")], path
    modules = [f"dspo.{p.parent.name}.{p.stem}" for f in ("runs", "process") for p in (root / f).glob("[!_]*.py")]
    loaded = imported_after(modules)
    assert not [m for m in loaded if m.split(".")[0] in ("lightning", "pytorch_lightning")]
