"""What comes from elsewhere is data, never code (issue 39; docs/security.md).

dspo trusts the user's own configs, command line and plug-ins (`imports=[module]`). It does not trust what a model
folder or a checkpoint brings along, since both are shared and downloaded:

- a run record (`dspo_run.json`, `checkpoint["dspo"]["run"]`, adopted by `dspo.record.adopt`) names `_target_`s that
  Hydra would import and call. A record may name only what dspo ships: classes and functions defined under the `dspo`
  package, the few third-party targets of dspo's own `conf/` (`THIRD_PARTY_TARGETS`), and those of the modules the
  command line imports (`imports=`). Anything else, at any depth (inside `_args_`, `_partial_` nodes, lists), is
  refused before anything is built, naming the record's key;
  `env.agent` (the function of an agent written against the OpenAI API) is checked as a target;
- a record never turns `trust_remote_code` on (a model's own Python code would run): the setting is dropped with a
  warning; the command line may set it;
- a distributed checkpoint folder's `.metadata` is a pickle, which torch's reader unpickles: only folders owned by
  the current user are read, unless `allow_foreign_checkpoint=true`, and even then only with torch's own metadata
  types (`check_metadata`). Its non-tensor items are pickles too, which torch's load planner reads with
  `weights_only=False`: dspo reads them inside `safe_byte_items`, where they load as `weights_only=True` first.
  Single-file checkpoints load with `weights_only=True` everywhere and need no such rule.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import pickle
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# The targets of dspo's conf/ outside the dspo package (tests/test_trust.py keeps this equal to what conf/ names).
THIRD_PARTY_TARGETS = frozenset(
    {
        "lightning.pytorch.Trainer",
        "lightning.pytorch.callbacks.LearningRateMonitor",
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "lightning.pytorch.loggers.CSVLogger",
        "lightning.pytorch.loggers.TensorBoardLogger",
        "lightning.pytorch.loggers.WandbLogger",
        "lightning.pytorch.strategies.DDPStrategy",
    }
)
PACKAGE = "dspo"
# Keys that name a function to import and run, as a `_target_` does (`env.agent`: an agent written for the OpenAI API)
CODE_KEYS = frozenset({"env.agent"})
# A key, at any depth, that names modules to import: only the command line's `imports=` may (a record never does)
IMPORT_KEY = "imports"
FOREIGN_CHECKPOINT_KEY = "allow_foreign_checkpoint"


class UntrustedRecordError(ValueError):
    """A run record names code dspo does not ship; the message names the key and how to allow it."""


class ForeignCheckpointError(ValueError):
    """A folder checkpoint of another user would be unpickled; the message says why and how to allow it."""


def import_modules(names: Any) -> list[str]:
    """`imports=[my_pkg.my_objective, ...]`: import user modules before anything is instantiated, so that what they
    register (`@register_objective`, `@register_advantage`, ...) exists when the config is built and validated, and a
    run record may name their targets (docs/extending.md). Returns the module names."""
    if names is None:
        return []
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"imports must be a list of module names, e.g. imports=[my_objective]; got {names!r}")
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as error:  # a wrong name or path; a module that fails as it runs is a bug: its stack shows
            raise ImportError(
                f"imports: module '{name}' failed to import ({type(error).__name__}: {error}); check its name and "
                "that its folder is on PYTHONPATH (e.g. PYTHONPATH=docs/examples dspo-train imports=[...])"
            ) from error
    return list(names)


def _under(name: str, packages: Sequence[str]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


@functools.cache
def conf_targets() -> frozenset[str]:
    """Every `_target_` dspo's own conf/ names (the functions among them are the only dspo functions a record may
    name: dspo has functions that write files or run commands, e.g. its test helpers)."""
    conf = Path(__file__).resolve().parents[1] / "conf"
    return frozenset(t for path in conf.rglob("*.yaml") for t in re.findall(r"_target_:\s*([\w.]+)", path.read_text()))


def allowed_target(target: Any, modules: Sequence[str] = ()) -> bool:
    """Whether a record may name `target`: a class defined in dspo (outside its test helpers, `dspo.testing`), a
    function only where dspo's own conf/ names it, one of `THIRD_PARTY_TARGETS`, or a class or function defined in
    one of `modules` (the user's `imports=`). Names are resolved first: `dspo.record.os.system` is `os.system`."""
    if not isinstance(target, str):
        return False
    if target in THIRD_PARTY_TARGETS:
        return True
    if not _under(target, (PACKAGE, *modules)):
        return False
    from hydra.utils import get_object

    try:
        found = get_object(target)  # imports only modules under dspo or under what the user imported
    except Exception:  # noqa: BLE001  fail closed: a name that does not resolve here may resolve to anything later
        return False
    module = getattr(found, "__module__", None)
    if not isinstance(module, str) or not (inspect.isclass(found) or inspect.isroutine(found)):
        return False
    if _under(module, modules):
        return True
    if not _under(module, (PACKAGE,)) or _under(module, (f"{PACKAGE}.testing",)):
        return False
    return inspect.isclass(found) or target in conf_targets()


# An interpolation a record may hold: a reference to another key, or `oc.select` of one with a literal default (what
# dspo's conf/ writes). Any other resolver (`oc.create` builds nodes with targets, `oc.env` reads secrets) is refused.
_SAFE_INTERPOLATION = re.compile(r"\$\{(?:[A-Za-z_][\w.]*|oc\.select:[A-Za-z_][\w.]*(?:,[^${}:]*)?)\}")


def _unsafe_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in _SAFE_INTERPOLATION.sub("", value)


def _nodes(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every node under `value`, itself first; list items are numbered."""
    stack = [(path, value)]
    while stack:
        key, node = stack.pop()
        yield key, node
        if isinstance(node, Mapping):
            stack.extend((f"{key}.{k}", v) for k, v in reversed(list(node.items())))
        elif isinstance(node, (list, tuple)):  # a checkpoint's record may hold tuples (weights_only allows them)
            stack.extend((f"{key}.{i}", v) for i, v in reversed(list(enumerate(node))))


def check_targets(
    value: Any, path: str, modules: Sequence[str], overridden: Callable[[str], bool], source: str
) -> None:
    """Refuse a record section (`value`, at config key `path`) that names a target dspo does not ship, at any depth;
    keys the command line sets (`overridden`) are the user's and not checked."""
    for key, node in _nodes(value, path):
        if overridden(key):
            continue
        names_code = key.endswith("._target_") or (key in CODE_KEYS and node is not None)
        if key.rsplit(".", 1)[-1] == IMPORT_KEY and node is not None:
            raise UntrustedRecordError(
                f"{source}: {key}={node!r} names modules to import, and a record is data, not code: nothing was built. "
                "Pass imports=[...] on the command line if you trust them"
            )
        if names_code and _interpolated(node):
            # the check would see one name and Hydra build another: `dspo.${oc.select:x,trust.os.system}`,
            # `dspo.${retriever.index}` with index `trust.os.system` are both `os.system`
            raise UntrustedRecordError(
                f"{source}: {key}={node!r} is interpolated, and a record names its code literally: nothing was built. "
                f"Set {key}=... (or the whole {path.split('.')[0]}=...) on the command line if you trust this model "
                "folder"
            )
        if _unsafe_interpolation(node):
            raise UntrustedRecordError(
                f"{source}: {key}={node!r} calls a resolver, and a record is data, not code: nothing was built. A "
                "record may refer to other keys (${a.b}, ${oc.select:a.b,default}) only; set "
                f"{key}=... on the command line if you trust this model folder"
            )
        if not names_code or allowed_target(node, modules):
            continue
        module = str(node).rsplit(".", 1)[0] if isinstance(node, str) and "." in node else "MODULE"
        raise UntrustedRecordError(
            f"{source}: {key}={node!r} is not a target dspo ships (or does not exist in this dspo), and a record is "
            f"data, not code: nothing was built. If you trust this model folder, allow it with imports=[{module}], or "
            f"set {key}=... (or the whole {path.split('.')[0]}=...) on the command line"
        )


def _interpolated(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def drop_remote_code(value: Any, path: str, overridden: Callable[[str], bool], source: str) -> list[str]:
    """Set every `trust_remote_code: true` of a record section to false (in place) unless the command line sets that
    key; returns a warning line per key dropped."""
    lines = []
    for key, node in list(_nodes(value, path)):
        if not isinstance(node, Mapping) or not node.get("trust_remote_code") or overridden(f"{key}.trust_remote_code"):
            continue
        node["trust_remote_code"] = False
        lines.append(
            f"WARNING: {key}.trust_remote_code=true in {source} was not adopted: a model folder never turns on "
            f"running its own Python code. If you trust it, pass {key}.trust_remote_code=true on the command line"
        )
    return lines


def _owner(path: Path) -> int:
    return path.stat().st_uid


def check_checkpoint_owner(path: str | os.PathLike, key: str, allow_foreign: bool = False) -> None:
    """A distributed checkpoint folder (torch.distributed.checkpoint: a pickled `.metadata`) is read only when it and
    its `.metadata` belong to the current user, or with `allow_foreign_checkpoint=true`; single files pass (they load
    with weights_only=True)."""
    folder = Path(path).expanduser()
    metadata = folder / ".metadata"
    if allow_foreign or not folder.is_dir() or not metadata.exists():
        return
    uid = os.getuid()
    foreign = [str(p) for p in (folder, metadata) if _owner(p) != uid]
    if foreign:
        raise ForeignCheckpointError(
            f"{key}={path}: {foreign[-1]} belongs to another user (uid {_owner(Path(foreign[-1]))}, you are {uid}); "
            "a checkpoint folder's .metadata is a pickle, and unpickling it can run any code. If you trust where it "
            f"comes from, pass {FOREIGN_CHECKPOINT_KEY}=true"
        )
    check_metadata(metadata, key)


# What a distributed checkpoint's `.metadata` pickles: torch's checkpoint metadata classes, dtypes, sizes, a path.
_METADATA_MODULES = ("torch.distributed.checkpoint.",)
_METADATA_GLOBALS = frozenset(
    {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}
    | {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = (module, name) in _METADATA_GLOBALS or module.startswith(_METADATA_MODULES)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not a type of torch's checkpoint metadata")
        return super().find_class(module, name)


def check_metadata(path: Path, key: str) -> None:
    """Unpickle a folder checkpoint's `.metadata` with torch's own types only, before torch's reader unpickles it
    whole (a plain `pickle.load`): a planted pickle is refused whoever owns the folder (downloaded, untarred)."""
    try:
        with open(path, "rb") as handle:
            _MetadataUnpickler(handle).load()
    except Exception as error:  # noqa: BLE001  anything but torch's metadata: refuse, naming why
        raise ForeignCheckpointError(
            f"{key}={path.parent}: its .metadata is not a torch checkpoint's metadata ({error}); unpickling it could "
            "run any code, so nothing was loaded. Use a checkpoint dspo wrote"
        ) from error


@contextlib.contextmanager
def safe_byte_items() -> Iterator[None]:
    """While a folder checkpoint is read: its non-tensor items (torch.distributed.checkpoint "bytes": optimizer steps,
    param groups, Lightning's loop state) are unpickled by `torch.load(weights_only=True)` first (tensors, containers
    and plain values only); what passes is saved again and handed to torch's planner, so a planted pickle fails there
    (`pickle.UnpicklingError`) instead of running. torch's `DefaultLoadPlanner.load_bytes` loads them with
    `weights_only=False`, and Lightning builds that planner itself, hence a patch for the duration of the read."""
    import io

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    original = DefaultLoadPlanner.load_bytes

    def load_bytes(self, read_item, value) -> None:  # noqa: ANN001  torch's signature
        checked = torch.load(value, map_location="cpu", weights_only=True)
        again = io.BytesIO()
        torch.save(checked, again)
        again.seek(0)
        original(self, read_item, again)

    DefaultLoadPlanner.load_bytes = load_bytes
    try:
        yield
    finally:
        DefaultLoadPlanner.load_bytes = original
