"""The guard callback without a run (issue 55, point 3): what it logs, when it acts, what it refuses."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dspo.guard.callback import Guard, GuardStop


class Module:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}
        self._skipped_in_a_row = 0

    def log_dict(self, values, **kwargs) -> None:
        self.logged.update(values)


def trainer(tmp_path, **metrics) -> SimpleNamespace:
    values = {k.replace("__", "/"): torch.tensor(v) for k, v in metrics.items()}
    return SimpleNamespace(
        callback_metrics=values,
        global_step=1,
        world_size=1,
        callbacks=[],
        is_global_zero=True,
        default_root_dir=str(tmp_path),
        sanity_checking=False,
    )


def end_round(guard: Guard, trainer_, module: Module, round_index: int) -> None:
    batch = SimpleNamespace(round_index=round_index, minibatch_index=0)
    guard.on_train_batch_end(trainer_, module, None, batch, 0)


def test_guard_off_logs_no_guard_tag_and_writes_no_file(tmp_path):
    guard, module = Guard(enabled=False), Module()
    end_round(guard, trainer(tmp_path, rollout__sampled_reward_mean=float("nan")), module, 0)
    assert module.logged == {} and not (tmp_path / "guard.jsonl").exists() and guard.state_dict() == {}


def test_guard_on_logs_every_detector_score_rollbacks_and_lr_scale(tmp_path):
    guard, module = Guard(), Module()
    end_round(guard, trainer(tmp_path, rollout__sampled_reward_mean=0.5, train__grad_norm=2.0), module, 0)
    names = {"reward_drop", "val_drop", "entropy", "length", "grad_spike", "non_finite", "no_search"}
    assert set(module.logged) == {f"guard/{n}" for n in names} | {"guard/rollbacks", "guard/lr_scale"}
    assert module.logged["guard/grad_spike"] == 1.0 and module.logged["guard/lr_scale"] == 1.0


def test_a_warning_is_a_console_line_and_a_guard_jsonl_entry_and_nothing_else(tmp_path, caplog):
    guard, module = Guard(detectors={"non_finite": {"action": "warn"}}), Module()
    with caplog.at_level("WARNING", logger="dspo.guard"):
        end_round(guard, trainer(tmp_path, rollout__sampled_reward_mean=float("nan")), module, 4)
    (event,) = [json.loads(line) for line in (tmp_path / "guard.jsonl").read_text().splitlines()]
    assert event["action"] == "warn" and event["round_index"] == 4 and event["detectors"]["non_finite"]["score"] == 1
    assert "guard: round 4 (step 1): non_finite" in caplog.text
    assert guard.rollbacks == 0 and guard.lr_scale == 1.0


def test_stop_raises_with_the_detector_and_the_way_out(tmp_path):
    guard, module = Guard(detectors={"non_finite": {"action": "stop"}}), Module()
    with pytest.raises(GuardStop, match=r"non_finite: .*guard\.enabled=false"):
        end_round(guard, trainer(tmp_path, rollout__sampled_reward_mean=float("inf")), module, 0)


def test_a_rollback_over_max_rollbacks_stops(tmp_path):
    guard, module = Guard(detectors={"non_finite": {}}, max_rollbacks=0), Module()
    with pytest.raises(GuardStop, match=r"guard\.max_rollbacks=0"):
        end_round(guard, trainer(tmp_path, rollout__sampled_reward_mean=float("nan")), module, 0)


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


def test_a_rollback_before_any_healthy_checkpoint_halves_the_rate_only(tmp_path):
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))  # warm-up 2
    scheduler.step()  # step 1: factor 2/3
    trainer_ = trainer(tmp_path, rollout__sampled_reward_mean=float("nan"))
    trainer_.lr_scheduler_configs = [SimpleNamespace(scheduler=scheduler)]
    guard, module = Guard(detectors={"non_finite": {}}), Module()
    module.trainer, module.optim_cfg = trainer_, SimpleNamespace(lr=1e-3)
    end_round(guard, trainer_, module, 0)
    assert guard.events[0].action == "backoff" and guard.rollbacks == 0 and guard.lr_scale == 0.5
    assert scheduler.base_lrs == [5e-4] and optimizer.param_groups[0]["lr"] == pytest.approx(5e-4 * 2 / 3)
    assert guard.last_fire_step == 1  # a checkpoint saved before this round is no rollback target


def test_a_warning_does_not_stop_a_checkpoint_from_becoming_healthy(tmp_path):
    guard = Guard(detectors={"non_finite": {"action": "warn"}})
    end_round(guard, trainer(tmp_path, rollout__sampled_reward_mean=float("nan")), Module(), 0)
    assert guard.events[0].action == "warn" and guard.last_fire_step == -1


def test_a_suspect_round_keeps_the_checkpoint_that_sampled_it_from_becoming_healthy(tmp_path):
    from dspo.callbacks.checkpoints import RoundCheckpoint

    checkpoint, removed = RoundCheckpoint(str(tmp_path), keep_last=-1), []
    trainer_ = trainer(tmp_path, rollout__sampled_reward_mean=0.8)
    trainer_.callbacks = [checkpoint]
    trainer_.strategy = SimpleNamespace(barrier=lambda name=None: None, remove_checkpoint=removed.append)
    guard = Guard(detectors={"reward_drop": {"drop": 0.5, "warmup": 0}})  # alpha 0.3, patience 3
    paths = [str(tmp_path / f"step{i:05d}.ckpt") for i in range(4)]
    for round_index, reward in enumerate([0.8, 0.1, 0.8]):
        checkpoint.newest = (round_index + 1, paths[round_index + 1])  # saved after the previous round
        trainer_.callback_metrics["rollout/sampled_reward_mean"] = torch.tensor(reward)
        end_round(guard, trainer_, Module(), round_index)
        if round_index == 1:  # 0.1 < 0.8 x 0.5: suspect (the EMA, 0.59, is 26 % below: no firing yet)
            assert guard.healthy == paths[1] and not guard.events
    assert guard.healthy == paths[3] and removed == [paths[1]]  # EMA 0.65, round 0.8: healthy again


def test_a_drop_at_the_last_validation_ends_the_run_on_the_healthy_checkpoint(tmp_path, monkeypatch):
    """No round follows the last validation, so val_drop acts there: the healthy weights are restored (even past
    max_rollbacks) and last.ckpt is written again; a validation before the end only records the value."""
    import dspo.guard.callback as callback

    restored, saved = [], []
    monkeypatch.setattr(callback, "restore", lambda trainer, module, path, scale: restored.append((path, scale)))
    trainer_ = trainer(tmp_path, val__subem_mean=0.4)
    trainer_.max_steps, trainer_.global_step = 20, 10
    trainer_.callbacks = [callback.RoundCheckpoint(str(tmp_path))]
    trainer_.callbacks[0].last_model_path = str(tmp_path / "last.ckpt")
    trainer_.save_checkpoint = lambda path, weights_only=None: saved.append(path) if weights_only is False else None
    guard, module = Guard(detectors={"val_drop": {}}, max_rollbacks=0), Module()
    guard.healthy = str(tmp_path / "step00016.ckpt")
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
    guard.healthy = str(tmp_path / "step00016.ckpt")
    guard.on_validation_end(trainer_, Module())  # 0.05 below: within the margin
    assert not guard.events and not (tmp_path / "guard.jsonl").exists()


def test_a_new_best_validation_keeps_the_checkpoint_it_validated_and_val_drop_rolls_back_to_it(tmp_path, monkeypatch):
    """The round checkpoint saved at a validation's step holds the validated weights: kept as `best` when the
    validation is the best so far; a later val_drop restores it rather than the newest healthy checkpoint (which a
    slow decline can already have reached), at the end of the run as mid-run; other detectors go to healthy."""
    import dspo.guard.callback as callback

    restored = []
    monkeypatch.setattr(callback, "restore", lambda trainer, module, path, scale: restored.append(path))
    checkpoint, removed = callback.RoundCheckpoint(str(tmp_path), keep_last=1), []
    trainer_ = trainer(tmp_path, val__subem_mean=0.4)
    trainer_.callbacks, trainer_.max_steps = [checkpoint], 100
    trainer_.strategy = SimpleNamespace(barrier=lambda name=None: None, remove_checkpoint=removed.append)
    guard, module = Guard(detectors={"val_drop": {}, "non_finite": {}}), Module()
    module.trainer, module.optim_cfg = trainer_, SimpleNamespace(lr=1e-3)
    monkeypatch.setattr(callback, "set_lr_scale", lambda *args: None)
    saved = []
    trainer_.save_checkpoint = lambda path, weights_only=None: saved.append(path) if weights_only is False else None
    for step, value in ((0, 0.4), (4, 0.6), (8, 0.55), (12, 0.45)):
        trainer_.global_step = step
        checkpoint.newest = (step, str(tmp_path / f"step{step:05d}.ckpt")) if step else None
        trainer_.callback_metrics["val/subem_mean"] = torch.tensor(value)
        guard.on_validation_end(trainer_, module)
        if step == 0:  # the start's weights: no round checkpoint holds them, so the guard writes them
            assert saved == [str(tmp_path / "start.ckpt")] and guard.best == saved[0]
        if step < 12:
            end_round(guard, trainer_, module, step)  # the round after a validation reads it (and promotes)
    assert guard.best == str(tmp_path / "step00004.ckpt") and guard.best_validation == pytest.approx(0.6)
    assert checkpoint.kept["best"] == guard.best and not restored and removed == [str(tmp_path / "start.ckpt")]
    guard.healthy = str(tmp_path / "step00012.ckpt")  # a slow decline: the newest healthy one is already low
    end_round(guard, trainer_, module, 13)  # reads the step-12 validation: 0.15 below the best
    assert restored == [guard.best] and guard.events[-1].restored_from == guard.best
    trainer_.callback_metrics["rollout/sampled_reward_mean"] = torch.tensor(float("nan"))
    end_round(guard, trainer_, module, 7)  # non_finite: the newest healthy checkpoint
    assert restored[-1] == guard.healthy
    state = guard.state_dict()
    again = Guard(detectors={"val_drop": {}, "non_finite": {}})
    again.load_state_dict(state)
    assert (again.best, again.best_validation) == (guard.best, guard.best_validation)


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
    trainer_ = trainer(tmp_path, val__subem_mean=0.9)
    trainer_.callbacks = [callback_checkpoint(tmp_path)]
    trainer_.max_steps, trainer_.global_step, trainer_.save_checkpoint = 20, 0, lambda path, weights_only=None: None
    guard.on_validation_end(trainer_, Module())
    assert (guard.best is not None) is steady  # no best target either: it would be chosen by an easier validation


def callback_checkpoint(tmp_path):
    from dspo.callbacks.checkpoints import RoundCheckpoint

    return RoundCheckpoint(str(tmp_path))
