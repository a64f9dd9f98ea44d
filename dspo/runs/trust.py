"""What comes from elsewhere is data, never code (issue 39; docs/security.md).

dspo trusts the user's own configs, command line and plug-ins (`imports=[module]`). It does not trust what a model
folder or a checkpoint brings along, since both are shared and downloaded:

- a run record (`dspo_run.json`, `checkpoint["dspo"]["run"]`, adopted by `dspo.runs.record.adopt`) names `_target_`s
that
  Hydra would import and call. A record may name only what dspo ships: classes and functions defined under the `dspo`
  package, the few third-party targets of dspo's own `conf/` (`THIRD_PARTY_TARGETS`), and those of the modules the
  command line imports (`imports=`). Anything else, at any depth (inside `_args_`, `_partial_` nodes, lists), is
  refused before anything is built, naming the record's key;
  `env.agent` (the function of an agent written against the OpenAI API) is checked as a target;
- a record never turns `trust_remote_code` on (a model's own Python code would run): the setting is dropped with a
  warning; the command line may set it;
- a distributed checkpoint folder's `.metadata` is a pickle, which torch's reader unpickles with plain
  `pickle.load`, and its non-tensor items are pickles, which torch's load planner reads with `weights_only=False`.
  Only folders owned by the current user are read, unless `allow_foreign_checkpoint=true`; either way a folder is
  read as data only. `.metadata` is read by torch's own weights-only unpickler, allowed exactly torch's checkpoint
  metadata classes (`load_metadata`): no function, no dotted name, no import. The gate (`check_checkpoint_owner`
  -> `check_metadata`) reads it so before anything is loaded, and torch's reader reads it so again inside
  `folder_checkpoint_as_data` (which every folder read of dspo runs in: FSDP2 resume and rollback, dspo-eval's
  reader), where each non-tensor item loads once with `weights_only=True`. Single-file checkpoints load with
  `weights_only=True` everywhere and need no such rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib
import inspect
import io
import itertools
import os
import pickle
import pickletools
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

# The targets of dspo's conf/ outside the dspo package (tests/runs/test_trust.py keeps this equal to what conf/ names).
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
    conf = Path(__file__).resolve().parents[2] / "conf"
    return frozenset(t for path in conf.rglob("*.yaml") for t in re.findall(r"_target_:\s*([\w.]+)", path.read_text()))


def allowed_target(target: Any, modules: Sequence[str] = ()) -> bool:
    """Whether a record may name `target`: a class defined in dspo (outside its test helpers, `dspo.testing`), a
    function only where dspo's own conf/ names it, one of `THIRD_PARTY_TARGETS`, or a class or function defined in
    one of `modules` (the user's `imports=`). Names are resolved first: `dspo.runs.record.os.system` is `os.system`."""
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
            # the check would see one name and Hydra build another: `dspo.${oc.select:x,runs.trust.os.system}`,
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
    its `.metadata` belong to the current user, or with `allow_foreign_checkpoint=true`; either way its `.metadata`
    must be torch's checkpoint metadata and nothing else (`check_metadata`). Single files pass (they load with
    weights_only=True)."""
    folder = Path(path).expanduser()
    metadata = folder / ".metadata"
    if not folder.is_dir() or not metadata.exists():
        return
    uid = os.getuid()
    foreign = [str(p) for p in (folder, metadata) if _owner(p) != uid]
    if foreign and not allow_foreign:
        raise ForeignCheckpointError(
            f"{key}={path}: {foreign[-1]} belongs to another user (uid {_owner(Path(foreign[-1]))}, you are {uid}); "
            "a checkpoint folder's .metadata is a pickle, and unpickling it can run any code. If you trust where it "
            f"comes from, pass {FOREIGN_CHECKPOINT_KEY}=true"
        )
    check_metadata(metadata, key)


# ---------------------------------------------------------------- a checkpoint folder's `.metadata`: data, never code
# torch's weights-only unpickler calls only what its allowlist holds, looked up by exact name (never a dotted path,
# never an import). Beyond what it always allows (torch.Size, dtypes, torch.serialization._get_layout), a DCP save's
# `.metadata` names only these classes: recorded from real saves (dcp.save of tensors of six dtypes, AdamW state,
# nested non-tensor items; Lightning's FSDP2 sharded save on 2 ranks). No function is allowed.
def _metadata_classes() -> tuple[type, ...]:
    """Metadata first. `_StorageInfo` and `_MEM_FORMAT_ENCODING` are private to torch, and what its save pickles."""
    from pathlib import PosixPath, PurePosixPath

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        _MEM_FORMAT_ENCODING,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    return (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _StorageInfo,
        _MEM_FORMAT_ENCODING,  # TensorProperties pickles its memory format as this enum
        PosixPath,  # StorageMeta.checkpoint_id, as Lightning passes it
        PurePosixPath,
    )


def _vetted_unpickler() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torch's weights-only `Unpickler` class and its allowlist context, `torch.serialization.safe_globals`.
    `torch._weights_only_unpickler` is private, but torch has no public way to read a raw pickle with an allowlist:
    `torch.load(weights_only=True)` reads only torch.save's archives. Missing from a future torch, this raises
    ImportError or AttributeError, which `load_metadata` turns into a refusal: never a fallback to plain pickle."""
    from torch._weights_only_unpickler import Unpickler
    from torch.serialization import safe_globals

    return Unpickler, safe_globals


def _binunicode(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _memo_op(short: bytes, long: bytes, slot: int) -> bytes:
    return short + bytes([slot]) if slot < 256 else long + struct.pack("<I", slot)


class _Protocol2Rewrite:
    """A pickle of any protocol in the opcodes of protocol 2, the only ones torch's weights-only unpickler reads
    (torch.save writes protocol 2; DCP writes `.metadata` with Python's default, 4). The rewrite looks nothing up and
    calls nothing (`pickletools.genops` only parses): frames are dropped; strings written as BINUNICODE; memo slots
    renumbered (a memoized string is written again where it is fetched); STACK_GLOBAL of two literal strings written
    as GLOBAL, which torch resolves by exact name only. Every other opcode is copied as it is, so that torch's
    unpickler refuses those it does not know (INST, OBJ, NEWOBJ_EX, EXT1/2/4, ...)."""

    def __init__(self) -> None:
        self.out: list[bytes | str] = []  # a str: a string pushed and not written yet (a STACK_GLOBAL may take it)
        self.memo: dict[int, str | int] = {}  # the pickle's memo slot -> its string, or its slot in the rewrite
        self.slots = 0  # slots of the rewrite's memo

    def rewrite(self, raw: bytes) -> bytes:
        ops = itertools.chain(pickletools.genops(raw), [(None, None, len(raw))])  # ValueError: a malformed pickle
        for (op, arg, start), (_, _, end) in itertools.pairwise(ops):
            self.add(op.name, arg, raw, start, end)
        return b"".join(_binunicode(item) if isinstance(item, str) else item for item in self.out)

    def add(self, name: str, arg: Any, raw: bytes, start: int, end: int) -> None:
        if name == "PROTO":
            self.out.append(pickle.PROTO + b"\x02")
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"):
            self.out.append(arg)
        elif name in ("MEMOIZE", "BINPUT", "LONG_BINPUT"):
            self.put(len(self.memo) if name == "MEMOIZE" else arg)  # MEMOIZE: the next free slot, as pickle counts
        elif name in ("BINGET", "LONG_BINGET"):
            self.get(arg)
        elif name == "STACK_GLOBAL":
            self.stack_global()
        elif name == "STOP":
            self.out.append(pickle.STOP)  # and nothing after it
        elif name != "FRAME":
            self.out.append(raw[start:end])

    def put(self, slot: int) -> None:
        if self.out and isinstance(self.out[-1], str):
            self.memo[slot] = self.out[-1]
            return
        self.memo[slot], self.slots = self.slots, self.slots + 1
        self.out.append(_memo_op(pickle.BINPUT, pickle.LONG_BINPUT, self.memo[slot]))

    def get(self, slot: int) -> None:
        if slot not in self.memo:
            raise pickle.UnpicklingError(f"memo slot {slot} is fetched before it is set")
        found = self.memo[slot]
        self.out.append(found if isinstance(found, str) else _memo_op(pickle.BINGET, pickle.LONG_BINGET, found))

    def stack_global(self) -> None:
        """GLOBAL: the module and name must be the two strings just pushed (as Python's pickler writes them), without
        a line break (GLOBAL reads each up to one)."""
        if len(self.out) < 2 or not isinstance(self.out[-1], str) or not isinstance(self.out[-2], str):
            raise pickle.UnpicklingError("STACK_GLOBAL whose module and name are not two literal strings")
        name, module = self.out.pop(), self.out.pop()
        if "\n" in module or "\n" in name:
            raise pickle.UnpicklingError(f"STACK_GLOBAL of a name with a line break: {module!r}, {name!r}")
        self.out.append(pickle.GLOBAL + f"{module}\n{name}\n".encode())


def _allowed_result_types(classes: Sequence[type]) -> frozenset[type]:
    """The types a `Metadata` holds once built: the enum is gone (TensorProperties turns it into a memory format)."""
    import torch

    built = {cls for cls in classes if not issubclass(cls, enum.Enum)}
    return frozenset({*built, *_leaf_types(), dict, list, tuple, torch.Size})


def _check_result(metadata: Any, classes: Sequence[type]) -> None:
    """What the unpickler built is a `Metadata` holding only torch's metadata classes, each with its own fields and
    nothing else (an attribute such as `__reduce_ex__` would shadow the method a later pickling calls), sizes,
    dtypes, layouts, paths and plain values."""
    if type(metadata) is not classes[0]:
        raise pickle.UnpicklingError(f"it holds a {_type_name(metadata)}, not torch's Metadata")
    allowed, leaves = _allowed_result_types(classes), _leaf_types()
    pending, seen = [metadata], set()
    while pending:
        value = pending.pop()
        if type(value) in leaves or id(value) in seen:
            continue
        seen.add(id(value))
        if type(value) not in allowed:
            raise pickle.UnpicklingError(f"it holds a {_type_name(value)}")
        pending.extend(_parts(value))


def _leaf_types() -> frozenset[type]:
    """Types that hold nothing further to check."""
    import torch

    return frozenset({str, int, float, bool, type(None), torch.dtype, torch.layout, torch.memory_format})


def _parts(value: Any) -> list[Any]:
    """What `value` holds: a container's items, an object's attributes (a dataclass's must be its fields) and slots."""
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):  # torch.Size too
        return list(value)
    attributes = dict(getattr(value, "__dict__", {}))
    if dataclasses.is_dataclass(value):
        extra = set(attributes) - {field.name for field in dataclasses.fields(value)}
        if extra:
            raise pickle.UnpicklingError(f"its {_type_name(value)} has attributes that are not fields: {sorted(extra)}")
    slots = [name for name in _slot_names(type(value)) if hasattr(value, name)]
    return [*attributes.values(), *(getattr(value, name) for name in slots)]


@functools.cache
def _slot_names(kind: type) -> tuple[str, ...]:
    """The slots of `kind` and its bases (a path keeps its parts in slots)."""
    names = [cls.__dict__.get("__slots__", ()) for cls in kind.__mro__]
    return tuple(name for slots in names for name in ((slots,) if isinstance(slots, str) else slots))


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def load_metadata(handle: BinaryIO, source: str) -> Any:
    """A checkpoint folder's `.metadata` (open for reading), read by torch's weights-only unpickler with torch's
    checkpoint metadata classes only: no function, no other class, no dotted name can be reached. Returns torch's
    `Metadata`; anything else raises `ForeignCheckpointError` naming `source` (`ckpt_path=FOLDER`)."""
    try:
        unpickler, safe_globals = _vetted_unpickler()
        classes = _metadata_classes()
    except (ImportError, AttributeError) as error:
        import torch

        raise ForeignCheckpointError(
            f"{source}: this torch ({torch.__version__}) lacks what dspo reads a checkpoint folder's .metadata with "
            f"({type(error).__name__}: {error}); dspo never reads it with plain pickle, so nothing was loaded. Install "
            "a torch version dspo supports (pyproject.toml) or use a single-file checkpoint"
        ) from error
    try:
        # safe_globals adds these data classes to torch's process-wide allowlist for the block (and removes them)
        with safe_globals(list(classes)):
            metadata = unpickler(io.BytesIO(_Protocol2Rewrite().rewrite(handle.read()))).load()
        _check_result(metadata, classes)
    except Exception as error:  # noqa: BLE001  anything but torch's metadata: refuse, naming why
        raise ForeignCheckpointError(
            f"{source}: its .metadata is not a torch checkpoint's metadata ({type(error).__name__}: "
            f"{str(error)[:300]}); unpickling it could run any code, so nothing was loaded. Use a checkpoint dspo "
            "wrote"
        ) from error
    return metadata


def check_metadata(path: Path, key: str) -> Any:
    """Read a folder checkpoint's `.metadata` as `load_metadata` does, whoever owns the folder (downloaded,
    untarred); returns torch's `Metadata`, or raises `ForeignCheckpointError` naming `key` and the folder."""
    with open(path, "rb") as handle:
        return load_metadata(handle, f"{key}={path.parent}")


def _read_metadata_as_data(key: str) -> Callable[..., Any]:
    """`FileSystemReader.read_metadata` with `load_metadata` in place of its `pickle.load`; the rest as torch's."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN001  torch's signature (`rank=`)
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")  # torch >= 2.8 may read a rank's own `__N.metadata`
        path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        with self.fs.create_stream(path, "rb") as handle:
            metadata = load_metadata(handle, f"{key}={self.path}")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    return read_metadata


def _load_bytes_as_data(key: str) -> Callable[..., None]:
    """`DefaultLoadPlanner.load_bytes` unpickling the item with `weights_only=True` (torch's uses False), once,
    and putting it where torch's own method puts it."""

    def load_bytes(self, read_item, value) -> None:  # noqa: ANN001  torch's signature
        import torch
        from torch.distributed.checkpoint._traverse import set_element  # private: what torch's load_bytes calls

        fqn = read_item.dest_index.fqn
        try:
            item = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise ForeignCheckpointError(
                f"{key}: the checkpoint folder's item {fqn!r} is not plain data (UnpicklingError: {error}); "
                "unpickling it could run any code, so it was not loaded. Use a checkpoint dspo wrote"
            ) from error
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item

    return load_bytes


@contextlib.contextmanager
def folder_checkpoint_as_data(key: str = "ckpt_path") -> Iterator[None]:
    """While a folder checkpoint (torch.distributed.checkpoint) is read, torch's reader reads it as data: its
    `.metadata` with `load_metadata` (torch's `FileSystemReader.read_metadata` unpickles it with plain `pickle.load`,
    so a check before the read would leave a window and any gap in the check would be fatal), its non-tensor items
    (optimizer steps, param groups, Lightning's loop state) with `torch.load(weights_only=True)`: tensors, containers
    and plain values only (torch's `DefaultLoadPlanner.load_bytes` uses `weights_only=False`). Lightning builds the
    reader and the planner itself, hence patches of both classes for the duration of the read. A refusal raises
    `ForeignCheckpointError` naming `key` (torch's distributed loader may wrap it in a CheckpointException)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    saved = FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes
    FileSystemReader.read_metadata = _read_metadata_as_data(key)
    DefaultLoadPlanner.load_bytes = _load_bytes_as_data(key)
    try:
        yield
    finally:
        FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = saved


# The name of `folder_checkpoint_as_data` while it guarded the non-tensor items only; its callers may keep it.
safe_byte_items = folder_checkpoint_as_data
