"""The guard under any firing sequence (issue 70, item 2): a property test over random verdict scripts x
`rollout.max_staleness` k in {0, 1, 2} (with and without partial rollouts' version spans) x checkpoint cadence {1, 10}
x `keep_last` {-1, 0} x `max_rollbacks` 0..3, with the guard's state round-tripped through a checkpoint at random
rounds. What must hold whatever fires when:

- it ends: at most `max_rollbacks` rollbacks or backoffs, then `GuardStop`; the rate never below backoff^max_rollbacks;
- a rollback never targets a checkpoint younger than the bad round's oldest sampling weights, and the file it restores
  holds the weights of the version the guard believes (a copy of `last.ckpt` taken before the next round overwrote it);
- a checkpoint becomes healthy only after a clean round its own weights (or newer ones) sampled, and never when a
  round judged bad earlier was sampled by it or a newer version;
- its state written into a checkpoint (torch's weights_only loader) and loaded into a new guard changes no decision.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dspo.guard.callback as callback
from dspo.callbacks.checkpoints import RoundCheckpoint
from dspo.guard.callback import Guard, GuardStop
from dspo.guard.detectors import Detector, DetectorSettings, Verdict
from dspo.testing import examples
from dspo.types import RoundReport, SavedCheckpoint, StepReport

KINDS = ("clean", "warn", "suspect", "fire")


class Scripted(Detector):
    """Answers each round as the script says: `fire` (fires), `suspect`, or, for the warn detector, `warn`."""

    def __init__(self, script: list[str], fires_on: str, action: str) -> None:
        super().__init__(DetectorSettings(action=action, warmup=0))
        self.script, self.fires_on = script, fires_on

    def observe(self, signals) -> Verdict:
        kind = self.script[signals.round_index]
        return Verdict(1.0, fired=kind == self.fires_on, suspect=kind == "suspect" and self.fires_on == "fire")


@dataclass(frozen=True)
class Case:
    script: tuple[str, ...]
    staleness: int
    spans: tuple[int, ...]  # per round: how many versions older its oldest tokens are (partial rollouts)
    cadence: int
    keep_last: int
    max_rollbacks: int
    round_trips: tuple[bool, ...]


def cases() -> st.SearchStrategy[Case]:
    def build(n: int):
        return st.builds(
            Case,
            script=st.lists(st.sampled_from(KINDS), min_size=n, max_size=n).map(tuple),
            staleness=st.sampled_from([0, 1, 2]),
            spans=st.lists(st.integers(0, 1), min_size=n, max_size=n).map(tuple),
            cadence=st.sampled_from([1, 10]),
            keep_last=st.sampled_from([-1, 0]),
            max_rollbacks=st.integers(0, 3),
            round_trips=st.lists(st.booleans(), min_size=n, max_size=n).map(tuple),
        )

    return st.integers(3, 40).flatmap(build)


class Run:
    """A run's rounds as the guard sees them, with round checkpoints written as files whose content names their
    version, Lightning's keep_last=0 (`last.ckpt` rewritten every save) or -1 (every step file kept)."""

    def __init__(self, case: Case, folder: Path, monkeypatch) -> None:
        self.case, self.folder = case, folder
        self.restored: list[tuple[int, int, bytes]] = []  # (round, version the guard believes, the file's content)
        self.current: Guard | None = None
        monkeypatch.setattr(callback, "restore", self._restore)
        monkeypatch.setattr(callback, "set_lr_scale", lambda module, scale: None)
        self.checkpoint = RoundCheckpoint(str(folder), keep_last=case.keep_last)
        self.trainer = SimpleNamespace(
            callback_metrics={}, global_step=0, world_size=1, callbacks=[self.checkpoint], is_global_zero=True,
            default_root_dir=str(folder), sanity_checking=False,
            strategy=SimpleNamespace(barrier=lambda name=None: None, remove_checkpoint=self._remove),
        )  # fmt: skip
        self.module = SimpleNamespace(step_report=StepReport(False, 1.0, 10.0, 1.0), log_dict=lambda *a, **k: None)
        self.round = 0

    def _restore(self, trainer, module, path: str, scale: float) -> None:
        targets = [self.current.ledger.healthy, self.current.best]
        (believed,) = {c.version for c in targets if c is not None and c.path == path}
        self.restored.append((self.round, believed, Path(path).read_bytes()))

    def _remove(self, path: str) -> None:
        Path(path).unlink(missing_ok=True)

    def guard(self) -> Guard:
        guard = Guard(max_rollbacks=self.case.max_rollbacks, detectors={})
        guard.detectors = {
            "scripted": Scripted(list(self.case.script), "fire", "rollback"),
            "scripted_warn": Scripted(list(self.case.script), "warn", "warn"),
        }
        return guard

    def versions(self, round_index: int) -> tuple[int, int]:
        newest = max(0, round_index - self.case.staleness)
        return max(0, newest - self.case.spans[round_index]), newest

    def judge(self, guard: Guard, round_index: int) -> None:
        self.round, self.current = round_index, guard
        oldest, newest = self.versions(round_index)
        report = RoundReport(round_index, 0.5, 0.0, 0.0, 0.5, oldest, newest)
        batch = SimpleNamespace(round_index=round_index, minibatch_index=0, report=report)
        guard.on_train_batch_end(self.trainer, self.module, None, batch, 0)

    def save(self, round_index: int) -> None:
        """RoundCheckpoint at the round's end (after the guard), every `cadence` rounds."""
        if (round_index + 1) % self.case.cadence:
            return
        version = round_index + 1
        self.trainer.global_step = version
        name = "last.ckpt" if self.case.keep_last == 0 else f"step{version:05d}.ckpt"
        (self.folder / name).write_bytes(f"v{version}".encode())
        self.checkpoint.last_model_path = str(self.folder / "last.ckpt")
        self.checkpoint.newest = SavedCheckpoint(version, version, str(self.folder / name))


def round_trip(guard: Guard, run: Run) -> Guard:
    """The guard's state through a checkpoint file (torch.save, then torch's weights_only loader) into a new guard,
    which is started as a resumed run starts it."""
    buffer = io.BytesIO()
    torch.save({"guard": guard.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["guard"]
    again = run.guard()
    again.load_state_dict(state)
    again.on_train_start(run.trainer, run.module)
    return again


def simulate(case: Case, monkeypatch, with_round_trips: bool) -> tuple[list, Run, Guard, bool, list]:
    folder = Path(tempfile.mkdtemp(prefix="guard-property-"))
    run, stopped, earlier = Run(case, folder, monkeypatch), False, []  # earlier: the events of guards replaced
    guard = run.guard()
    bad_newest, promoted_over = -1, []  # the newest version of any bad round judged so far; per promotion, that bound
    for round_index in range(len(case.script)):
        before = guard.ledger.healthy
        try:
            run.judge(guard, round_index)
        except GuardStop:
            stopped = True
            break
        if guard.ledger.healthy != before and guard.ledger.healthy is not None:
            promoted_over.append((guard.ledger.healthy.version, bad_newest, run.versions(round_index)[0]))
        if case.script[round_index] in ("fire", "suspect"):
            bad_newest = max(bad_newest, run.versions(round_index)[1])
        run.save(round_index)
        if with_round_trips and case.round_trips[round_index]:
            earlier += guard.events  # written to guard.jsonl, not to checkpoints
            guard = round_trip(guard, run)
    events = [(e.round_index, e.action, e.restored_from, e.rollbacks, e.lr_scale) for e in earlier + guard.events]
    return events, run, guard, stopped, promoted_over


@settings(max_examples=examples(250), deadline=None, derandomize=True)
@given(case=cases())
def test_the_guard_ends_targets_only_vouched_older_weights_and_survives_a_checkpoint(case: Case) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        events, run, guard, stopped, promoted = simulate(case, monkeypatch, with_round_trips=False)
    acting = [e for e in events if e[1] in ("rollback", "backoff")]
    assert len(acting) <= case.max_rollbacks
    assert guard.lr_scale >= guard.backoff**case.max_rollbacks - 1e-12
    fired = [r for r, kind in enumerate(case.script) if kind == "fire"]
    if len(fired) > case.max_rollbacks:  # one more rollback asked for than allowed: the run stopped there
        assert stopped and events[-1][1] == "stop" and events[-1][0] == fired[case.max_rollbacks]
    for round_index, believed, content in run.restored:
        assert believed < run.versions(round_index)[0]  # older than the bad round's oldest sampling weights
        assert content == f"v{believed}".encode()  # the file holds those weights (not a later last.ckpt)
    for version, bad_before, oldest in promoted:
        assert bad_before < version <= oldest  # a clean round its weights (or newer) sampled; no bad one since
    with pytest.MonkeyPatch.context() as monkeypatch:
        again, _, resumed, _, _ = simulate(case, monkeypatch, with_round_trips=True)
    assert named(again) == named(events) and ledger_shape(resumed) == ledger_shape(guard)


def named(events: list) -> list:
    """Events with file names instead of paths (the two simulations write to different folders)."""
    return [(r, action, Path(path).name if path else None, n, scale) for r, action, path, n, scale in events]


def ledger_shape(guard: Guard) -> tuple:
    def shape(c: SavedCheckpoint | None):
        return (c.version, c.step, Path(c.path).name) if c else None

    ledger = guard.ledger
    return [shape(c) for c in ledger.waiting], shape(ledger.healthy), ledger.last_bad, shape(guard.best)


def test_the_property_catches_a_guard_that_backs_off_without_counting(monkeypatch) -> None:
    """The property above fails on the guard of issue 55 (a backoff did not count toward max_rollbacks): a guard
    patched back to that behaviour backs off more than max_rollbacks times on a script of repeated firings."""
    case = Case(("fire",) * 8, 0, (0,) * 8, 10, -1, 1, (False,) * 8)
    original = Guard._act

    def uncounted(self, trainer, pl_module, round_index, fired, bound):
        rollbacks = self.rollbacks
        action = original(self, trainer, pl_module, round_index, fired, bound)
        if action == "backoff":
            self.rollbacks = rollbacks  # what issue 55's guard did
        return action

    monkeypatch.setattr(Guard, "_act", uncounted)
    events, *_ = simulate(case, monkeypatch, with_round_trips=False)
    assert len([e for e in events if e[1] == "backoff"]) > case.max_rollbacks
