"""dspo.process.console: vLLM's logging config is written where only this user can, and the filters hide only dspo's
notices."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import warnings
from pathlib import Path

import pytest

from dspo.process import console

PLANTED = '{"version": 1, "filters": {"run": {"()": "os.system", "command": "touch /tmp/owned"}}}'


@pytest.fixture
def shared_tmp(monkeypatch, tmp_path) -> Path:
    """A fresh stand-in for /tmp and an environment in which dspo writes vLLM's logging config."""
    for name in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL", "DSPO_VERBOSE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _expected_text() -> str:
    return json.dumps(console._vllm_logging_config("WARNING"), indent=1)


def _written(monkeypatch) -> Path:
    """Run the config step; returns the file vLLM would load, after checking that it holds dspo's config."""
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    console._point_vllm_at_config()
    path = Path(os.environ["VLLM_LOGGING_CONFIG_PATH"])
    assert path.read_text() == _expected_text()
    info = os.lstat(path)
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
    return path


@pytest.mark.parametrize("how", ["file", "symlink"])
def test_a_file_planted_under_the_old_predictable_name_is_never_loaded(shared_tmp, monkeypatch, how):
    """Another user of a login node creates `/tmp/dspo-vllm-logging-<digest>.json` (or a symlink there) first; vLLM's
    dictConfig would call its "()" factories as this user. dspo must not point vLLM at it."""
    digest = hashlib.sha256(_expected_text().encode()).hexdigest()[:12]
    planted = shared_tmp / f"dspo-vllm-logging-{digest}.json"
    if how == "file":
        planted.write_text(PLANTED)
    else:
        (shared_tmp / "elsewhere.json").write_text(PLANTED)
        planted.symlink_to(shared_tmp / "elsewhere.json")
    path = _written(monkeypatch)
    assert path.resolve() != planted.resolve()
    assert path.parent == shared_tmp / f"dspo-{os.getuid()}"  # a per-user directory, only this user may enter
    assert stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700
    assert _written(monkeypatch) == path  # reused by the next process of this user (no file per process)


def test_a_per_user_directory_owned_by_someone_else_is_not_trusted(shared_tmp, monkeypatch):
    """The per-user directory's name is predictable too: when another user made it, dspo writes a fresh private
    file instead of reading or writing anything in there."""
    monkeypatch.setattr(os, "getuid", lambda: 4242)  # this test's files belong to uid 0 (or the tester): "another user"
    foreign = shared_tmp / "dspo-4242"
    foreign.mkdir(mode=0o700)
    digest = hashlib.sha256(_expected_text().encode()).hexdigest()[:12]
    (foreign / f"vllm-logging-{digest}.json").write_text(PLANTED)
    console._point_vllm_at_config()
    path = Path(os.environ["VLLM_LOGGING_CONFIG_PATH"])
    assert foreign not in path.parents and path.read_text() == _expected_text()
    assert not os.lstat(path).st_mode & 0o077


@pytest.mark.parametrize("how", ["symlinked_dir", "writable_dir"])
def test_a_per_user_directory_that_is_a_symlink_or_open_to_others_is_not_used(shared_tmp, monkeypatch, how):
    mine = shared_tmp / f"dspo-{os.getuid()}"
    decoy = shared_tmp / "decoy"
    decoy.mkdir()
    if how == "symlinked_dir":
        mine.symlink_to(decoy)
    else:
        mine.mkdir()
        os.chmod(mine, 0o777)  # others may swap files in it
    path = _written(monkeypatch)
    assert mine not in path.parents and decoy not in path.parents
    assert list(decoy.iterdir()) == []


def test_a_symlink_in_the_users_directory_is_replaced_not_followed(shared_tmp, monkeypatch):
    first = _written(monkeypatch)
    target = shared_tmp / "target.json"
    target.write_text(PLANTED)
    first.unlink()
    first.symlink_to(target)
    again = _written(monkeypatch)
    assert again == first and not again.is_symlink() and target.read_text() == PLANTED


def test_child_processes_keep_the_inherited_config_path(shared_tmp, monkeypatch):
    """DDP ranks re-run the entry point with the parent's environment: they load the file the parent wrote."""
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/parent/wrote/this.json")
    console._point_vllm_at_config()
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == "/parent/wrote/this.json"


# ------------------------------------------------------------------------------------------------ warning filters
def _sync_dist_advice(monkeypatch, names: list[str]) -> list[str]:
    """The metric names for which Lightning's own code warns "It is recommended to use `self.log(<name>, ...,
    sync_dist=True)`" after dspo's filters are installed: a validation that logs each name at epoch level without
    sync_dist, in a run Lightning believes distributed (as one with the in-process vLLM engine, or real DDP)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.trainer.connectors.logger_connector import result
    from lightning.pytorch.utilities.rank_zero import WarningCache

    monkeypatch.setattr(result, "_distributed_is_initialized", lambda: True)
    monkeypatch.setattr(result, "warning_cache", WarningCache())  # Lightning warns once per message and process

    class Logs(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def validation_step(self, batch, batch_idx):
            pass

        def on_validation_epoch_end(self) -> None:
            for name in names:
                self.log(name, torch.tensor(0.5))

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.install_warning_filters()
        trainer.validate(Logs(), torch.utils.data.DataLoader([torch.zeros(1)]), verbose=False)
    advice = [str(w.message) for w in seen if "sync_dist=True" in str(w.message)]
    return [name for name in names if any(f"self.log({name!r}" in text for text in advice)]


def test_sync_dist_advice_stays_for_user_metrics_and_goes_for_dspos_eval_metrics(monkeypatch):
    """dspo's eval metrics are torchmetrics, reduced across processes already; a user's epoch-level metric logged
    without sync_dist is a real mistake in a multi-process run, and Lightning's advice must reach the user."""
    monkeypatch.delenv("DSPO_VERBOSE", raising=False)
    dspo_names = ["val/toy_1hop/subem", "val/nq/em", "test/hotpotqa/f1", "val/subem_mean", "test/subem_mean"]
    user_names = ["my_epoch_metric", "val/my_accuracy", "train/loss_epoch", "val/nq/my_score"]
    assert _sync_dist_advice(monkeypatch, dspo_names + user_names) == user_names


def test_lightning_lines_print_once_under_a_root_handler() -> None:
    """Issue 32 (7): Lightning's `lightning` logger has its own console handler and propagates to the root logger,
    which Hydra gives one too: with a root handler, Lightning's goes (its lines print once, in Hydra's format)."""
    import logging

    import lightning  # noqa: F401  adds its console handler when imported

    from dspo.process.console import one_lightning_console

    root, lightning_logger = logging.getLogger(), logging.getLogger("lightning")
    saved = (list(root.handlers), list(lightning_logger.handlers))
    lightning_handler = logging.StreamHandler()
    try:
        root.handlers, lightning_logger.handlers = [], [lightning_handler]
        one_lightning_console()  # no root handler (a library user's script): Lightning's own stays
        assert lightning_logger.handlers == [lightning_handler]
        root.addHandler(logging.StreamHandler())
        one_lightning_console()
        assert lightning_logger.handlers == [] and lightning_logger.propagate
    finally:
        root.handlers, lightning_logger.handlers = saved


def test_vllm_notices_are_dropped_by_their_start_and_nothing_else_is() -> None:
    """The vLLM filter drops the listed notices (exact starts) and the kernel re-registration that every sweep job
    after the first logged 11 times (a pattern: the kernel's name varies), and keeps any other record,
    of vLLM or not."""

    def record(name: str, message: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord(name, logging.WARNING, __file__, 1, message, args, None)

    vllm = console.vllm_notice_filter()
    dropped = [
        record("vllm.triton_utils.dispatcher", "Kernel %s is already registered. Overwriting.", "vllm.v1.x.kernel"),
        record("vllm.config", "Enforce eager set, disabling torch.compile"),
    ]
    kept = [
        record("vllm.triton_utils.dispatcher", "Kernel %s failed to register", "vllm.v1.x.kernel"),
        record("vllm.engine", "the run said: Kernel a is already registered. Overwriting."),  # not at the start
        record("dspo.train", "Kernel %s is already registered. Overwriting.", "x"),  # not vLLM's
        record("vllm.engine", "out of memory"),
    ]
    assert [vllm.filter(r) for r in dropped] == [False, False]
    assert [vllm.filter(r) for r in kept] == [True] * 4
