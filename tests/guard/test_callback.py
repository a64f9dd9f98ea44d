"""The guard callback without a run (issues 55 and 70): what it logs, when it acts, what it refuses, which checkpoint
it trusts. Rounds are fed as the producer and the module make them: a `RoundReport` on the round's first slot and a
`StepReport` per step (the guard reads no logger keys)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspo.callbacks.checkpoints import RoundCheckpoint
from dspo.guard.callback import Guard, GuardStop
from dspo.types import RoundReport, SavedCheckpoint, StepReport


class Module:
    def __init__(self, **step) -> None:
        self.logged: dict[str, float] = {}
        self.step_report = StepReport(**step) if step else StepReport(entropy=1.0, response_tokens=10.0, grad_norm=1.0)

    def log_dict(self, values, **kwargs) -> None:
        self.logged.update(values)


def trainer(tmp_path, checkpoint: RoundCheckpoint | None = None, **metrics) -> SimpleNamespace:
    values = {k.replace("__", "/"): torch.tensor(v) for k, v in metrics.items()}
    removed: list[str] = []
    return SimpleNamespace(
        callback_metrics=values,
        global_step=1,
        world_size=1,
        callbacks=[checkpoint] if checkpoint is not None else [],
        is_global_zero=True,
        default_root_dir=str(tmp_path),
        sanity_checking=False,
        strategy=SimpleNamespace(barrier=lambda name=None: None, remove_checkpoint=removed.append),
        removed=removed,
    )


def report(round_index: int, reward: float = 0.5, versions: tuple[int, int] | None = None) -> RoundReport:
    oldest, newest = versions if versions is not None else (round_index, round_index)
    return RoundReport(round_index, reward, 0.0, 0.2, 0.5, oldest, newest)


def end_round(guard: Guard, trainer_, module: Module, round_index: int, **kwargs) -> None:
    batch = SimpleNamespace(round_index=round_index, minibatch_index=0, report=report(round_index, **kwargs))
    guard.on_train_batch_end(trainer_, module, None, batch, 0)


def save(checkpoint: RoundCheckpoint, trainer_, round_index: int) -> str:
    """What RoundCheckpoint records at round `round_index`'s end (after the guard): a file of version round + 1."""
    path = Path(checkpoint.dirpath) / f"step{round_index + 1:05d}.ckpt"
    path.write_bytes(f"weights v{round_index + 1}".encode())
    trainer_.global_step = round_index + 1
    checkpoint.newest = SavedCheckpoint(round_index + 1, round_index + 1, str(path))
    checkpoint.best_k_models[str(path)] = round_index + 1
    return str(path)


def test_guard_off_logs_no_guard_tag_and_writes_no_file(tmp_path):
    guard, module = Guard(enabled=False), Module(entropy=float("nan"))
    end_round(guard, trainer(tmp_path), module, 0, reward=float("nan"))
    assert module.logged == {} and not (tmp_path / "guard.jsonl").exists() and guard.state_dict() == {}


def test_guard_on_logs_every_detector_score_rollbacks_and_lr_scale(tmp_path):
    guard, module = Guard(), Module(entropy=1.0, response_tokens=10.0, grad_norm=2.0)
    end_round(guard, trainer(tmp_path), module, 0)
    names = {"reward_drop", "val_drop", "entropy", "length", "grad_spike", "non_finite", "no_search"}
    assert set(module.logged) == {f"guard/{n}" for n in names} | {"guard/rollbacks", "guard/lr_scale"}
    assert module.logged["guard/grad_spike"] == 1.0 and module.logged["guard/lr_scale"] == 1.0


def test_the_round_signals_come_from_the_reports_not_from_logger_keys(tmp_path, monkeypatch):
    """A renamed logger tag cannot turn a detector off: the guard reads the producer's `RoundReport` and the module's
    `StepReport`s (the round's steps averaged, the largest gradient norm, skipped steps counted)."""
    seen = []
    guard = Guard(steps_per_round=3, detectors={"non_finite": {"action": "warn"}})  # a skipped step fires it
    detector = guard.detectors["non_finite"]
    monkeypatch.setattr(
        detector, "observe", lambda signals, observe=detector.observe: seen.append(signals) or observe(signals)
    )
    trainer_ = trainer(tmp_path, rollout__sampled_reward_mean=99.0, train__entropy=99.0)  # stale keys: not read
    steps = [StepReport(False, 1.0, 10.0, 2.0), StepReport(skipped=True), StepReport(False, 3.0, 20.0, 5.0)]
    for index, step in enumerate(steps):
        module = Module()
        module.step_report = step
        batch = SimpleNamespace(round_index=4, minibatch_index=index, report=report(4, 0.25) if index == 0 else None)
        guard.on_train_batch_end(trainer_, module, None, batch, index)
    (signals,) = seen
    assert (signals.sampled_reward, signals.entropy, signals.response_tokens) == (0.25, 2.0, 15.0)
    assert (signals.grad_norm, signals.skipped_steps, signals.no_search_share) == (5.0, 1, 0.2)


def test_a_round_without_its_report_or_a_module_without_step_reports_is_an_error(tmp_path):
    guard, trainer_ = Guard(), trainer(tmp_path)
    with pytest.raises(RuntimeError, match=r"without its RoundReport.*guard\.enabled=false"):
        guard.on_train_batch_end(trainer_, Module(), None, SimpleNamespace(round_index=0, minibatch_index=0), 0)
    with pytest.raises(ValueError, match=r"reports no steps.*guard\.enabled=false"):
        guard.on_train_start(trainer_, SimpleNamespace())


def test_a_warning_is_a_console_line_and_a_guard_jsonl_entry_and_nothing_else(tmp_path, caplog):
    guard, module = Guard(detectors={"non_finite": {"action": "warn"}}), Module()
    with caplog.at_level("WARNING", logger="dspo.guard"):
        end_round(guard, trainer(tmp_path), module, 4, reward=float("nan"))
    (event,) = [json.loads(line) for line in (tmp_path / "guard.jsonl").read_text().splitlines()]
    assert event["action"] == "warn" and event["round_index"] == 4 and event["detectors"]["non_finite"]["score"] == 1
    assert "guard: round 4 (step 1): non_finite" in caplog.text
    assert guard.rollbacks == 0 and guard.lr_scale == 1.0 and guard.ledger.last_bad == -1


def test_stop_raises_with_the_detector_and_the_way_out(tmp_path):
    guard, module = Guard(detectors={"non_finite": {"action": "stop"}}), Module()
    with pytest.raises(GuardStop, match=r"non_finite: .*guard\.enabled=false"):
        end_round(guard, trainer(tmp_path), module, 0, reward=float("inf"))


def test_a_rollback_over_max_rollbacks_stops(tmp_path):
    guard, module = Guard(detectors={"non_finite": {}}, max_rollbacks=0), Module()
    with pytest.raises(GuardStop, match=r"guard\.max_rollbacks=0"):
        end_round(guard, trainer(tmp_path), module, 0, reward=float("nan"))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"backoff": 0.0}, "guard.backoff"),
        ({"max_rollbacks": -1}, "guard.max_rollbacks"),
        ({"steps_per_round": 0}, "guard.steps_per_round"),
    ],
)
def test_a_wrong_setting_names_its_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Guard(**kwargs)


def _with_scheduler(trainer_, module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))  # warm-up 2
    scheduler.step()  # step 1: factor 2/3
    trainer_.lr_scheduler_configs = [SimpleNamespace(scheduler=scheduler)]
    module.trainer, module.optim_cfg = trainer_, SimpleNamespace(lr=1e-3)
    return optimizer, scheduler


def test_a_backoff_counts_as_a_rollback_resets_the_detectors_and_the_run_stops_after_max_rollbacks(tmp_path):
    """Issue 70 (2): entropy collapsed from round 4 with no healthy checkpoint; the backoff did not count, did not
    reset the detector and set the last firing, so it backed off 21 times (lr 1e-3 -> 4.8e-10) with no GuardStop."""
    trainer_, module = trainer(tmp_path), Module(entropy=1.0, response_tokens=10.0, grad_norm=1.0)
    optimizer, scheduler = _with_scheduler(trainer_, module)
    guard = Guard(detectors={"entropy": {"warmup": 2}}, max_rollbacks=3)
    actions = []
    with pytest.raises(GuardStop, match=r"guard\.max_rollbacks=3"):
        for round_index in range(30):
            module.step_report = StepReport(False, 1.0 if round_index < 4 else 1e-4, 10.0, 1.0)  # collapsed from 4
            end_round(guard, trainer_, module, round_index)
            actions = [e.action for e in guard.events]
    assert actions == ["backoff", "backoff", "backoff"] and [e.action for e in guard.events][-1] == "stop"
    assert guard.rollbacks == 3 and guard.lr_scale == pytest.approx(0.5**3)
    assert scheduler.base_lrs == [pytest.approx(1e-3 * 0.5**3)]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5**3 * 2 / 3)
    # entropy keeps its warm-up baseline across a restart (`after_rollback`): a slowed policy still collapsed fires
    # again at once, and the run stops three rounds later rather than halving its rate forever
    assert [e.round_index for e in guard.events] == [4, 5, 6, 7]


def test_a_warning_does_not_stop_a_checkpoint_from_becoming_healthy(tmp_path):
    checkpoint = RoundCheckpoint(str(tmp_path), keep_last=-1)
    trainer_ = trainer(tmp_path, checkpoint)
    guard = Guard(detectors={"non_finite": {"action": "warn"}})
    path = save(checkpoint, trainer_, 0)
    end_round(guard, trainer_, Module(), 1, reward=float("nan"))
    assert guard.events[0].action == "warn" and guard.healthy == path


def test_a_suspect_round_keeps_the_checkpoint_that_sampled_it_from_becoming_healthy(tmp_path):
    checkpoint = RoundCheckpoint(str(tmp_path), keep_last=-1)
    trainer_ = trainer(tmp_path, checkpoint)
    guard = Guard(detectors={"reward_drop": {"drop": 0.5, "warmup": 0}})  # alpha 0.3, patience 3
    paths = {}
    for round_index, reward in enumerate([0.8, 0.8, 0.1, 0.8]):
        end_round(guard, trainer_, Module(), round_index, reward=reward)
        if round_index == 2:  # 0.1 < 0.8 x 0.5: suspect (the EMA, 0.59, is 26 % below: no firing yet)
            assert guard.healthy == paths[0] and not guard.events and guard.ledger.last_bad == 2
        paths[round_index] = save(checkpoint, trainer_, round_index)
    assert guard.healthy == paths[2]  # version 3 sampled round 3, clean: the suspect round's version 2 never was


@pytest.mark.parametrize("staleness", [1, 2])
def test_at_k_ahead_a_clean_round_vouches_for_the_checkpoint_that_sampled_it_not_the_newest(
    tmp_path, monkeypatch, staleness
):
    """Issue 70 (2): round r is sampled by the weights of version r - k. A clean round used to promote the newest
    checkpoint, whose weights had sampled nothing yet; a rollback could land on the checkpoint that produced the
    collapse. Now the checkpoint of the round's own sampling version becomes healthy, waiting checkpoints outlive
    keep_last until judged, and a rollback goes to a checkpoint older than the bad round's sampling weights."""
    import dspo.guard.callback as callback

    restored = []
    monkeypatch.setattr(callback, "restore", lambda trainer, module, path, scale: restored.append(path))
    checkpoint = RoundCheckpoint(str(tmp_path), keep_last=1)
    trainer_ = trainer(tmp_path, checkpoint)
    guard, module = Guard(detectors={"non_finite": {}}), Module()
    paths, previous = {}, None  # version -> file
    for round_index in range(6):
        version, bad = max(0, round_index - staleness), round_index == 5
        reward = float("nan") if bad else 0.5
        end_round(guard, trainer_, module, round_index, reward=reward, versions=(version, version))
        if not bad and version >= 1:
            assert guard.ledger.healthy.version == version  # not round_index: the newest has sampled nothing yet
        paths[round_index + 1] = save(checkpoint, trainer_, round_index)
        if previous is not None:  # keep_last=1: Lightning drops the previous step file
            checkpoint.best_k_models.pop(previous)
            checkpoint._remove_checkpoint(trainer_, previous)
        previous = paths[round_index + 1]
    bad_version = 5 - staleness
    assert restored == [paths[bad_version - 1]]  # the newest checkpoint whose own round was clean
    assert paths[bad_version - 1] not in trainer_.removed and paths[bad_version] in trainer_.removed


def test_a_drop_at_the_last_validation_ends_the_run_on_the_healthy_checkpoint(tmp_path, monkeypatch):
    """No round follows the last validation, so val_drop acts there: the healthy weights are restored (even past
    max_rollbacks) and last.ckpt is written again; a validation before the end only records the value."""
    import dspo.guard.callback as callback

    restored, saved = [], []
    monkeypatch.setattr(callback, "restore", lambda trainer, module, path, scale: restored.append((path, scale)))
    checkpoint = RoundCheckpoint(str(tmp_path))
    checkpoint.last_model_path = str(tmp_path / "last.ckpt")
    trainer_ = trainer(tmp_path, checkpoint, val__subem_mean=0.4)
    trainer_.max_steps, trainer_.global_step = 20, 10
    trainer_.save_checkpoint = lambda path, weights_only=None: saved.append(path) if weights_only is False else None
    guard, module = Guard(detectors={"val_drop": {}}, max_rollbacks=0), Module()
    guard.ledger.healthy = SavedCheckpoint(8, 16, str(tmp_path / "step00016.ckpt"))
    guard.on_validation_end(trainer_, module)  # step 10 of 20: the next round reads it
    end_round(guard, trainer_, module, 4)
    assert not guard.events and not restored
    trainer_.global_step = 20
    trainer_.callback_metrics["val/subem_mean"] = torch.tensor(0.25)  # 0.15 below the best: over the 0.1 margin
    guard.on_validation_end(trainer_, module)
    assert restored == [(guard.healthy, 1.0)] and saved == [str(tmp_path / "last.ckpt")]
    event = json.loads((tmp_path / "guard.jsonl").read_text())
    assert event["at_end"] and event["action"] == "rollback" and event["restored_from"] == guard.healthy
    assert "val_drop" in event["detectors"] and guard.rollbacks == 1


def test_a_last_validation_within_the_margin_or_without_a_healthy_checkpoint_changes_nothing(tmp_path, monkeypatch):
    import dspo.guard.callback as callback

    monkeypatch.setattr(callback, "restore", lambda *args: pytest.fail("restored"))
    trainer_ = trainer(tmp_path, val__subem_mean=0.4)
    trainer_.max_steps, trainer_.global_step = 20, 20
    guard = Guard(detectors={"val_drop": {}})
    guard.on_validation_end(trainer_, Module())  # no healthy checkpoint yet: nothing to end on
    trainer_.callback_metrics["val/subem_mean"] = torch.tensor(0.35)
    guard.ledger.healthy = SavedCheckpoint(8, 16, str(tmp_path / "step00016.ckpt"))
    guard.on_validation_end(trainer_, Module())  # 0.05 below: within the margin
    assert not guard.events and not (tmp_path / "guard.jsonl").exists()


def test_a_new_best_validation_keeps_the_checkpoint_it_validated_and_val_drop_rolls_back_to_it(tmp_path, monkeypatch):
    """The round checkpoint saved at a validation's step holds the validated weights: kept as `best` when the
    validation is the best so far; a later val_drop restores it rather than the newest healthy checkpoint (which a
    slow decline can already have reached), at the end of the run as mid-run; other detectors go to healthy."""
    import dspo.guard.callback as callback

    restored = []
    monkeypatch.setattr(callback, "restore", lambda trainer, module, path, scale: restored.append(path))
    monkeypatch.setattr(callback, "set_lr_scale", lambda *args: None)
    checkpoint = RoundCheckpoint(str(tmp_path), keep_last=1)
    trainer_ = trainer(tmp_path, checkpoint, val__subem_mean=0.4)
    trainer_.max_steps = 100
    guard, module = Guard(detectors={"val_drop": {}, "non_finite": {}}), Module()
    saved = []
    trainer_.save_checkpoint = lambda path, weights_only=None: saved.append(path) if weights_only is False else None
    for step, value in ((0, 0.4), (4, 0.6), (8, 0.55), (12, 0.45)):
        trainer_.global_step = step
        path = str(tmp_path / f"step{step:05d}.ckpt")
        checkpoint.newest = SavedCheckpoint(step, step, path) if step else None
        trainer_.callback_metrics["val/subem_mean"] = torch.tensor(value)
        guard.on_validation_end(trainer_, module)
        if step == 0:  # the start's weights: no round checkpoint holds them, so the guard writes them
            assert saved == [str(tmp_path / "start.ckpt")] and guard.best.path == saved[0]
        if step < 12:
            end_round(guard, trainer_, module, step)  # the round after a validation reads it (and promotes)
    assert guard.best.path == str(tmp_path / "step00004.ckpt") and guard.best_validation == pytest.approx(0.6)
    assert checkpoint.kept["best"] == guard.best.path and not restored
    assert trainer_.removed == [str(tmp_path / "start.ckpt")]
    guard.ledger.healthy = SavedCheckpoint(12, 12, str(tmp_path / "step00012.ckpt"))  # a slow decline
    end_round(guard, trainer_, module, 13)  # reads the step-12 validation: 0.15 below the best
    assert restored == [guard.best.path] and guard.events[-1].restored_from == guard.best.path
    guard.ledger.healthy = SavedCheckpoint(12, 12, str(tmp_path / "step00012.ckpt"))
    end_round(guard, trainer_, module, 14, reward=float("nan"))  # non_finite: the newest healthy checkpoint
    assert restored[-1] == guard.healthy
    state = guard.state_dict()
    again = Guard(detectors={"val_drop": {}, "non_finite": {}})
    again.load_state_dict(state)
    assert (again.best, again.best_validation, again.ledger) == (guard.best, guard.best_validation, guard.ledger)


def test_a_guard_state_written_before_the_ledger_loads(tmp_path):
    """Checkpoints of issue 55's guard hold the healthy file and step and the last firing's step."""
    old = {
        "rollbacks": 1, "lr_scale": 0.5, "healthy": "/r/checkpoints/step00004.ckpt", "healthy_step": 4,
        "best": "/r/checkpoints/start.ckpt", "best_validation": 0.4, "last_fire_step": 6, "detectors": {},
    }  # fmt: skip
    guard = Guard(steps_per_round=2)
    guard.load_state_dict(old)
    assert guard.ledger.healthy == SavedCheckpoint(2, 4, "/r/checkpoints/step00004.ckpt")
    assert guard.ledger.last_bad == 2 and guard.best == SavedCheckpoint(0, 0, "/r/checkpoints/start.ckpt")
    assert (guard.rollbacks, guard.lr_scale) == (1, 0.5)


@pytest.mark.parametrize(
    ("overrides", "steady"),
    [([], True), (["env=simulated"], False), (["env=goal_reflect"], True), (["env=stepsearch"], True)],
)
def test_an_environment_whose_validation_moves_turns_val_drop_off(tmp_path, overrides, steady):
    """env=simulated validates at its noise curriculum's current level (0 -> 0.5 over the run): its validations
    fell 0.415 -> 0.590 -> 0.305 in 20 toy steps as the noise rose, and val_drop rolled back three times on a healthy
    run (issue 55's false-positive check). The config says so (env.steady_validation) and the guard listens."""
    from hydra.utils import instantiate

    from dspo.toy.rebuild import compose_train

    guard = instantiate(compose_train(overrides).guard)
    assert guard.steady_validation is steady and ("val_drop" in guard.detectors) is steady
    trainer_ = trainer(tmp_path, RoundCheckpoint(str(tmp_path)), val__subem_mean=0.9)
    trainer_.max_steps, trainer_.global_step, trainer_.save_checkpoint = 20, 0, lambda path, weights_only=None: None
    guard.on_validation_end(trainer_, Module())
    assert (guard.best is not None) is steady  # no best target either: it would be chosen by an easier validation
