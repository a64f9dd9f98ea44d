"""Fast tests of dspo.train's helpers (the end-to-end runs are in test_train.py)."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dspo.runs.checkpoint_files import atomic_torch_save
from dspo.runs.resume import resolve_ckpt_path
from dspo.train import fit_or_checkpoint


class FailingTrainer:
    def __init__(self, root: Path, global_step: int) -> None:
        self.default_root_dir, self.global_step, self.saved = str(root), global_step, []

    def fit(self, *args, **kwargs):
        raise ConnectionError("retrieval service http://127.0.0.1:9/retrieve unreachable after 3 retries")

    def save_checkpoint(self, path: str, weights_only: bool | None = None) -> None:
        self.saved.append(path)


def test_failure_saves_a_checkpoint_then_reraises(tmp_path):
    trainer = FailingTrainer(tmp_path, global_step=3)
    with pytest.raises(ConnectionError, match="unreachable"):
        fit_or_checkpoint(trainer, None, None, None)
    assert trainer.saved == [str(tmp_path / "checkpoints" / "failure.ckpt")]
    fresh = FailingTrainer(tmp_path, global_step=0)  # nothing trained yet: nothing to save
    with pytest.raises(ConnectionError):
        fit_or_checkpoint(fresh, None, None, None)
    assert fresh.saved == []


def test_resolve_ckpt_path_last_picks_newest_run_and_moves_output_dir(tmp_path):
    for name in ("dspo_seed0_20260101-000000", "dspo_seed0_20260102-000000", "gspo_seed0_20260103-000000"):
        (tmp_path / "train" / name / "checkpoints").mkdir(parents=True)
        atomic_torch_save({"global_step": 1}, tmp_path / "train" / name / "checkpoints" / "last.ckpt")
    older = tmp_path / "train" / "dspo_seed0_20260101-000000" / "checkpoints" / "last.ckpt"
    import os

    os.utime(older, (1, 1))
    cfg = OmegaConf.create(
        {"ckpt_path": "last", "run_name": "dspo_seed0", "paths": {"outputs": str(tmp_path)}, "output_dir": "/new"}
    )
    path = resolve_ckpt_path(cfg)
    assert path.endswith("dspo_seed0_20260102-000000/checkpoints/last.ckpt")
    assert cfg.output_dir == str(Path(path).parents[1])
    missing = OmegaConf.create(
        {"ckpt_path": "last", "run_name": "x", "paths": {"outputs": str(tmp_path)}, "output_dir": "/n"}
    )
    with pytest.raises(FileNotFoundError, match="run_name"):
        resolve_ckpt_path(missing)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        resolve_ckpt_path(OmegaConf.create({"ckpt_path": str(tmp_path / "nope.ckpt")}))


def test_resolve_ckpt_path_last_skips_a_truncated_last_ckpt(tmp_path, caplog):
    folder = tmp_path / "train" / "dspo_seed0_20260101-000000" / "checkpoints"
    for name in ("step00004.ckpt", "last.ckpt", "failure.ckpt"):
        atomic_torch_save({"global_step": 4}, folder / name)
    last = folder / "last.ckpt"
    last.write_bytes(last.read_bytes()[:-10])
    cfg = OmegaConf.create(
        {"ckpt_path": "last", "run_name": "dspo_seed0", "paths": {"outputs": str(tmp_path)}, "output_dir": "/new"}
    )
    with caplog.at_level("WARNING"):
        assert resolve_ckpt_path(cfg) == str(folder / "step00004.ckpt")  # never failure.ckpt, though it is newer
    assert f"skipping {last}" in caplog.text and "truncated?" in caplog.text
    (folder / "step00004.ckpt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="none of the 2 checkpoints"):
        resolve_ckpt_path(cfg)


def test_resolve_ckpt_path_auto_starts_fresh_or_resumes(tmp_path):
    """`ckpt_path=auto` (a requeued job's command line): nothing yet -> a new run; later -> resume like `last`."""

    def cfg():
        return OmegaConf.create(
            {"ckpt_path": "auto", "run_name": "dspo_seed0", "paths": {"outputs": str(tmp_path)}, "output_dir": "/new"}
        )

    fresh = cfg()
    assert resolve_ckpt_path(fresh) is None and fresh.output_dir == "/new"
    folder = tmp_path / "train" / "dspo_seed0_20260101-000000" / "checkpoints"
    atomic_torch_save({"global_step": 2}, folder / "last.ckpt")
    atomic_torch_save({"global_step": 2}, folder / "failure.ckpt")
    resumed = cfg()
    assert resolve_ckpt_path(resumed) == str(folder / "last.ckpt") and resumed.output_dir == str(folder.parent)
    (folder / "last.ckpt").write_bytes(b"")  # present but unloadable: auto does not silently start over
    with pytest.raises(FileNotFoundError, match="can be loaded"):
        resolve_ckpt_path(cfg())


def test_validation_interval_must_fall_on_round_boundaries():
    from omegaconf import OmegaConf

    from dspo.train import check_round_alignment

    check_round_alignment(
        OmegaConf.create({"algorithm": {"num_minibatches": 2}, "trainer": {"val_check_interval": 20}})
    )
    check_round_alignment(
        OmegaConf.create({"algorithm": {"num_minibatches": 4}, "trainer": {"val_check_interval": 1.0}})
    )
    with pytest.raises(ValueError, match=r"val_check_interval=25 .*num_minibatches=2.*val_check_interval=24"):
        check_round_alignment(
            OmegaConf.create({"algorithm": {"num_minibatches": 2}, "trainer": {"val_check_interval": 25}})
        )


@pytest.mark.parametrize(
    ("trainer", "expected"),
    [
        ({"accelerator": "cpu", "devices": 1}, 1),
        ({"accelerator": "cpu", "devices": 2}, 2),  # trainer=ddp on CPU: two ranks share the cores
        ({"accelerator": "cpu", "devices": "auto"}, None),  # not known here: the environment variables decide
        ({"accelerator": "gpu", "devices": 2}, None),  # processes follow GPUs, not cores
        ({"accelerator": "cpu", "devices": True}, None),
        ({}, None),
    ],
)
def test_local_processes_come_from_a_cpu_trainer_config(trainer, expected):
    from dspo.train import local_processes

    assert local_processes(OmegaConf.create({"trainer": trainer})) == expected


def test_train_runs_inside_the_process_settings_and_leaves_them_on_failure(monkeypatch):
    """train() sets the allocator (CPU only), threads, VLLM_* defaults and warning filters for its own duration: a
    notebook that calls it, even when the run fails, gets its session back."""
    import contextlib

    import dspo.process.runtime
    import dspo.train

    events: list[tuple] = []

    @contextlib.contextmanager
    def settings(accelerator=None):
        events.append(("enter", accelerator))
        try:
            yield
        finally:
            events.append(("exit",))

    monkeypatch.setattr(dspo.process.runtime, "process_settings", settings)
    monkeypatch.setattr(
        dspo.process.runtime,
        "configure_threads",
        lambda local_processes=None: events.append(("threads", local_processes)),
    )

    def stop(names):
        events.append(("imports",))
        raise RuntimeError("stop here")

    monkeypatch.setattr(dspo.train, "import_modules", stop)
    cfg = OmegaConf.create({"trainer": {"accelerator": "cpu", "devices": 2}, "imports": None})
    with pytest.raises(RuntimeError, match="stop here"):
        dspo.train.train(cfg)
    assert events == [("enter", "cpu"), ("threads", 2), ("imports",), ("exit",)]


def _stand_in_run(monkeypatch, run):
    """`dspo.train.train` with `_train` replaced by `run` and torch's thread count left alone (process-wide)."""
    import dspo.train as train_module

    monkeypatch.setattr("dspo.process.runtime.configure_threads", lambda **kwargs: 1)
    monkeypatch.setattr(train_module, "_train", run)
    return train_module


def test_a_run_that_fails_writes_failed_and_the_error_line_to_its_status(tmp_path, monkeypatch) -> None:
    """What the sweep's console line and `dspo-report` name for a failed job (dspo.sweeps.status)."""
    from dspo.sweeps.status import read_status

    train_module = _stand_in_run(monkeypatch, lambda cfg: train_module.check_round_alignment(cfg))
    cfg = OmegaConf.create(
        {"trainer": {"accelerator": "cpu", "val_check_interval": 3}, "algorithm": {"num_minibatches": 2}}
    )
    cfg.output_dir = str(tmp_path)
    with pytest.raises(ValueError, match="val_check_interval=3"):
        train_module.train(cfg)
    status = read_status(tmp_path)
    assert status["state"] == "failed" and status["error"].startswith("ValueError: trainer.val_check_interval=3 is")
    gone = OmegaConf.create({**OmegaConf.to_container(cfg), "output_dir": str(tmp_path / "removed")})
    with pytest.raises(ValueError):
        train_module.train(gone)
    assert not (tmp_path / "removed").exists()  # a refused command's folder is not brought back by its status


def test_trial_seeds_train_one_run_per_seed_in_its_own_folder_and_return_the_mean(tmp_path, monkeypatch) -> None:
    from dspo.sweeps.status import read_status

    seen = []

    def run(cfg):
        seen.append((cfg.seed, cfg.run_name, cfg.output_dir))
        return {0: 0.5, 1: 0.25, 2: None}[cfg.seed]

    train_module = _stand_in_run(monkeypatch, run)
    cfg = OmegaConf.create(
        {"seed": 9, "run_name": "dspo_seed${seed}", "trial_seeds": [0, 1, 2], "sweep_metric": "val/subem_mean"}
    )
    cfg.output_dir, cfg.trainer = str(tmp_path), {"accelerator": "cpu"}
    assert train_module.train(cfg) == pytest.approx(0.375)  # the seed that returned no metric is left out
    assert seen == [(s, f"dspo_seed{s}", str(tmp_path / f"seed{s}")) for s in (0, 1, 2)]
    status = read_status(tmp_path)
    assert status["state"] == "finished" and status["seed_metrics"] == {"0": 0.5, "1": 0.25, "2": None}


def test_a_resumed_sweep_does_not_run_a_job_that_finished_again(tmp_path, monkeypatch) -> None:
    """`ckpt_path=auto` in a sweep job (dspo's launchers add it): a job whose status.json says it finished as far as
    asked returns its stored metric without training; asked for more steps, or outside a sweep, it runs."""
    from dspo.sweeps.status import write_status

    ran = []
    train_module = _stand_in_run(monkeypatch, lambda cfg: ran.append(cfg.output_dir) or 0.1)
    monkeypatch.setattr("dspo.sweeps.job.in_sweep", lambda: True)
    write_status(tmp_path, "finished", step=4, max_steps=4, metric=0.5)
    cfg = OmegaConf.create({"ckpt_path": "auto", "sweep_metric": "val/subem_mean", "trainer": {"max_steps": 4}})
    cfg.output_dir = str(tmp_path)
    assert train_module.train(cfg) == 0.5 and ran == []
    cfg.trainer.max_steps = 8  # train further: resumed from its checkpoint, not skipped
    assert train_module.train(cfg) == 0.1 and ran == [str(tmp_path)]
    cfg.trainer.max_steps, cfg.ckpt_path = 4, None
    assert train_module.train(cfg) == 0.1
    monkeypatch.setattr("dspo.sweeps.job.in_sweep", lambda: False)
    cfg.ckpt_path = "auto"
    assert train_module.train(cfg) == 0.1 and len(ran) == 3


def test_trainer_without_checkpointing_leaves_out_every_callback_that_writes_one(caplog) -> None:
    """`+trainer.enable_checkpointing=false` with the default callbacks: Lightning refuses any `Checkpoint` callback
    then, so build() leaves them out (round, preemption, best), names them, and the Trainer accepts the rest."""
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import Checkpoint

    from dspo.train import CONF_DIR, _without_checkpoints

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["output_dir=/tmp/unused", "logger=none"])
    keys = ("checkpoint", "preemption", "best", "lr_monitor")
    callbacks = [instantiate(cfg.callbacks[key]) for key in keys]
    with caplog.at_level("INFO", logger="dspo.train"):
        kept = _without_checkpoints(callbacks)
    assert [type(c).__name__ for c in kept] == ["LearningRateMonitor"]
    assert "RoundCheckpoint, PreemptionCheckpoint, ModelCheckpoint left out" in caplog.text
    assert sum(isinstance(c, Checkpoint) for c in callbacks) == 3
    pl.Trainer(enable_checkpointing=False, callbacks=kept, logger=False, accelerator="cpu")
    with pytest.raises(Exception, match="enable_checkpointing=False"):
        pl.Trainer(enable_checkpointing=False, callbacks=callbacks, logger=False, accelerator="cpu")
