"""Issue 70 (7): what mutation testing of dspo/runs/trust.py found no test for (docs/testing.md#mutation-score).

The plug-ins the command line imports (`import_modules`); what a record may name (only classes and functions of the
user's modules) and how each refusal names its key and the way out; `trust_remote_code` dropped at any depth; the
owner check's folder, file and uid; every opcode form a pickler may write a `.metadata` in (string and memo opcodes,
with or without frames and header, protocols 2-5, lone surrogates), read without torch's protocol warning; the
rewrite's own refusals and the check of what was built (types torch allows that no metadata holds, attributes that
are not fields, a path's slots, cycles); torch's reader inside `folder_checkpoint_as_data` (a rank's own
`__N.metadata`, a metadata without `storage_meta`, items saved on a GPU, a planner that does not flatten, a planted
item's refusal)."""

from __future__ import annotations

import collections
import io
import os
import pickle
import pickletools
import struct
import sys
import threading
from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

import dspo.runs.trust
from dspo.runs.trust import (
    ForeignCheckpointError,
    UntrustedRecordError,
    allowed_target,
    check_checkpoint_owner,
    check_metadata,
    check_targets,
    drop_remote_code,
    folder_checkpoint_as_data,
    import_modules,
    load_metadata,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _never(key: str) -> bool:
    """No key is set on the command line."""
    return False


# ------------------------------------------------------------------------------------------- imports=[...]
@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A user's plug-in folder on sys.path; the modules written there are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_import_modules_imports_each_module_and_returns_their_names(plugins) -> None:
    first = plugins("trust70_first", "LOADED = True\n")
    second = plugins("trust70_second", "LOADED = True\n")
    assert import_modules(None) == []  # no imports=: nothing to import
    assert first not in sys.modules
    assert import_modules((first, second)) == [first, second]
    assert sys.modules[first].LOADED and sys.modules[second].LOADED


@pytest.mark.parametrize("names", ["trust70_first", ["trust70_first", 3], [None]])
def test_imports_that_are_not_a_list_of_names_are_refused_saying_how_to_write_them(plugins, names) -> None:
    plugins("trust70_first", "LOADED = True\n")
    with pytest.raises(TypeError) as error:
        import_modules(names)
    assert str(error.value) == f"imports must be a list of module names, e.g. imports=[my_objective]; got {names!r}"
    assert "trust70_first" not in sys.modules  # refused before anything is imported


def test_a_module_that_cannot_be_imported_is_named_with_the_way_out(plugins) -> None:
    plugins("trust70_broken_dep", "import trust70_no_such_dependency\n")
    for name, missing in (("trust70_no_such_module", "trust70_no_such_module"), ("trust70_broken_dep", None)):
        with pytest.raises(ImportError) as error:
            import_modules([name])
        message = str(error.value)
        assert message.startswith(f"imports: module '{name}' failed to import (ModuleNotFoundError: No module named ")
        assert f"'{missing or 'trust70_no_such_dependency'}'" in message
        way_out = "its folder is on PYTHONPATH (e.g. PYTHONPATH=docs/examples dspo-train imports=[...])"
        assert message.endswith(f"check its name and that {way_out}")
        assert isinstance(error.value.__cause__, ModuleNotFoundError)


def test_a_module_that_fails_as_it_runs_keeps_its_own_error(plugins) -> None:
    """A bug in a plug-in is not a wrong name: its exception (and traceback) reach the user as they are."""
    plugins("trust70_buggy", "raise RuntimeError('a bug in the plug-in')\n")
    with pytest.raises(RuntimeError, match="^a bug in the plug-in$"):
        import_modules(["trust70_buggy"])


# ------------------------------------------------------------------------------------------- run records
def test_only_classes_and_functions_of_the_users_modules_are_allowed(plugins) -> None:
    """An object of the user's module (an instance, even a callable one) is not a class or function it defines."""
    module = plugins(
        "trust70_plugin",
        "import functools, os\n\n"
        "class Tool:\n    def __call__(self):\n        return os.getcwd()\n\n"
        "def make():\n    return Tool()\n\n"
        "tool = Tool()\n"
        "run = functools.partial(os.system, 'true')\n",
    )
    assert allowed_target(f"{module}.Tool", [module]) and allowed_target(f"{module}.make", [module])
    assert not allowed_target(f"{module}.tool", [module])
    assert not allowed_target(f"{module}.run", [module])


def test_a_key_the_command_line_sets_exempts_only_itself() -> None:
    """The user's `env.tools=...` exempts that subtree; the record's keys after it are still checked."""
    section = {
        "_target_": "dspo.env.Environment",
        "tools": {"search": {"_target_": "my_tools.Search"}},
        "reward": {"_target_": "os.system"},
    }
    with pytest.raises(UntrustedRecordError, match=r"^dspo_run.json: env\.reward\._target_='os\.system' is not"):
        check_targets(section, "env", (), lambda key: key.startswith("env.tools"), "dspo_run.json")


def test_a_records_imports_are_refused_at_any_depth_saying_where_imports_belong() -> None:
    section = {"_target_": "dspo.env.Environment", "reward": {"judge": {"imports": ["evil"]}}}
    with pytest.raises(UntrustedRecordError) as error:
        check_targets(section, "env", (), _never, "dspo_run.json")
    message = str(error.value)
    assert message.startswith("dspo_run.json: env.reward.judge.imports=['evil'] names modules to import")
    assert message.endswith("Pass imports=[...] on the command line if you trust them")
    check_targets({"judge": {"imports": None}}, "env", (), _never, "dspo_run.json")  # an empty key names nothing


@pytest.mark.parametrize(
    ("node", "start", "way_out"),
    [
        (
            {"_target_": "dspo.${x}"},
            "dspo_run.json: rollout.agent.x._target_='dspo.${x}' is interpolated",
            "Set rollout.agent.x._target_=... (or the whole rollout=...) on the command line if you trust this model "
            "folder",
        ),
        (
            {"url": "${oc.env:HOME}"},
            "dspo_run.json: rollout.agent.x.url='${oc.env:HOME}' calls a resolver",
            "A record may refer to other keys (${a.b}, ${oc.select:a.b,default}) only; set rollout.agent.x.url=... on "
            "the command line if you trust this model folder",
        ),
        (
            {"_target_": "my_pkg.tools.Thing"},
            "dspo_run.json: rollout.agent.x._target_='my_pkg.tools.Thing' is not a target dspo ships",
            "If you trust this model folder, allow it with imports=[my_pkg.tools], or set rollout.agent.x._target_=... "
            "(or the whole rollout=...) on the command line",
        ),
        (
            {"_target_": "system"},
            "dspo_run.json: rollout.agent.x._target_='system' is not a target dspo ships",
            "allow it with imports=[MODULE], or set rollout.agent.x._target_=... (or the whole rollout=...) on the "
            "command line",
        ),
        (
            {"_target_": 3},
            "dspo_run.json: rollout.agent.x._target_=3 is not a target dspo ships",
            "allow it with imports=[MODULE], or set rollout.agent.x._target_=... (or the whole rollout=...) on the "
            "command line",
        ),
    ],
)
def test_a_refusal_in_a_nested_section_names_its_key_and_the_way_out(node, start, way_out) -> None:
    """The way out names the refused key, the module to import (the target's own module, `MODULE` where the target
    names none) and the section's top key, which the command line may set whole (`rollout=...` for
    `rollout.agent`)."""
    with pytest.raises(UntrustedRecordError) as error:
        check_targets({"x": node}, "rollout.agent", (), _never, "dspo_run.json")
    message = str(error.value)
    assert message.startswith(start) and message.endswith(way_out), message


def test_trust_remote_code_is_dropped_at_any_depth_of_a_section() -> None:
    section = {
        "name": "toy",
        "engine": {"trust_remote_code": True},
        "judge": {"model": {"trust_remote_code": True}, "reward": {"model": {"trust_remote_code": True}}},
        "off": {"trust_remote_code": False},
    }
    mine = "rollout.judge.model.trust_remote_code"
    lines = drop_remote_code(section, "rollout", lambda key: key == mine, "dspo_run.json")
    assert section["engine"]["trust_remote_code"] is False
    assert section["judge"]["reward"]["model"]["trust_remote_code"] is False
    assert section["judge"]["model"]["trust_remote_code"] is True  # the command line's own setting
    assert [line.split(":")[1].split(" in ")[0].strip() for line in lines] == [
        "rollout.engine.trust_remote_code=true",
        "rollout.judge.reward.model.trust_remote_code=true",
    ]


# ------------------------------------------------------------------------------------------- the owner check
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A folder torch's DCP save wrote: 40 tensors (a `.metadata` with more than 256 memoized objects), plain items."""
    folder = tmp_path_factory.mktemp("trust70") / "real.ckpt"
    state = {f"layer{i}.w": torch.full((2, 3), float(i)) for i in range(40)}
    dcp.save({**state, "step": 7, "loops": {"name": "fit"}}, checkpoint_id=str(folder), no_dist=True)
    return folder


def _metadata(folder: Path) -> Metadata:
    with open(folder / ".metadata", "rb") as handle:
        return pickle.load(handle)  # torch's own trusted save: the reference


@pytest.fixture
def owners(monkeypatch):
    """Who owns each path (the current user unless listed)."""
    table: dict[Path, int] = {}
    monkeypatch.setattr(dspo.runs.trust, "_owner", lambda path: table.get(Path(path), os.getuid()))
    return table


def test_a_folder_without_metadata_is_not_a_folder_checkpoint_and_passes(tmp_path, owners) -> None:
    folder = tmp_path / "hf_model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    owners[folder] = os.getuid() + 1
    check_checkpoint_owner(folder, "ckpt_path")  # another user's, but no pickle to read: left to its loader


@pytest.mark.parametrize("foreign", [".metadata", "folder", "both"])
def test_a_foreign_checkpoint_is_refused_naming_the_file_its_owner_and_the_opt_in(saved, owners, foreign) -> None:
    uid = os.getuid()
    if foreign in ("folder", "both"):
        owners[saved] = uid + 1
    if foreign in (".metadata", "both"):
        owners[saved / ".metadata"] = uid + 2
    named, owner = (saved, uid + 1) if foreign == "folder" else (saved / ".metadata", uid + 2)
    with pytest.raises(ForeignCheckpointError) as error:
        check_checkpoint_owner(saved, "ckpt_path")
    message = str(error.value)
    assert message.startswith(f"ckpt_path={saved}: {named} belongs to another user (uid {owner}, you are {uid}); ")
    assert message.endswith("If you trust where it comes from, pass allow_foreign_checkpoint=true")
    assert check_checkpoint_owner(saved, "ckpt_path", allow_foreign=True) is None


# ------------------------------------------------------------------------------------------- `.metadata` as data
_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8")


def _string(text: str, opcode: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    if opcode == "SHORT_BINUNICODE" and len(data) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
    if opcode == "BINUNICODE8":
        return pickle.BINUNICODE8 + struct.pack("<Q", len(data)) + data
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _memo(short: bytes, long: bytes, slot: int, always_long: bool) -> bytes:
    return short + bytes([slot]) if slot < 256 and not always_long else long + struct.pack("<I", slot)


def reencode(raw: bytes, strings: str | None = None, memo: str | None = None, header: bool = True) -> bytes:
    """`raw` (a protocol 4 pickle) with the other opcodes a pickler may choose, unframed: every string as `strings`;
    every memo store as BINPUT / LONG_BINPUT at slots 1, 4, 7, ... (`memo="spread"`: short where they fit) or all
    long (`memo="long"`), each fetch renumbered alike; without its PROTO header (`header=False`)."""
    ops = list(pickletools.genops(raw))
    ends = [pos for _, _, pos in ops[1:]] + [len(raw)]
    out, stored = [], 0
    for (op, arg, start), end in zip(ops, ends, strict=True):
        if op.name == "FRAME" or (op.name == "PROTO" and not header):
            continue
        if op.name in _STRINGS and strings:
            out.append(_string(arg, strings))
        elif op.name == "MEMOIZE" and memo:
            out.append(_memo(pickle.BINPUT, pickle.LONG_BINPUT, 3 * stored + 1, memo == "long"))
            stored += 1
        elif op.name in ("BINGET", "LONG_BINGET") and memo:
            out.append(_memo(pickle.BINGET, pickle.LONG_BINGET, 3 * arg + 1, memo == "long"))
        else:
            out.append(raw[start:end])
    return b"".join(out)


def _read(raw: bytes) -> Metadata:
    return load_metadata(io.BytesIO(raw), "ckpt_path=DIR")


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_metadata_pickled_in_any_protocol_of_2_to_5_reads_back_equal(saved, protocol) -> None:
    metadata = _metadata(saved)
    assert _read(pickle.dumps(metadata, protocol=protocol)) == metadata


@pytest.mark.parametrize(
    "form",
    [
        {"strings": "BINUNICODE"},
        {"strings": "BINUNICODE8"},
        {"memo": "spread"},
        {"memo": "long"},
        {"header": False},
        {"strings": "BINUNICODE", "memo": "spread", "header": False},
    ],
    ids=str,
)
def test_every_string_and_memo_opcode_a_pickler_may_write_reads_the_same(saved, form) -> None:
    """A `.metadata` is read for what it holds, not for the opcodes its pickler chose: strings of any string opcode,
    memo slots numbered as written (not as counted), no frames, no PROTO header (plain pickle reads them all)."""
    metadata = _metadata(saved)
    raw = reencode(pickle.dumps(metadata, protocol=4), **form)
    assert pickle.loads(raw) == metadata  # a valid pickle of the same metadata
    assert _read(raw) == metadata


def test_reading_a_metadata_warns_nothing(saved, recwarn) -> None:
    """The rewrite is in protocol 2, the one torch's unpickler reads without a warning (DCP writes 4)."""
    check_metadata(saved / ".metadata", "ckpt_path")
    assert [str(w.message) for w in recwarn if "protocol" in str(w.message)] == []


def test_any_string_reads_back_as_plain_pickle_reads_it_lone_surrogates_too(saved) -> None:
    metadata = _metadata(saved)
    odd = Metadata({"\ud800lone": metadata.state_dict_metadata["step"], "é\u2028x" * 100: None})
    for protocol in (2, 4):
        assert _read(pickle.dumps(odd, protocol=protocol)) == odd


def _refusal(raw: bytes, tmp_path: Path) -> str:
    (tmp_path / ".metadata").write_bytes(raw)
    with pytest.raises(ForeignCheckpointError) as error:
        check_metadata(tmp_path / ".metadata", "ckpt_path")
    return str(error.value)


def _refused_because(reason: str, tmp_path: Path) -> str:
    return (
        f"ckpt_path={tmp_path}: its .metadata is not a torch checkpoint's metadata (UnpicklingError: {reason}); "
        "unpickling it could run any code, so nothing was loaded. Use a checkpoint dspo wrote"
    )


PROTO4 = pickle.PROTO + b"\x04"
MODULE = "torch.distributed.checkpoint.metadata"


def _stack_global(module: str, name: str) -> bytes:
    """A protocol 4 pickle of one global, as Python's pickler writes it (without memoizing the strings)."""
    return PROTO4 + _string(module, "BINUNICODE") + _string(name, "BINUNICODE") + pickle.STACK_GLOBAL + pickle.STOP


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (PROTO4 + pickle.BINGET + b"\x07" + pickle.STOP, "memo slot 7 is fetched before it is set"),
        (
            PROTO4 + _string(MODULE, "BINUNICODE") + pickle.NONE + pickle.STACK_GLOBAL + pickle.STOP,
            "STACK_GLOBAL whose module and name are not two literal strings",
        ),
        (
            PROTO4 + pickle.NONE + _string("Metadata", "BINUNICODE") + pickle.STACK_GLOBAL + pickle.STOP,
            "STACK_GLOBAL whose module and name are not two literal strings",
        ),
        (
            _string("Metadata", "BINUNICODE") + pickle.STACK_GLOBAL + pickle.STOP,
            "STACK_GLOBAL whose module and name are not two literal strings",
        ),
        (
            _stack_global(f"{MODULE}\nMetadata", "x"),
            f"STACK_GLOBAL of a name with a line break: '{MODULE}\\nMetadata', 'x'",
        ),
        (
            _stack_global(MODULE, "Metadata\nI1"),
            f"STACK_GLOBAL of a name with a line break: '{MODULE}', 'Metadata\\nI1'",
        ),
    ],
    ids=["unset-memo", "name-not-a-string", "module-not-a-string", "one-string", "module-break", "name-break"],
)
def test_what_the_rewrite_cannot_write_as_protocol_2_is_refused_saying_why(tmp_path, raw, reason) -> None:
    """A fetch of a memo slot never set, a STACK_GLOBAL of anything but two literal strings, a name with a line break
    (GLOBAL reads each up to one: the rest would be read as opcodes)."""
    assert _refusal(raw, tmp_path) == _refused_because(reason, tmp_path)


def test_the_reason_taken_from_a_planted_file_is_cut_to_300_characters(tmp_path) -> None:
    """The reason quotes what the file holds: a planted name of any length leaves the refusal one short line."""
    reason = f"STACK_GLOBAL of a name with a line break: '{MODULE}', 'Metadata\\n{'x' * 1000}'"
    raw = _stack_global(MODULE, "Metadata\n" + "x" * 1000)
    assert _refusal(raw, tmp_path) == _refused_because(reason[:300], tmp_path)


class _PathWithState:
    """Pickles as a `PosixPath` whose slot `_drv` BUILD sets to another object (torch's unpickler sets slot state)."""

    def __init__(self, slot_value: object) -> None:
        self.slot_value = slot_value

    def __reduce__(self):
        return PosixPath, ("ckpt",), (None, {"_drv": self.slot_value})


def _with_extra(value, **extra):
    value.__dict__.update(extra)
    return value


@pytest.mark.parametrize(
    ("built", "reason"),
    [
        ({"state_dict_metadata": {}}, "it holds a builtins.dict, not torch's Metadata"),
        (Metadata({"w": collections.OrderedDict()}), "it holds a collections.OrderedDict"),
        (Metadata({"w": [1, {"x": torch.device("cpu")}]}), "it holds a torch.device"),
        (Metadata({"w": (1 + 2j,)}), "it holds a builtins.complex"),
        (Metadata({"w": _PathWithState(collections.OrderedDict())}), "it holds a collections.OrderedDict"),
        (
            _with_extra(Metadata({}), extra="x"),
            "its torch.distributed.checkpoint.metadata.Metadata has attributes that are not fields: ['extra']",
        ),
        (
            Metadata({"w": _with_extra(TensorStorageMetadata(None, torch.Size([2]), []), extra=1, more=None)}),
            "its torch.distributed.checkpoint.metadata.TensorStorageMetadata has attributes that are not fields: "
            "['extra', 'more']",
        ),
    ],
    ids=["not-metadata", "ordered-dict", "device", "complex", "path-slot", "metadata-attribute", "nested-attribute"],
)
def test_what_torch_builds_but_no_metadata_holds_is_refused_naming_it(tmp_path, built, reason) -> None:
    """torch's unpickler also builds OrderedDicts, devices, complex numbers and sets state on the classes it allows
    (attributes, a path's slots); the check of what it built allows only a `Metadata` of torch's metadata classes,
    each with its own fields, and plain values, at any depth."""
    assert _refusal(pickle.dumps(built, protocol=4), tmp_path) == _refused_because(reason, tmp_path)


def test_a_metadata_that_holds_itself_is_checked_in_bounded_time() -> None:
    """A planted cycle (a list that holds itself) does not hang the gate: each object is checked once."""
    loop: list = [1]
    loop.append(loop)
    raw = pickle.dumps(Metadata({"w": loop, "v": [loop, loop]}), protocol=4)
    result: list = []
    reader = threading.Thread(target=lambda: result.append(_read(raw)), daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert result, "the check of a cyclic .metadata did not end"
    (read,) = result
    assert read.state_dict_metadata["w"][1] is read.state_dict_metadata["w"]


def test_a_torch_without_what_dspo_reads_with_is_named_with_the_way_out(saved, monkeypatch) -> None:
    """A future torch without the private unpickler or without `safe_globals`: a refusal naming the error and what
    to do, never plain pickle."""
    import torch.serialization

    for remove, error in (
        (lambda: monkeypatch.setitem(sys.modules, "torch._weights_only_unpickler", None), "ModuleNotFoundError"),
        (lambda: monkeypatch.delattr(torch.serialization, "safe_globals"), "ImportError"),
    ):
        remove()
        with pytest.raises(ForeignCheckpointError) as refused:
            check_metadata(saved / ".metadata", "ckpt_path")
        message = str(refused.value)
        assert message.startswith(f"ckpt_path={saved}: this torch ({torch.__version__}) lacks what dspo reads")
        assert f"({error}: " in message
        assert message.endswith(
            "Install a torch version dspo supports (pyproject.toml) or use a single-file checkpoint"
        )
        monkeypatch.undo()


# ------------------------------------------------------------------------------------------- torch's reader
def _planted_metadata() -> bytes:
    class Planted:
        def __reduce__(self):
            return os.system, ("true",)

    return pickle.dumps(Planted(), protocol=4)


def test_torchs_reader_reads_a_ranks_own_metadata_as_data(saved, tmp_path) -> None:
    """torch >= 2.8 may read rank N's own `__N.metadata`: that file is the one read, and read as data."""
    good, bad = (saved / ".metadata").read_bytes(), _planted_metadata()
    for name, planted in ((".metadata", "__0.metadata"), ("__0.metadata", ".metadata")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / name).write_bytes(good)
        (folder / planted).write_bytes(bad)
        rank = 0 if name == "__0.metadata" else None
        with folder_checkpoint_as_data("ckpt_path"):
            assert FileSystemReader(str(folder)).read_metadata(rank=rank).state_dict_metadata.keys() == (
                _metadata(saved).state_dict_metadata.keys()
            )
            with pytest.raises(ForeignCheckpointError, match=rf"^ckpt_path={folder}: its .metadata is not"):
                FileSystemReader(str(folder)).read_metadata(rank=0 if rank is None else None)


def test_a_metadata_without_storage_meta_gets_one_holding_the_readers_load_id(saved, tmp_path) -> None:
    """As torch's reader does: a `.metadata` saved without `storage_meta` (older saves) still reads."""
    metadata = _metadata(saved)
    metadata.storage_meta = None
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    reader = FileSystemReader(str(tmp_path))
    with folder_checkpoint_as_data():
        read = reader.read_metadata()
    assert isinstance(read.storage_meta, StorageMeta) and read.storage_meta.load_id == reader.load_id
    assert FileSystemReader(str(tmp_path)).read_metadata().storage_meta.load_id != reader.load_id  # a new reader's own


def test_a_checkpoint_whose_items_hold_tensors_saved_on_a_gpu_loads_on_the_cpu(tmp_path, monkeypatch) -> None:
    """A non-tensor item (a tuple of tensors) of a checkpoint written on a GPU machine loads where dspo reads it."""
    import torch.serialization

    folder = tmp_path / "gpu.ckpt"
    with monkeypatch.context() as gpu:
        gpu.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")  # what a GPU's tensors record
        state = {"w": torch.ones(2), "pair": (torch.ones(2), torch.arange(3))}
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    state = {"w": torch.zeros(2), "pair": None}
    with folder_checkpoint_as_data():
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    first, second = state["pair"]
    assert first.device.type == "cpu" and torch.equal(first, torch.ones(2)) and torch.equal(second, torch.arange(3))


def test_items_load_with_a_planner_that_does_not_flatten(saved) -> None:
    """An item lands where torch's own planner puts it, with or without flattening the state dict."""
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    state = {"layer1.w": torch.zeros(2, 3), "step": None}
    with folder_checkpoint_as_data():
        dcp.load(state, checkpoint_id=str(saved), planner=planner, no_dist=True)
    assert state["step"] == 7 and torch.equal(state["layer1.w"], torch.ones(2, 3))


class _PlantedItem:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_a_planted_item_is_refused_naming_the_key_the_item_and_the_way_out(tmp_path) -> None:
    marker, folder = tmp_path / "ran", tmp_path / "ckpt"
    dcp.save({"w": torch.ones(2), "planted": _PlantedItem(marker)}, checkpoint_id=str(folder), no_dist=True)
    with pytest.raises(BaseException) as refused, folder_checkpoint_as_data("ckpt_path"):  # noqa: PT011
        dcp.load({"w": torch.zeros(2), "planted": None}, checkpoint_id=str(folder), no_dist=True)
    error = refused.value
    if not isinstance(error, ForeignCheckpointError):  # torch's loader wraps it: CheckpointException
        ((error, _traceback),) = error.failures.values()
    assert isinstance(error, ForeignCheckpointError), error
    message = str(error)
    assert message.startswith("ckpt_path: the checkpoint folder's item 'planted' is not plain data (UnpicklingError: ")
    assert message.endswith("; unpickling it could run any code, so it was not loaded. Use a checkpoint dspo wrote")
    assert not marker.exists()
