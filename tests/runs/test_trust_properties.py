"""Issue 53 (1): whatever a run record holds, nothing outside the allow-list is ever built.

Hypothesis generates records (targets literal and interpolated, `_partial_`, `_args_`, nested nodes, lists, other keys
an interpolation may read); each one the guard (`dspo.runs.trust.check_targets`, as `dspo.runs.record.adopt` runs it)
lets
through is then resolved and instantiated by Hydra in a sandbox: every target Hydra locates is recorded and replaced
by a stub that records its call, and Hydra's own blocklist is switched off, so that only dspo's guard stands between a
record and what it names. The oracle is independent of dspo.runs.trust: the object Hydra located must be one of a few
classes named here."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import hydra._internal.instantiate._instantiate2 as instantiate2
import pytest
from hydra._internal.utils import _locate
from hydra.utils import instantiate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from dspo.runs.trust import UntrustedRecordError, check_targets
from dspo.testing import examples

SAFE = ("dspo.env.Environment", "dspo.env.SearchTool", "dspo.search.client.RemoteRetriever", "dspo.env.SubEMReward")
SAFE_OBJECTS = {id(_locate(name)) for name in SAFE}
UNSAFE = (
    "os.system",
    "builtins.eval",
    "dspo.runs.trust.os.system",
    "dspo.runs.checkpoint_files.torch.load",
    "dspo.testing.run_to_exit",
    "dspo.runs.record.write_record",
    "dspo.no_such.Thing",
    "subprocess.run",
)
INTERPOLATED = (
    "dspo.${oc.select:nope,runs.trust.os.system}",
    "dspo.${retriever.index}",
    "dspo.${oc.select:x,runs.checkpoint_files.torch.load}",
    "${retriever.index}",
    "${oc.select:a.b,os.system}",
    "dspo.env.${name}",
    "${data.target}",
)
# what an interpolation may read: the record's other (data) keys, which nobody checks as code
CONTEXT = {
    "retriever": {"index": "runs.trust.os.system"},
    "name": "Environment",
    "data": {"target": "dspo.runs.trust.os.system"},
    "a": {"b": "builtins.eval"},
}

targets = st.sampled_from(SAFE + UNSAFE + INTERPOLATED)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from(["x", "/m/extra.pt", "${retriever.index}", "${oc.select:nope,runs.trust.os.system}", "${name}"]),
    targets,
)


def _node(children: st.SearchStrategy) -> st.SearchStrategy:
    plain = st.dictionaries(st.sampled_from(["tools", "reward", "retriever", "kwargs", "x"]), children, max_size=3)
    built = st.fixed_dictionaries(
        {"_target_": targets},
        optional={"_partial_": st.booleans(), "_args_": st.lists(children, max_size=2), "inner": children},
    )
    return st.one_of(st.lists(children, max_size=3), plain, built)


values = st.recursive(leaves, _node, max_leaves=12)
sections = st.dictionaries(st.sampled_from(["env", "retriever", "rollout"]), values, min_size=1, max_size=3)


@contextlib.contextmanager
def sandbox(located: list[str], calls: list[str]):
    """Hydra as it builds, except that nothing it locates runs, and its own blocklist does not hide dspo's guard."""

    def locate(path: str) -> Any:
        found = _locate(path)
        located.append(path if id(found) in SAFE_OBJECTS else f"UNSAFE {path} -> {found!r}")

        def stub(*args: Any, **kwargs: Any) -> str:
            calls.append(path)
            return f"built {path}"

        return stub

    saved = (instantiate2._locate, instantiate2._authorize_target_name)
    saved_identity = instantiate2._authorize_resolved_target_identity
    instantiate2._locate = locate
    instantiate2._authorize_target_name = lambda *args, **kwargs: None
    instantiate2._authorize_resolved_target_identity = lambda target, resolved_from, full_key: resolved_from
    try:
        yield
    finally:
        instantiate2._locate, instantiate2._authorize_target_name = saved
        instantiate2._authorize_resolved_target_identity = saved_identity


def _build_all(record: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Instantiate every node of the record that holds a `_target_`, as any section of it might be built."""
    cfg = OmegaConf.create({**CONTEXT, **record})
    located: list[str] = []
    calls: list[str] = []
    with sandbox(located, calls):
        for section in record:
            with contextlib.suppress(Exception):  # a bad record may fail to build: what matters is what it located
                instantiate(cfg[section])
    return located, calls


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sections)
def test_nothing_outside_the_allow_list_is_built(record) -> None:
    try:
        for name, section in record.items():
            check_targets(section, name, (), lambda key: False, "dspo_run.json")
    except UntrustedRecordError:
        return
    located, calls = _build_all(record)
    assert not [entry for entry in located if entry.startswith("UNSAFE")], located
    assert all(path in SAFE for path in calls)


def test_the_sandbox_sees_what_the_guard_used_to_let_through() -> None:
    """The sandbox is the test's teeth: the review's triggers, unguarded, locate `os.system` and `torch.load`."""
    located, _ = _build_all(
        {
            "retriever": {"_target_": "dspo.${oc.select:nope,runs.trust.os.system}", "_args_": ["id"], "index": "x"},
            "env": {"_target_": "dspo.${oc.select:x,runs.checkpoint_files.torch.load}", "_args_": ["/m/extra.pt"]},
        }
    )
    assert any("os.system" in entry and entry.startswith("UNSAFE") for entry in located), located
    assert any("torch.load" in entry and entry.startswith("UNSAFE") for entry in located), located


@pytest.mark.parametrize("target", SAFE)
def test_the_safe_targets_pass_the_guard(target) -> None:
    check_targets({"_target_": target, "_args_": [os.sep]}, "env", (), lambda key: False, "dspo_run.json")
