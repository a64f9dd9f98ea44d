"""Issue 70 (1): no code from a checkpoint folder, whatever its `.metadata` pickle holds.

Hypothesis writes pickles opcode by opcode (bytes, by hand; a few by `pickle.dumps`) over every opcode that reaches a
global or calls one: GLOBAL, STACK_GLOBAL, INST, OBJ, NEWOBJ, NEWOBJ_EX, REDUCE, BUILD and EXT1/EXT2/EXT4 (copyreg
extension codes registered for the example and removed after it), in protocols 0-5, framed or not, strings memoized
and fetched again or not. What they call: `os.system`, `eval`/`exec`, `subprocess`, `Path.touch`, `torch.load` and
`torch.distributed.checkpoint.format_utils.torch_save_to_dcp` (which runs `torch.load(weights_only=False)` on a
planted file), named directly or through a module that the old check let through (dotted names under
`torch.distributed.checkpoint.*`, `torch`, `pathlib`, `collections`, `builtins`), through getattr chains, or planted as
the `__setstate__`/`__class__`/`__reduce_ex__` of torch's own metadata classes by BUILD; and torch's metadata classes
themselves called with hostile arguments. Each pickle, as the `.metadata` of a folder, goes through the gate
(`check_checkpoint_owner`, `check_metadata`), dspo-eval's reader (`dspo.eval.cli.read_checkpoint`, also with the gate
switched off: what torch's reader does after the check) and torch's distributed loader inside
`folder_checkpoint_as_data`. A sandbox records every call that runs code (audit events: os.system, subprocess,
exec/eval, a file opened for writing; `torch.load` of the planted file or without weights_only) and a marker
file that every payload would create. The oracle is independent of dspo.runs.trust: nothing recorded, no marker, and the
gate either refuses naming the folder or returns torch's `Metadata` holding only the types listed here."""

from __future__ import annotations

import contextlib
import copy
import copyreg
import dataclasses
import os
import pickle
import struct
import sys
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import dspo.runs.trust
from dspo.eval.cli import read_checkpoint
from dspo.runs.trust import ForeignCheckpointError, check_checkpoint_owner, check_metadata, folder_checkpoint_as_data
from dspo.testing import examples

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
DCP = "torch.distributed.checkpoint"
MARKER, PLANTED, OUT = "<marker>", "<planted.pt>", "<out>"  # replaced by each example's paths
SHELL = f"touch {MARKER}"
REFUSED = (Exception, CheckpointException)  # torch's distributed loader raises a BaseException that wraps the error
PYTHON = f"__import__('pathlib').Path('{MARKER}').touch()"


@dataclasses.dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclasses.dataclass(frozen=True)
class Attr:
    """getattr(obj, name), through builtins.getattr."""

    obj: Any
    name: str


@dataclasses.dataclass(frozen=True)
class Call:
    func: Any
    args: tuple


MARKER_PATH = Call(Global("pathlib", "PosixPath"), (MARKER,))
CALLS_CODE = (
    Call(Global("os", "system"), (SHELL,)),
    Call(Global("posix", "system"), (SHELL,)),
    Call(Global("builtins", "eval"), (PYTHON,)),
    Call(Global("builtins", "exec"), (PYTHON,)),
    Call(Global("subprocess", "getoutput"), (SHELL,)),
    Call(Global(f"{DCP}.filesystem", "os.system"), (SHELL,)),  # the issue's: protocol 4 resolves dotted names
    Call(Global(f"{DCP}.metadata", "os.system"), (SHELL,)),
    Call(Global(DCP, "filesystem.os.system"), (SHELL,)),
    Call(Global(f"{DCP}.filesystem", "Path.touch"), (MARKER_PATH,)),
    Call(Global("pathlib", "Path.touch"), (MARKER_PATH,)),
    Call(Global("pathlib", "PosixPath.touch"), (MARKER_PATH,)),
    Call(Global(f"{DCP}.format_utils", "torch_save_to_dcp"), (PLANTED, OUT)),  # torch.load(weights_only=False)
    Call(Global(f"{DCP}.format_utils", "torch.load"), (PLANTED,)),
    Call(Global("torch", "load"), (PLANTED,)),
    Call(Global("torch.serialization", "load"), (PLANTED,)),
    Call(Global("collections", "_sys.modules.get"), ("os",)),  # a module object, then nothing: still a call
    Call(Global("builtins", "getattr"), (Global(f"{DCP}.filesystem", "os"), "system")),
    Call(Attr(Global(f"{DCP}.filesystem", "os"), "system"), (SHELL,)),
    Call(Attr(Global("torch", "serialization"), "load"), (PLANTED,)),
    Call(Call(Global(f"{DCP}.filesystem", "__builtins__.get"), ("eval",)), (PYTHON,)),
    Call(Global(f"{DCP}.metadata", "Metadata.__init__.__globals__.get"), ("os",)),
)
# torch's metadata classes, and what else a real `.metadata` names, called with hostile arguments
HOSTILE_DATA = (
    Call(Global(f"{DCP}.metadata", "Metadata"), (Call(Global("os", "system"), (SHELL,)),)),
    Call(Global(f"{DCP}.metadata", "Metadata"), (SHELL, PYTHON, MARKER_PATH)),
    Call(Global(f"{DCP}.metadata", "MetadataIndex"), (SHELL, (SHELL,))),
    Call(Global(f"{DCP}.metadata", "StorageMeta"), (MARKER_PATH, SHELL)),
    Call(Global(f"{DCP}.metadata", "_MEM_FORMAT_ENCODING"), ("x", SHELL)),
    Call(Global(f"{DCP}.filesystem", "_StorageInfo"), (MARKER, SHELL, PYTHON)),
    Call(Global("torch.serialization", "_get_layout"), ("os.system",)),
    Call(Global("torch", "Size"), ((SHELL,),)),
    Call(Global("pathlib", "PosixPath"), (MARKER,)),
)
HOLDERS = (
    Global(f"{DCP}.metadata", "Metadata"),
    Global(f"{DCP}.metadata", "StorageMeta"),
    Global(f"{DCP}.metadata", "BytesStorageMetadata"),
    Global(f"{DCP}.metadata", "TensorProperties"),
    Global(f"{DCP}.filesystem", "_StorageInfo"),
    Global("pathlib", "PosixPath"),
)
# How the payload's callable is called. The BUILD kinds plant it on an instance of a metadata class: as the
# `__setstate__` a second BUILD calls, as its `__class__`, or as the `__reduce_ex__` a later pickling would call.
DIRECT_KINDS = ("REDUCE", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4")
BUILD_KINDS = ("BUILD_SETSTATE", "BUILD_CLASS", "BUILD_REDUCE_EX")
EXTENSION_CODES = {"EXT1": 0xF1, "EXT2": 0xF1F2, "EXT4": 0x7F1F2F3F}
# What torch's Metadata may hold once unpickled (the oracle: written here, not taken from dspo.runs.trust)
ALLOWED_TYPES = {
    Metadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    StorageMeta,
    _StorageInfo,
    PosixPath,
    PurePosixPath,
    torch.Size,
    torch.dtype,
    torch.layout,
    torch.memory_format,
    dict,
    list,
    tuple,
    str,
    int,
    float,
    bool,
    type(None),
}


# ------------------------------------------------------------------------------------------------ writing pickles
class Writer:
    """Pickle opcodes, by hand, as a protocol writes them (strings, memo, tuples, dicts); the globals as drawn."""

    def __init__(self, protocol: int, memoize: bool, paths: dict[str, str]) -> None:
        self.protocol, self.memoize, self.paths = protocol, memoize, paths
        self.parts: list[bytes] = []
        self.slots = 0
        self.strings: dict[str, int] = {}  # memoized strings: fetched again (BINGET) where they recur

    def op(self, data: bytes) -> None:
        self.parts.append(data)

    def put(self) -> int:
        slot, self.slots = self.slots, self.slots + 1
        if self.protocol == 0:
            self.op(b"p%d\n" % slot)
        elif self.protocol < 4:
            self.op(b"q" + bytes([slot]) if slot < 256 else b"r" + struct.pack("<I", slot))
        else:
            self.op(pickle.MEMOIZE)
        return slot

    def get(self, slot: int) -> None:
        if self.protocol == 0:
            self.op(b"g%d\n" % slot)
        else:
            self.op(b"h" + bytes([slot]) if slot < 256 else b"j" + struct.pack("<I", slot))

    def string(self, text: str) -> None:
        for placeholder, path in self.paths.items():
            text = text.replace(placeholder, path)
        if text in self.strings:
            self.get(self.strings[text])
            return
        data = text.encode("utf-8")
        if self.protocol == 0:
            self.op(b"V" + text.encode("raw-unicode-escape") + b"\n")
        elif self.protocol < 4 or len(data) >= 256:
            self.op(pickle.BINUNICODE + struct.pack("<I", len(data)) + data)
        else:
            self.op(pickle.SHORT_BINUNICODE + bytes([len(data)]) + data)
        if self.memoize:
            self.strings[text] = self.put()

    def tuple(self, items: tuple) -> None:
        if self.protocol >= 2 and len(items) <= 3:
            for item in items:
                self.value(item)
            self.op([pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3][len(items)])
            return
        self.op(pickle.MARK)
        for item in items:
            self.value(item)
        self.op(pickle.TUPLE)

    def dict(self, items: dict) -> None:
        self.op(pickle.EMPTY_DICT if self.protocol else pickle.MARK)
        if self.protocol:
            self.op(pickle.MARK)
        for key, value in items.items():
            self.value(key)
            self.value(value)
        self.op(pickle.SETITEMS if self.protocol else pickle.DICT)

    def value(self, value: Any) -> None:
        if value is None:
            self.op(pickle.NONE)
        elif isinstance(value, str):
            self.string(value)
        elif isinstance(value, tuple):
            self.tuple(value)
        elif isinstance(value, dict):
            self.dict(value)
        elif isinstance(value, Global):
            self.global_(value, "STACK_GLOBAL" if self.protocol >= 4 else "GLOBAL")
        elif isinstance(value, Attr):
            self.call(Call(Global("builtins", "getattr"), (value.obj, value.name)), "REDUCE", "GLOBAL")
        elif isinstance(value, Call):
            self.call(value, "REDUCE", "STACK_GLOBAL" if self.protocol >= 4 else "GLOBAL")
        else:
            raise TypeError(value)

    def global_(self, target: Global, how: str) -> None:
        if how in EXTENSION_CODES:  # registered by `extension` for this example
            code = EXTENSION_CODES[how]
            size = {"EXT1": "<B", "EXT2": "<H", "EXT4": "<i"}[how]
            self.op({"EXT1": pickle.EXT1, "EXT2": pickle.EXT2, "EXT4": pickle.EXT4}[how] + struct.pack(size, code))
        elif how == "STACK_GLOBAL":
            self.string(target.module)
            self.string(target.name)
            self.op(pickle.STACK_GLOBAL)
        else:
            self.op(pickle.GLOBAL + f"{target.module}\n{target.name}\n".encode())

    def call(self, call: Call, kind: str, how: str) -> None:
        """`call.func(*call.args)` the way `kind` calls (a non-global callable is always REDUCEd)."""
        func, args = call.func, call.args
        if not isinstance(func, Global):
            self.value(func)  # Attr or Call: what they return is called
            self.tuple(args)
            self.op(pickle.REDUCE)
        elif kind == "REDUCE":
            self.global_(func, how)
            self.tuple(args)
            self.op(pickle.REDUCE)
        elif kind == "INST":
            self.op(pickle.MARK)
            for arg in args:
                self.value(arg)
            self.op(pickle.INST + f"{func.module}\n{func.name}\n".encode())
        elif kind == "OBJ":
            self.op(pickle.MARK)
            self.global_(func, how)
            for arg in args:
                self.value(arg)
            self.op(pickle.OBJ)
        elif kind in ("NEWOBJ", "NEWOBJ_EX"):
            self.global_(func, how)
            self.tuple(args)
            if kind == "NEWOBJ_EX":
                self.dict({})
            self.op(pickle.NEWOBJ if kind == "NEWOBJ" else pickle.NEWOBJ_EX)
        else:  # EXT1/2/4: the callable by its extension code, then REDUCE
            self.global_(func, kind)
            self.tuple(args)
            self.op(pickle.REDUCE)

    def planted_on(self, holder: Global, call: Call, kind: str, how: str) -> None:
        """An instance of `holder` (NEWOBJ, as Python pickles dataclasses) with the callable planted by BUILD."""
        self.global_(holder, how)
        self.tuple(())
        self.op(pickle.NEWOBJ)
        if kind == "BUILD_SETSTATE":
            self.dict({"__setstate__": call.func})
            self.op(pickle.BUILD)
            self.value(call.args[0])
            self.op(pickle.BUILD)
        elif kind == "BUILD_CLASS":
            self.tuple((None, {"__class__": call.func}))
            self.op(pickle.BUILD)
        else:
            self.dict({"__reduce_ex__": call.func, "__reduce__": call.func, "__getstate__": call.func})
            self.op(pickle.BUILD)

    def finish(self, framed: bool) -> bytes:
        body = b"".join(self.parts) + pickle.STOP
        if framed and self.protocol >= 4:
            body = pickle.FRAME + struct.pack("<Q", len(body)) + body
        return (pickle.PROTO + bytes([self.protocol]) if self.protocol >= 2 else b"") + body


@dataclasses.dataclass(frozen=True)
class Recipe:
    call: Call
    kind: str
    how: str  # GLOBAL or STACK_GLOBAL, for the payload's callable and the holder
    protocol: int
    framed: bool
    memoize: bool
    holder: Global
    inside_metadata: bool  # the payload as a value of a Metadata's state_dict_metadata, not the whole pickle

    def extension(self) -> Global | None:
        return self.call.func if self.kind in EXTENSION_CODES and isinstance(self.call.func, Global) else None

    def write(self, paths: dict[str, str]) -> bytes:
        writer = Writer(self.protocol, self.memoize, paths)
        if self.inside_metadata:
            writer.global_(Global(f"{DCP}.metadata", "Metadata"), self.how)
            writer.tuple(())
            writer.op(pickle.NEWOBJ)
            writer.op(pickle.EMPTY_DICT + pickle.MARK)
            writer.string("state_dict_metadata")
            writer.op(pickle.EMPTY_DICT + pickle.MARK)
            writer.string("w")
        if self.kind in BUILD_KINDS:
            writer.planted_on(self.holder, self.call, self.kind, self.how)
        else:
            writer.call(self.call, self.kind, self.how)
        if self.inside_metadata:
            writer.op(pickle.SETITEMS + pickle.SETITEMS + pickle.BUILD)
        return writer.finish(self.framed)


recipes = st.builds(
    Recipe,
    call=st.sampled_from(CALLS_CODE + HOSTILE_DATA),
    kind=st.sampled_from(DIRECT_KINDS + BUILD_KINDS),
    how=st.sampled_from(["GLOBAL", "STACK_GLOBAL"]),
    protocol=st.integers(0, 5),
    framed=st.booleans(),
    memoize=st.booleans(),
    holder=st.sampled_from(HOLDERS),
    inside_metadata=st.booleans(),
)


class _Dumped:
    """A pickle as Python's own pickler writes it: `func(*args)` on load."""

    def __init__(self, func: Any, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple:
        return self.func, self.args


def dumped(protocol: int, func_name: str, paths: dict[str, str]) -> bytes:
    shell, python = (text.replace(MARKER, paths[MARKER]) for text in (SHELL, PYTHON))
    func, args = {
        "os.system": (os.system, (shell,)),
        "eval": (eval, (python,)),
        "exec": (exec, (python,)),
        "Path.touch": (Path.touch, (Path(paths[MARKER]),)),
        "torch.load": (torch.load, (paths[PLANTED],)),
    }[func_name]
    return pickle.dumps(_Dumped(func, args), protocol=protocol)


# ------------------------------------------------------------------------------------------------ the sandbox
# ("compile" is left out: formatting a traceback compiles its source lines; eval/exec raise "exec" too)
DANGEROUS_EVENTS = ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "exec")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class Sandbox:
    """Records what runs code while it is on: audit events (a hook stays installed for the process, recording only
    while on), files opened for writing, and `torch.load` of the planted file or without weights_only."""

    calls: list[tuple] = []
    on = False

    @classmethod
    def hook(cls, event: str, args: tuple) -> None:
        if not cls.on:
            return
        if event in DANGEROUS_EVENTS or (event == "open" and _writes(args)):
            cls.calls.append((event, repr(args)[:200]))

    @classmethod
    @contextlib.contextmanager
    def watching(cls, planted: str) -> Iterator[list[tuple]]:
        original = torch.load

        def recording_load(f: Any, *args: Any, **kwargs: Any) -> Any:
            if str(f) == planted or kwargs.get("weights_only") is not True:
                cls.calls.append(("torch.load", str(f), kwargs.get("weights_only")))
            return original(f, *args, **kwargs)

        cls.calls, cls.on = [], True
        torch.load = torch.serialization.load = recording_load
        try:
            yield cls.calls
        finally:
            cls.on = False
            torch.load = torch.serialization.load = original


def _writes(args: tuple) -> bool:
    mode, flags = (args[1], args[2]) if len(args) >= 3 else (None, 0)
    writes_mode = isinstance(mode, str) and any(c in mode for c in "wax+")
    return writes_mode or bool(isinstance(flags, int) and flags & WRITE_FLAGS)


sys.addaudithook(Sandbox.hook)


@contextlib.contextmanager
def extension(target: Global | None, how: str) -> Iterator[None]:
    """The copyreg extension code the pickle's EXT opcode names, registered for one example."""
    if target is None:
        yield
        return
    copyreg.add_extension(target.module, target.name, EXTENSION_CODES[how])
    try:
        yield
    finally:
        copyreg.remove_extension(target.module, target.name, EXTENSION_CODES[how])
        copyreg.clear_extension_cache()


# ------------------------------------------------------------------------------------------------ the oracle
def assert_only_allowed_types(metadata: Any) -> None:
    assert type(metadata) is Metadata, type(metadata)
    pending, seen = [metadata], set()
    while pending:
        value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        assert type(value) in ALLOWED_TYPES, type(value)
        if isinstance(value, dict):
            pending += [*value.keys(), *value.values()]
        elif isinstance(value, (list, tuple)):
            pending += list(value)
        elif dataclasses.is_dataclass(value):
            fields = {field.name for field in dataclasses.fields(value)}
            assert set(vars(value)) <= fields, (type(value), set(vars(value)) - fields)
            pending += list(vars(value).values())


def planted_folder(base: Path, raw: bytes) -> Path:
    """A checkpoint folder as dspo writes one (Lightning's meta.pt beside torch's files), `raw` as its `.metadata`
    (and as rank 0's own `__0.metadata`)."""
    folder = Path(tempfile.mkdtemp(dir=base)) / "last.ckpt"
    folder.mkdir()
    torch.save({"global_step": 1}, folder / "meta.pt")
    (folder / ".metadata").write_bytes(raw)
    (folder / "__0.metadata").write_bytes(raw)
    return folder


def attempt(read: Any) -> tuple[str, Any]:
    """("returned", value) or ("raised", the exception): every read runs to its end inside the sandbox."""
    try:
        return "returned", read()
    except REFUSED as error:
        return "raised", error


def read_every_way(folder: Path) -> dict[str, tuple[str, Any]]:
    """The gate, dspo-eval's reader (with the gate, and without it: what torch's reader does after the check, when
    the folder may have been swapped) and torch's loader inside the context manager; what a planted `__reduce_ex__`
    would run on (copying or pickling what the gate returned)."""
    metadata = folder / ".metadata"
    outcomes = {
        "check_metadata": attempt(lambda: check_metadata(metadata, "ckpt_path")),
        "check_checkpoint_owner": attempt(lambda: check_checkpoint_owner(folder, "ckpt_path")),
        "read_checkpoint": attempt(lambda: read_checkpoint(str(folder))),
    }
    if outcomes["check_metadata"][0] == "returned":
        outcomes["copied"] = attempt(lambda: pickle.dumps(copy.deepcopy(outcomes["check_metadata"][1])))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dspo.runs.trust, "check_checkpoint_owner", lambda *args, **kwargs: None)
        outcomes["read_checkpoint, no gate"] = attempt(lambda: read_checkpoint(str(folder)))
    with folder_checkpoint_as_data():
        for rank in (None, 0):  # `.metadata`, and rank 0's own `__0.metadata`
            read_metadata = partial(FileSystemReader(str(folder)).read_metadata, rank=rank)
            outcomes[f"read_metadata(rank={rank})"] = attempt(read_metadata)
        outcomes["dcp.load"] = attempt(lambda: dcp.load({"w": torch.zeros(2)}, checkpoint_id=str(folder), no_dist=True))
    return outcomes


def nothing_runs_anywhere(folder: Path, paths: dict[str, str]) -> None:
    """Read every way, nothing runs; the gate and torch's metadata reader refuse naming the folder or return torch's
    Metadata holding data only; dspo-eval's reader and torch's loader refuse."""
    with Sandbox.watching(paths[PLANTED]) as calls:
        outcomes = read_every_way(folder)
    assert calls == [] and not Path(paths[MARKER]).exists(), (calls, outcomes)
    for way in ("check_metadata", "read_metadata(rank=None)", "read_metadata(rank=0)"):
        happened, value = outcomes[way]
        if happened == "returned":
            assert_only_allowed_types(value)
        else:
            assert isinstance(value, ForeignCheckpointError), (way, value)
            assert str(value).startswith(f"ckpt_path={folder}: "), (way, value)
    assert outcomes["check_checkpoint_owner"][0] == outcomes["check_metadata"][0], outcomes
    for way in ("read_checkpoint", "read_checkpoint, no gate", "dcp.load"):  # a planted folder never loads
        assert outcomes[way][0] == "raised", (way, outcomes[way])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The planted torch.save file (loading it with weights_only=False touches the marker) and the examples' folders.
    A legitimate read first, so that what torch imports lazily is imported before the sandbox watches."""
    base = tmp_path_factory.mktemp("pickles")
    torch.save(_Dumped(os.system, (f"touch {base / 'marker-planted'}",)), base / "planted.pt")
    real = base / "real.ckpt"
    dcp.save({"state_dict": {"policy.w": torch.ones(2)}, "step": 1}, checkpoint_id=str(real), no_dist=True)
    torch.save({"global_step": 1}, real / "meta.pt")
    with folder_checkpoint_as_data():
        dcp.load({"state_dict": {"policy.w": torch.zeros(2)}}, checkpoint_id=str(real), no_dist=True)
    read_checkpoint(str(real))
    return base


def _paths(base: Path) -> dict[str, str]:
    example = Path(tempfile.mkdtemp(dir=base))
    return {MARKER: str(example / "marker"), PLANTED: str(base / "planted.pt"), OUT: str(example / "out")}


SETTINGS = settings(
    max_examples=examples(250),
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(recipe=recipes)
def test_no_pickle_written_by_hand_runs_anything(recipe: Recipe, base: Path) -> None:
    paths = _paths(base)
    with extension(recipe.extension(), recipe.kind):
        nothing_runs_anywhere(planted_folder(base, recipe.write(paths)), paths)
    assert not (base / "marker-planted").exists()


@settings(SETTINGS, max_examples=examples(30))
@given(protocol=st.integers(0, 5), func_name=st.sampled_from(["os.system", "eval", "exec", "Path.touch", "torch.load"]))
def test_no_pickle_written_by_python_runs_anything(protocol: int, func_name: str, base: Path) -> None:
    paths = _paths(base)
    nothing_runs_anywhere(planted_folder(base, dumped(protocol, func_name, paths)), paths)
    assert not (base / "marker-planted").exists()


# ------------------------------------------------------------------------------------------------ the test's teeth
def test_the_sandbox_records_what_plain_pickle_runs(base: Path) -> None:
    """Unguarded, the generated pickles run: plain `pickle.loads` of the issue's pickle (protocol 4, STACK_GLOBAL of
    `torch.distributed.checkpoint.filesystem` / `os.system`, REDUCE) is recorded and creates the marker, and
    `torch_save_to_dcp` runs the planted file's `torch.load(weights_only=False)`."""
    paths = _paths(base)
    issue = Recipe(CALLS_CODE[5], "REDUCE", "STACK_GLOBAL", 4, True, False, HOLDERS[0], False)
    with Sandbox.watching(paths[PLANTED]) as calls:
        pickle.loads(issue.write(paths))
    assert calls[0][0] == "os.system" and Path(paths[MARKER]).exists()
    converter = Recipe(CALLS_CODE[11], "REDUCE", "GLOBAL", 2, False, False, HOLDERS[0], False)
    with Sandbox.watching(paths[PLANTED]) as calls, contextlib.suppress(*REFUSED):
        pickle.loads(converter.write(paths))
    assert ("torch.load", paths[PLANTED], False) in calls and (base / "marker-planted").exists()
    (base / "marker-planted").unlink()


@pytest.mark.parametrize("kind", ["EXT1", "EXT2", "EXT4", "INST", "OBJ", "BUILD_SETSTATE"])
def test_the_written_opcodes_call_what_they_name(base: Path, kind: str) -> None:
    """Each way of calling, by plain pickle: the payload runs (so a refusal of it is the gate's doing)."""
    paths = _paths(base)
    recipe = Recipe(CALLS_CODE[0], kind, "GLOBAL", 2, False, True, HOLDERS[1], False)
    with extension(recipe.extension(), kind), Sandbox.watching(paths[PLANTED]) as calls:
        pickle.loads(recipe.write(paths))
    assert calls and calls[0][0] == "os.system" and Path(paths[MARKER]).exists()


def test_a_real_metadata_passes_inside_the_sandbox(base: Path) -> None:
    """The sandbox records nothing for a real checkpoint folder read the same ways: what it records is the payload."""
    real = base / "real.ckpt"
    with Sandbox.watching(str(base / "planted.pt")) as calls:
        assert_only_allowed_types(check_metadata(real / ".metadata", "ckpt_path"))
        read = read_checkpoint(str(real))
        with folder_checkpoint_as_data():
            state = {"state_dict": {"policy.w": torch.zeros(2)}, "step": 0}
            dcp.load(state, checkpoint_id=str(real), no_dist=True)
    assert calls == [], calls
    assert torch.equal(read["state_dict"]["policy.w"], torch.ones(2)) and read["global_step"] == 1
    assert torch.equal(state["state_dict"]["policy.w"], torch.ones(2)) and state["step"] == 1
