"""The guard callback's decisions and records, hand-checked (issue 70, item 7: mutation testing of dspo/guard/): which
action several detectors add up to, where a rollback may go (the round's bound, the best validation), what
`guard.jsonl` and the console say, what the last validation does, what several ranks agree on, what a checkpoint of
the guard holds and what an older one (issue 55's, before the ledger) loads as. Rounds are fed as the producer and the
module make them (a `RoundReport` on the round's first slot, a `StepReport` per step); `restore` and `set_lr_scale`
are recorded instead of run (tests/guard/test_rollback.py runs them on a real trainer)."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dspo.guard.callback as callback
from dspo.callbacks.checkpoints import RoundCheckpoint
from dspo.guard.callback import Guard, GuardStop, checkpoint_file_step
from dspo.guard.detectors import Detector, DetectorSettings, RoundSignals, Verdict
from dspo.types import RoundReport, SavedCheckpoint, StepReport


class Fixed(Detector):
    """Answers every round with `verdict`; records the signals it was given."""

    def __init__(self, verdict: Verdict, action: str = "rollback") -> None:
        super().__init__(DetectorSettings(action=action, warmup=0))
        self.verdict, self.seen = verdict, []

    def observe(self, signals: RoundSignals) -> Verdict:
        self.seen.append(signals)
        return self.verdict


class Module:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}
        self.step_report = StepReport(False, 1.0, 10.0, 1.0)

    def log_dict(self, values, **kwargs) -> None:
        self.logged.update(values)


class Broadcast:
    """Lightning's `strategy.broadcast(obj, src=0)` as one rank of two sees it: rank 0 gets its own object back;
    rank 1 gets rank 0's (`rank0`: the objects rank 0 sends, in order)."""

    def __init__(self, rank0: list | None = None) -> None:
        self.rank0, self.calls = rank0, []

    def __call__(self, obj, src=0):
        self.calls.append((obj, src))
        return obj if self.rank0 is None else self.rank0.pop(0)


def make_trainer(root: Path, checkpoint: RoundCheckpoint | None = None, **fields) -> SimpleNamespace:
    removed: list[str] = []
    saved: list[str] = []
    trainer = SimpleNamespace(
        callback_metrics={},
        global_step=1,
        max_steps=-1,
        world_size=1,
        callbacks=[checkpoint] if checkpoint is not None else [],
        is_global_zero=True,
        default_root_dir=str(root),
        sanity_checking=False,
        strategy=SimpleNamespace(barrier=lambda name=None: None, remove_checkpoint=removed.append),
        removed=removed,
        saved=saved,
        save_checkpoint=lambda path, weights_only=None: saved.append(path),
    )
    for key, value in fields.items():
        setattr(trainer, key, value)
    return trainer


def end_round(guard, trainer, module, round_index, reward=0.5, versions=None, batch_fields=None) -> None:
    oldest, newest = versions if versions is not None else (round_index, round_index)
    report = RoundReport(round_index, reward, 0.0, 0.2, 0.5, oldest, newest)
    batch = SimpleNamespace(round_index=round_index, minibatch_index=0, report=report, **(batch_fields or {}))
    guard.on_train_batch_end(trainer, module, None, batch, 0)


def validate(guard, trainer, module, value: float, step: int) -> None:
    trainer.global_step = step
    trainer.callback_metrics["val/subem_mean"] = torch.tensor(value)
    guard.on_validation_end(trainer, module)


@pytest.fixture
def restored(monkeypatch):
    """`restore` and `set_lr_scale` recorded: (trainer, module, path, lr scale) and (module, lr scale)."""
    calls = {"restore": [], "set_lr_scale": []}
    monkeypatch.setattr(callback, "restore", lambda *args: calls["restore"].append(args))
    monkeypatch.setattr(callback, "set_lr_scale", lambda *args: calls["set_lr_scale"].append(args))
    return calls


def events(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "guard.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ settings
def test_the_python_defaults_stop_after_three_rollbacks_at_half_the_rate_each(tmp_path, restored):
    """Guard() is conf/train.yaml's guard: backoff 0.5, max_rollbacks 3 (docs/guard.md)."""
    guard, trainer, module = Guard(detectors={"non_finite": {}}), make_trainer(tmp_path), Module()
    with pytest.raises(GuardStop, match=r"guard\.max_rollbacks=3"):
        for round_index in range(5):
            end_round(guard, trainer, module, round_index, reward=math.nan)
    assert [e.action for e in guard.events] == ["backoff", "backoff", "backoff", "stop"]
    assert [scale for _, scale in restored["set_lr_scale"]] == [0.5, 0.25, 0.125]


def test_a_backoff_of_one_is_allowed_and_one_above_one_is_refused():
    assert Guard(backoff=1.0).backoff == 1.0  # roll back without slowing down
    with pytest.raises(ValueError, match=r"^guard\.backoff=1\.5: must be in \(0, 1\]"):
        Guard(backoff=1.5)


def test_a_guard_turned_off_builds_no_detector_even_from_a_wrong_detector_config():
    """guard.enabled=false is the way out every guard error names: it must work whatever guard.detectors says."""
    guard = Guard(enabled=False, detectors={"nope": {}})
    assert guard.detectors == {} and guard.state_dict() == {}


def test_an_unsteady_validation_turns_val_drop_off_and_says_so_only_when_it_was_on(caplog):
    with caplog.at_level("INFO", logger="dspo.guard"):
        guard = Guard(detectors={"entropy": {}}, steady_validation=False)  # no val_drop to turn off: no line
    assert set(guard.detectors) == {"entropy"} and not caplog.records
    with caplog.at_level("INFO", logger="dspo.guard"):
        guard = Guard(detectors={"val_drop": {}, "entropy": {}}, steady_validation=False)
    assert set(guard.detectors) == {"entropy"}
    (record,) = caplog.records
    assert record.getMessage().startswith("guard: val_drop off") and "(env.steady_validation)" in record.getMessage()
    assert record.getMessage().endswith("(env.steady_validation)")


# ------------------------------------------------------------------------------------------------ the round
def test_the_detectors_see_every_number_of_the_round(tmp_path):
    """`RoundSignals` is what a registered detector gets: the round, the step, the report's shares and rewards, the
    steps' numbers, the last validation and its noise."""
    probe = Fixed(Verdict(0.0))
    guard, module = Guard(detectors={}), Module()
    guard.detectors = {"probe": probe}
    datamodule = SimpleNamespace(val_sets={"a": [0] * 8, "b": [0] * 8})
    trainer = make_trainer(tmp_path, datamodule=datamodule)
    validate(guard, trainer, module, 0.5, step=6)
    trainer.global_step = 7
    report = RoundReport(3, 0.25, 0.125, 0.375, 0.625, 2, 3)
    guard.on_train_batch_end(trainer, module, None, SimpleNamespace(round_index=3, minibatch_index=0, report=report), 0)
    noise = math.sqrt(2 * (0.25 / 8 + 0.25 / 8)) / 2
    assert probe.seen == [RoundSignals(3, 7, 0.25, 1.0, 10.0, 0.125, 1.0, 0.375, 0.625, 0.5, pytest.approx(noise), 0)]


def test_a_round_of_skipped_steps_has_no_step_numbers_and_fires_non_finite(tmp_path, restored):
    probe = Fixed(Verdict(0.0))
    guard, module, trainer = Guard(detectors={"non_finite": {}}), Module(), make_trainer(tmp_path)
    guard.detectors["probe"] = probe
    module.step_report = StepReport(skipped=True)
    end_round(guard, trainer, module, 0)
    (signals,) = probe.seen
    assert (signals.entropy, signals.response_tokens, signals.grad_norm, signals.skipped_steps) == (None, None, None, 1)
    assert (signals.validation, signals.validation_noise) == (None, None)  # no validation yet: its noise unknown
    assert guard.events[0].detectors["non_finite"]["score"] == 1.0


def test_batches_without_a_round_position_end_a_round_every_steps_per_round_steps(tmp_path):
    """A datamodule whose batches carry a `report` but no round slot position: the guard counts optimizer steps."""
    probe = Fixed(Verdict(0.0))
    guard, module, trainer = Guard(detectors={}, steps_per_round=3), Module(), make_trainer(tmp_path)
    guard.detectors = {"probe": probe}
    for step in range(1, 7):
        trainer.global_step = step
        first = step % 3 == 1
        batch = SimpleNamespace(report=RoundReport(step // 3, 0.5, 0.0, 0.0, 0.5, 0, 0) if first else None)
        guard.on_train_batch_end(trainer, module, None, batch, 0)
    assert [s.step for s in probe.seen] == [3, 6]


def test_a_batch_that_is_no_round_slot_and_ends_a_round_without_a_report_is_an_error(tmp_path):
    guard = Guard()
    with pytest.raises(RuntimeError) as error:
        guard.on_train_batch_end(make_trainer(tmp_path), Module(), None, torch.zeros(2), 0)
    message = str(error.value)
    assert message.startswith("guard: a round ended at step 1 without its RoundReport")
    assert "(callbacks.rollout: dspo.callbacks.rollout_callback.RolloutCallback)" in message
    assert "Turn the guard off with guard.enabled=false" in message


def test_a_module_without_step_reports_is_named_with_the_way_out():
    class Bare:
        pass

    with pytest.raises(ValueError) as error:
        Guard().on_train_start(SimpleNamespace(callbacks=[]), Bare())
    message = str(error.value)
    assert message.startswith("guard: Bare reports no steps (a `step_report` attribute, dspo.types.StepReport)")
    assert message.endswith("Use dspo.training.module.DSPOModule, or turn the guard off with guard.enabled=false")


# ------------------------------------------------------------------------------------------------ the ledger
def test_a_bad_round_marks_the_versions_up_to_its_newest_sampling_one_at_round_zero_too(tmp_path, restored):
    guard, trainer = Guard(detectors={"non_finite": {}}), make_trainer(tmp_path)
    end_round(guard, trainer, Module(), 0, reward=math.nan)
    assert guard.ledger.last_bad == 0
    assert guard.ledger.saved(SavedCheckpoint(1, 1, "/r/step00001.ckpt"))  # version 1 sampled nothing bad


def test_a_validation_drop_marks_every_version_up_to_the_validated_weights_bad(tmp_path, restored):
    """At k = 1 round 5 is sampled by version 4, but the validation it reads was of the step-5 weights (version 5):
    val_drop marks up to 5 bad, another detector up to 4 (the waiting version-5 checkpoint is dropped, or waits on)."""
    waiting = SavedCheckpoint(5, 5, str(tmp_path / "step00005.ckpt"))
    for name, last_bad, still_waiting in (("val_drop", 5, []), ("non_finite", 4, [waiting])):
        guard, trainer, module = Guard(detectors={name: {}}), make_trainer(tmp_path), Module()
        guard.detectors[name].load_state_dict({"seen": 1, "best": 0.75, "last": 0.75})
        guard.ledger.saved(waiting)
        if name == "val_drop":
            validate(guard, trainer, module, 0.5, step=5)
        end_round(guard, trainer, module, 5, reward=math.nan, versions=(4, 4))
        assert (guard.ledger.last_bad, guard.ledger.waiting) == (last_bad, still_waiting), name


def test_a_healthy_checkpoint_copied_from_last_ckpt_is_the_copy_with_its_version_and_step(tmp_path):
    """keep_last=0: the promoted checkpoint is `last.ckpt`, which the next round overwrites; the guard's healthy
    checkpoint is the copy `healthy.ckpt`, with the version and step of the original."""
    checkpoint = RoundCheckpoint(str(tmp_path), keep_last=0)
    trainer, guard = make_trainer(tmp_path, checkpoint), Guard(detectors={"non_finite": {}})
    (tmp_path / "last.ckpt").write_bytes(b"v3")
    checkpoint.last_model_path = str(tmp_path / "last.ckpt")
    checkpoint.newest = SavedCheckpoint(3, 6, str(tmp_path / "last.ckpt"))
    end_round(guard, trainer, Module(), 3, versions=(3, 3))
    kept = SavedCheckpoint(3, 6, str(tmp_path / "healthy.ckpt"))
    assert guard.ledger.healthy == kept and checkpoint.kept == {"healthy": kept.path}
    assert (tmp_path / "healthy.ckpt").read_bytes() == b"v3"


def test_without_a_checkpoint_callback_a_clean_round_still_records_the_healthy_checkpoint(tmp_path):
    guard, trainer = Guard(detectors={"non_finite": {}}), make_trainer(tmp_path)
    guard.ledger.saved(SavedCheckpoint(2, 2, "/r/step00002.ckpt"))
    end_round(guard, trainer, Module(), 2)
    assert guard.healthy == "/r/step00002.ckpt"


def test_a_resumed_run_keeps_the_files_of_every_role_again(tmp_path):
    checkpoint = RoundCheckpoint(str(tmp_path))
    guard = Guard()
    guard.ledger.waiting = [SavedCheckpoint(5, 5, "/r/step00005.ckpt")]
    guard.ledger.healthy = SavedCheckpoint(3, 3, "/r/step00003.ckpt")
    guard.best = SavedCheckpoint(2, 2, "/r/step00002.ckpt")
    guard.on_train_start(make_trainer(tmp_path, checkpoint), Module())
    assert checkpoint.kept == {
        "waiting-v5": "/r/step00005.ckpt",
        "healthy": "/r/step00003.ckpt",
        "best": "/r/step00002.ckpt",
    }
    Guard().on_train_start(make_trainer(tmp_path), Module())  # no checkpoint callback: nothing to keep


# ------------------------------------------------------------------------------------------------ actions
def test_a_rollback_and_a_warning_together_roll_back(tmp_path, restored):
    guard, trainer = Guard(detectors={}), make_trainer(tmp_path)
    guard.detectors = {"a_warn": Fixed(Verdict(1.0, True, "w"), "warn"), "b_rollback": Fixed(Verdict(2.0, True, "r"))}
    end_round(guard, trainer, Module(), 0)
    assert guard.events[0].action == "backoff" and guard.rollbacks == 1


def test_a_rollback_goes_to_the_healthy_checkpoint_only_if_older_than_the_bad_rounds_oldest_weights(tmp_path, restored):
    """Partial rollouts: round 5 was sampled by versions 2..4; the healthy version-3 checkpoint took part: backoff.
    A healthy version-1 checkpoint is restored, with the trainer, the module and the new rate."""
    for healthy, action in ((3, "backoff"), (1, "rollback")):
        guard, trainer, module = Guard(detectors={"non_finite": {}}), make_trainer(tmp_path), Module()
        guard.ledger.healthy = SavedCheckpoint(healthy, healthy, f"/r/step{healthy:05d}.ckpt")
        restored["restore"].clear()
        end_round(guard, trainer, module, 5, reward=math.nan, versions=(2, 4))
        assert guard.events[-1].action == action
        if action == "rollback":
            assert restored["restore"] == [(trainer, module, "/r/step00001.ckpt", 0.5)]
        else:
            assert restored["restore"] == [] and restored["set_lr_scale"][-1] == (module, 0.5)


def test_a_validation_drop_goes_to_the_best_validation_whatever_sampled_the_round(tmp_path, restored):
    """val_drop alone has no round bound: the best validation's checkpoint (version 4) is restored though the round it
    fired in was sampled from version 3 on; with a round detector firing too, the bound holds for both targets."""
    best, healthy = SavedCheckpoint(4, 4, "/r/step00004.ckpt"), SavedCheckpoint(1, 1, "/r/step00001.ckpt")
    for detectors, target in (({"val_drop": {}}, best.path), ({"val_drop": {}, "non_finite": {}}, healthy.path)):
        guard, trainer, module = Guard(detectors=detectors), make_trainer(tmp_path), Module()
        guard.detectors["val_drop"].load_state_dict({"seen": 1, "best": 0.75, "last": 0.75})
        guard.best, guard.ledger.healthy = best, healthy
        validate(guard, trainer, module, 0.5, step=6)
        end_round(guard, trainer, module, 6, reward=math.nan, versions=(3, 5))
        assert guard.events[-1].restored_from == target, detectors
    guard.best = SavedCheckpoint(5, 5, "/r/step00005.ckpt")  # both fire again, round 7 from version 5: not older
    validate(guard, trainer, module, 0.5, step=7)
    end_round(guard, trainer, module, 7, reward=math.nan, versions=(5, 5))
    assert guard.events[-1].restored_from == healthy.path


def test_a_rollback_event_in_guard_jsonl_and_on_the_console(tmp_path, restored, caplog):
    guard, trainer = Guard(detectors={}), make_trainer(tmp_path / "run" / "nested", global_step=8)
    guard.detectors = {
        "first": Fixed(Verdict(1.5, True, "reason one")),
        "second": Fixed(Verdict(0.25, True, "reason two"), "warn"),
    }
    guard.ledger.healthy = SavedCheckpoint(2, 4, "/r/step00004.ckpt")
    before = time.time()
    with caplog.at_level("WARNING", logger="dspo.guard"):
        end_round(guard, trainer, Module(), 3)
    (event,) = events(tmp_path / "run" / "nested")  # the run folder is made if missing
    assert before <= event.pop("time") <= time.time()
    assert event == {
        "step": 8,
        "round_index": 3,
        "detectors": {
            "first": {"score": 1.5, "reason": "reason one", "action": "rollback"},
            "second": {"score": 0.25, "reason": "reason two", "action": "warn"},
        },
        "action": "rollback",
        "rollbacks": 1,
        "lr_scale": 0.5,
        "restored_from": "/r/step00004.ckpt",
        "at_end": False,
    }
    assert caplog.records[-1].getMessage() == (
        "guard: round 3 (step 8): first (reason one; score 1.5); second (reason two; score 0.25) -> rolled back to "
        "/r/step00004.ckpt (rollbacks 1/3, lr x0.5)"
    )


def test_a_warning_and_a_backoff_restore_nothing_and_say_what_was_done(tmp_path, restored, caplog):
    guard, trainer = Guard(detectors={}), make_trainer(tmp_path)
    guard.detectors = {"flag": Fixed(Verdict(2.0, True, "flagged"), "warn")}
    with caplog.at_level("WARNING", logger="dspo.guard"):
        end_round(guard, trainer, Module(), 0)
        guard.detectors = {"flag": Fixed(Verdict(2.0, True, "flagged"))}
        end_round(guard, trainer, Module(), 1)
    assert [(e["action"], e["restored_from"]) for e in events(tmp_path)] == [("warn", None), ("backoff", None)]
    assert [r.getMessage() for r in caplog.records] == [
        "guard: round 0 (step 1): flag (flagged; score 2) -> warn (rollbacks 0/3, lr x1)",
        "guard: round 1 (step 1): flag (flagged; score 2) -> backoff (rollbacks 1/3, lr x0.5)",
    ]


def test_a_stop_names_every_detector_the_events_file_and_the_ways_out(tmp_path, restored):
    guard, trainer = Guard(detectors={}, max_rollbacks=0), make_trainer(tmp_path)
    guard.detectors = {"one": Fixed(Verdict(1.0, True, "r1")), "two": Fixed(Verdict(1.0, True, "r2"), "warn")}
    with pytest.raises(GuardStop) as error:
        end_round(guard, trainer, Module(), 2)
    assert str(error.value) == (
        "guard stopped the run at step 1 (round 2): one: r1; two: r2. Rollbacks so far: 0 (guard.max_rollbacks=0); "
        f"events in {tmp_path / 'guard.jsonl'}. Lower optimizer.lr, or turn the guard off with guard.enabled=false"
    )
    assert events(tmp_path)[0]["action"] == "stop" and events(tmp_path)[0]["restored_from"] is None


# ------------------------------------------------------------------------------------------------ validations
def test_a_validation_during_the_sanity_check_or_with_the_guard_off_is_not_read(tmp_path, restored):
    checkpoint = RoundCheckpoint(str(tmp_path))
    for guard, sanity in ((Guard(detectors={"val_drop": {}}), True), (Guard(enabled=False), False)):
        trainer = make_trainer(tmp_path, checkpoint, sanity_checking=sanity, global_step=0)
        validate(guard, trainer, Module(), 0.5, step=0)
        assert trainer.saved == [] and guard.best is None and guard.best_validation == float("-inf")


def test_an_equal_validation_keeps_the_older_best_checkpoint(tmp_path):
    checkpoint = RoundCheckpoint(str(tmp_path))
    guard, trainer, module = Guard(detectors={"val_drop": {}}), make_trainer(tmp_path, checkpoint), Module()
    validate(guard, trainer, module, 0.5, step=0)
    assert guard.best == SavedCheckpoint(0, 0, str(tmp_path / "start.ckpt"))
    for step in (4, 8):
        checkpoint.newest = SavedCheckpoint(step, step, str(tmp_path / f"step{step:05d}.ckpt"))
        validate(guard, trainer, module, 0.75, step=step)
    assert guard.best == SavedCheckpoint(4, 4, str(tmp_path / "step00004.ckpt"))


def test_every_rank_acts_on_rank_0s_validation_and_verdicts(tmp_path, restored):
    """Rank 1 of 2: its own validation (0.9) and its own numbers (nothing fired) are replaced by rank 0's (0.4; a
    detector fired, the round is suspect); it acts as rank 0 does and writes no file."""
    rank0 = [0.4, ({"non_finite": (2.0, "rank 0's numbers")}, True)]
    broadcast = Broadcast(rank0)
    trainer = make_trainer(tmp_path, world_size=2, is_global_zero=False)
    trainer.strategy.broadcast = broadcast
    guard, module = Guard(detectors={"non_finite": {}}), Module()
    validate(guard, trainer, module, 0.9, step=2)
    assert guard.best_validation == 0.4
    end_round(guard, trainer, module, 2)
    (event,) = guard.events
    assert event.detectors == {"non_finite": {"score": 2.0, "reason": "rank 0's numbers", "action": "rollback"}}
    assert event.action == "backoff" and guard.ledger.last_bad == 2 and not (tmp_path / "guard.jsonl").exists()
    assert [src for _, src in broadcast.calls] == [0, 0]


def test_rank_0_sends_its_validation_and_verdicts(tmp_path, restored):
    broadcast = Broadcast()
    trainer = make_trainer(tmp_path, world_size=2)
    trainer.strategy.broadcast = broadcast
    guard, module = Guard(detectors={"non_finite": {}, "reward_drop": {"warmup": 0, "drop": 0.5}}), Module()
    validate(guard, trainer, module, 0.5, step=1)
    end_round(guard, trainer, module, 1, reward=0.8)
    end_round(guard, trainer, module, 2, reward=math.nan)
    assert broadcast.calls[0] == (0.5, 0)
    assert broadcast.calls[1] == (({}, False), 0)
    (shared, suspect), src = broadcast.calls[2]
    assert (shared, suspect, src) == ({"non_finite": (1.0, "0 skipped steps, 1 non-finite values")}, False, 0)
    assert guard.events[0].detectors["non_finite"]["score"] == 1.0


def test_the_last_validation_is_read_at_once_with_the_noise_of_the_validation_set(tmp_path, restored):
    """2 x 8 questions: 2 standard errors are 0.35, so a 0.25 drop at the last validation is noise (no rollback), a
    0.5 drop is not; a one-step run's only validation after training is its last."""
    healthy = SavedCheckpoint(0, 0, "/r/start.ckpt")
    for drop, rolls_back in ((0.25, False), (0.5, True)):
        datamodule = SimpleNamespace(val_sets={"a": [0] * 8, "b": [0] * 8})
        trainer, module = make_trainer(tmp_path, datamodule=datamodule, max_steps=1), Module()
        guard = Guard(detectors={"val_drop": {}})
        guard.detectors["val_drop"].load_state_dict({"seen": 1, "best": 0.75, "last": 0.75})
        guard.ledger.healthy = healthy
        validate(guard, trainer, module, 0.75 - drop, step=1)
        assert restored["restore"] == ([(trainer, module, healthy.path, 1.0)] if rolls_back else []), drop
        restored["restore"].clear()


def test_the_last_validations_event_and_what_it_saves(tmp_path, restored, caplog):
    probe = Fixed(Verdict(0.0))
    checkpoint = RoundCheckpoint(str(tmp_path))
    checkpoint.last_model_path = str(tmp_path / "last.ckpt")
    trainer, module = make_trainer(tmp_path, checkpoint, max_steps=20), Module()
    guard = Guard(detectors={"val_drop": {}})
    guard.detectors["probe"] = probe
    guard.detectors["val_drop"].load_state_dict({"seen": 1, "best": 0.75, "last": 0.75})
    guard.rollbacks, guard.lr_scale = 2, 0.25
    guard.ledger.healthy = SavedCheckpoint(4, 8, "/r/step00008.ckpt")
    before = time.time()
    with caplog.at_level("WARNING", logger="dspo.guard"):
        validate(guard, trainer, module, 0.5, step=20)
    assert probe.seen == [RoundSignals(-1, 20, validation=0.5, validation_noise=None)]
    assert restored["restore"] == [(trainer, module, "/r/step00008.ckpt", 0.25)]
    assert trainer.saved == [str(tmp_path / "last.ckpt")] and guard.rollbacks == 3
    (event,) = events(tmp_path)
    assert before <= event.pop("time") <= time.time()
    reason = "validation 0.500 is 0.250 below its best 0.750 (bar 0.100)"
    assert event == {
        "step": 20,
        "round_index": -1,
        "detectors": {"val_drop": {"score": 0.25, "reason": reason, "action": "rollback"}},
        "action": "rollback",
        "rollbacks": 3,
        "lr_scale": 0.25,
        "restored_from": "/r/step00008.ckpt",
        "at_end": True,
    }
    assert caplog.records[-1].getMessage() == (
        f"guard: end of run (step 20): val_drop ({reason}; score 0.25) -> rolled back to /r/step00008.ckpt (the last "
        "validation: the run ends on these weights) (rollbacks 3/3, lr x0.25)"
    )


def test_a_warning_detector_does_not_act_at_the_last_validation(tmp_path, restored):
    trainer, module = make_trainer(tmp_path, max_steps=20), Module()
    guard = Guard(detectors={"val_drop": {"action": "warn"}})
    guard.detectors["val_drop"].load_state_dict({"seen": 1, "best": 0.75, "last": 0.75})
    guard.ledger.healthy = SavedCheckpoint(4, 8, "/r/step00008.ckpt")
    validate(guard, trainer, module, 0.25, step=20)
    assert restored["restore"] == [] and guard.events == []


def test_the_last_validation_rewrites_no_last_ckpt_before_the_first_save(tmp_path, restored):
    checkpoint = RoundCheckpoint(str(tmp_path))  # every_n_rounds longer than the run: no last.ckpt yet
    trainer, module = make_trainer(tmp_path, checkpoint, max_steps=20), Module()
    guard = Guard(detectors={"val_drop": {}})
    guard.detectors["val_drop"].load_state_dict({"seen": 1, "best": 0.75, "last": 0.75})
    guard.ledger.healthy = SavedCheckpoint(0, 0, str(tmp_path / "start.ckpt"))
    validate(guard, trainer, module, 0.25, step=20)
    assert len(restored["restore"]) == 1 and trainer.saved == []


# ------------------------------------------------------------------------------------------------ resume
def test_the_guard_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    guard = Guard(detectors={"entropy": {"warmup": 1}, "val_drop": {}})
    guard.rollbacks, guard.lr_scale, guard.best_validation = 1, 0.5, 0.625
    guard.ledger.waiting = [SavedCheckpoint(5, 5, "/r/step00005.ckpt")]
    guard.ledger.healthy, guard.ledger.last_bad = SavedCheckpoint(3, 3, "/r/step00003.ckpt"), 2
    guard.detectors["entropy"].observe(RoundSignals(0, 1, entropy=2.0))
    buffer = io.BytesIO()
    torch.save(guard.state_dict(), buffer)
    buffer.seek(0)
    again = Guard(detectors={"entropy": {"warmup": 1}, "val_drop": {}})
    again.load_state_dict(torch.load(buffer, weights_only=True))
    assert (again.rollbacks, again.lr_scale, again.best_validation) == (1, 0.5, 0.625)
    assert again.ledger == guard.ledger and again.best is None
    assert again.detectors["entropy"].state == {"seen": 1, "baseline": 2.0, "baseline_n": 1}
    assert again.detectors["entropy"].observe(RoundSignals(1, 2, entropy=0.125)).fired  # 0.0625x its level


def test_an_empty_guard_state_loads_as_nothing(tmp_path):
    """A checkpoint written with the guard off holds `{}`; a run resumed from it with the guard on starts fresh."""
    guard = Guard()
    guard.load_state_dict({})
    assert (guard.rollbacks, guard.lr_scale, guard.ledger, guard.best) == (0, 1.0, Guard().ledger, None)


def test_an_issue_55_guard_state_without_a_healthy_checkpoint_or_a_firing_loads_as_an_empty_ledger():
    """The first format (issue 55, a492338): no best, no best_validation; -1 for "none yet"."""
    old = {"rollbacks": 0, "lr_scale": 1.0, "healthy": None, "healthy_step": -1, "last_fire_step": -1,
           "detectors": {"entropy": {"seen": 2, "baseline": 1.5, "baseline_n": 2}}}  # fmt: skip
    guard = Guard(steps_per_round=2)
    guard.load_state_dict(old)
    assert guard.ledger == Guard().ledger and guard.ledger.last_bad == -1
    assert guard.best is None and guard.best_validation == float("-inf")
    assert guard.detectors["entropy"].state == {"seen": 2, "baseline": 1.5, "baseline_n": 2}


def test_an_issue_55_guard_state_takes_versions_from_its_steps():
    """M = 2 steps a round. Healthy at step 5 (a skipped step left the global step behind the slots): version
    5 // 2 = 2; the last firing at step 5: version 5 // 2 - 1 = 1; the best validation's file step00013.ckpt: version
    6, a best copied from last.ckpt (best.ckpt: no step in its name) or start.ckpt: version 0."""
    old = {"rollbacks": 1, "lr_scale": 0.5, "healthy": "/r/c/step00005.ckpt", "healthy_step": 5,
           "best": "/r/c/step00013.ckpt", "best_validation": 0.5, "last_fire_step": 5, "detectors": {}}  # fmt: skip
    guard = Guard(steps_per_round=2)
    guard.load_state_dict(old)
    assert guard.ledger.healthy == SavedCheckpoint(2, 5, "/r/c/step00005.ckpt")
    assert type(guard.ledger.healthy.version) is int and type(guard.ledger.last_bad) is int
    assert guard.ledger.last_bad == 1 and guard.best == SavedCheckpoint(6, 13, "/r/c/step00013.ckpt")
    assert type(guard.best.version) is int
    for name in ("best.ckpt", "start.ckpt"):
        guard.load_state_dict({**old, "best": f"/r9/c/{name}"})
        assert guard.best == SavedCheckpoint(0, 0, f"/r9/c/{name}")


def test_the_step_in_a_checkpoints_name():
    assert checkpoint_file_step("/run7/checkpoints/step00012.ckpt") == 12
    assert checkpoint_file_step("/run7/checkpoints/last.ckpt") == 0
