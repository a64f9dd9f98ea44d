"""Issue 32 (3): which checkpoint `ckpt_path=last` resumes, and what it refuses (fast; the end-to-end resume is in
tests/test_train.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dspo.runs.checkpoint_files import atomic_torch_save
from dspo.runs.resume import config_differences, discard, move_into_run, resolve_ckpt_path

BASE = {
    "seed": 0,
    "run_name": "dspo_seed0",
    "trainer": {"max_steps": 4},
    "retriever": {"_target_": "bm25", "index": "${paths.cache}/i"},
}


def _run(outputs: Path, name: str, step: int, config: dict) -> Path:
    run = outputs / "train" / name
    atomic_torch_save({"global_step": step}, run / "checkpoints" / "last.ckpt")
    (run / ".hydra").mkdir()
    config = {**config, "paths": {"outputs": str(outputs), "cache": "/c"}}
    OmegaConf.save(OmegaConf.create(config), run / ".hydra" / "config.yaml")
    return run


def _cfg(outputs: Path, **overrides) -> OmegaConf:
    values = {**BASE, "ckpt_path": "last", "output_dir": str(outputs / "new")}
    values["paths"] = {"outputs": str(outputs), "cache": "/c"}
    return OmegaConf.create({**values, **overrides})


def test_runs_sharing_a_name_with_other_settings_are_refused_with_the_alternatives(tmp_path) -> None:
    first = _run(tmp_path, "dspo_seed0_20260101-000000", 4, BASE)
    other = {**BASE, "retriever": {"_target_": "my_retriever.TitleMatchReranker", "index": "${paths.cache}/i"}}
    second = _run(tmp_path, "dspo_seed0_20260102-000000", 4, other)
    with pytest.raises(ValueError, match="2 runs are named run_name=dspo_seed0 and their settings differ") as error:
        resolve_ckpt_path(_cfg(tmp_path, trainer={"max_steps": 8}))
    message = str(error.value)
    assert str(first) in message and str(second) in message and "retriever._target_" in message
    assert f"ckpt_path={second / 'checkpoints' / 'last.ckpt'}" in message


def test_runs_that_differ_only_in_max_steps_resume_the_newest_and_say_so(tmp_path, caplog) -> None:
    _run(tmp_path, "dspo_seed0_20260101-000000", 4, BASE)
    newest = _run(tmp_path, "dspo_seed0_20260102-000000", 6, {**BASE, "trainer": {"max_steps": 6}})
    cfg = _cfg(tmp_path, trainer={"max_steps": 8}, optimizer={"lr": 1e-5})
    with caplog.at_level(logging.INFO, logger="dspo.train"):
        assert resolve_ckpt_path(cfg) == str(newest / "checkpoints" / "last.ckpt")
    assert f"resuming run {newest} from last.ckpt (step 6)" in caplog.text
    assert "differ from the run's own (1 key(s)): optimizer.lr: '<unset>' -> 1e-05" in caplog.text  # allowed, said
    assert cfg.output_dir == str(newest)


def test_nothing_to_train_is_refused_before_anything_is_written(tmp_path) -> None:
    run = _run(tmp_path, "dspo_seed0_20260101-000000", 6, BASE)
    for max_steps in (4, 6):
        with pytest.raises(ValueError, match=f"is at step 6 and trainer.max_steps={max_steps}, so nothing would be"):
            resolve_ckpt_path(_cfg(tmp_path, trainer={"max_steps": max_steps}))
    with pytest.raises(ValueError, match="trainer.max_steps=12 \\(any value above 6\\)"):
        resolve_ckpt_path(_cfg(tmp_path, ckpt_path=str(run / "checkpoints" / "last.ckpt"), trainer={"max_steps": 6}))


def test_config_differences_ignore_what_does_not_change_training() -> None:
    a = {**BASE, "run_test": True, "ckpt_path": None, "hydra": {"run": {"dir": "x"}}}
    b = {**BASE, "trainer": {"max_steps": 100}, "run_test": False, "ckpt_path": "last", "hydra": {"run": {"dir": "y"}}}
    assert config_differences(OmegaConf.create(a), OmegaConf.create(b)) == []
    c = {**BASE, "seed": 1}
    assert config_differences(OmegaConf.create(a), OmegaConf.create(c)) == ["seed: 0 -> 1"]


def test_the_fresh_hydra_folder_moves_into_the_resumed_run(tmp_path) -> None:
    run = _run(tmp_path, "dspo_seed0_20260101-000000", 4, BASE)
    fresh = tmp_path / "train" / "dspo_seed0_20260102-101010"
    (fresh / ".hydra").mkdir(parents=True)
    (fresh / ".hydra" / "overrides.yaml").write_text("- ckpt_path=last\n")
    handler = logging.FileHandler(fresh / "train.log")
    logger = logging.getLogger("dspo.test_resume")
    logger.addHandler(handler)
    try:
        logger.warning("before the move")
        move_into_run(fresh, run)
        logger.warning("after the move")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert not fresh.exists()
    assert (run / ".hydra" / "resume-20260102-101010" / "overrides.yaml").read_text() == "- ckpt_path=last\n"
    assert (run / "train.log").read_text().splitlines() == ["before the move", "after the move"]


def test_only_folders_holding_nothing_but_hydra_files_are_removed(tmp_path) -> None:
    kept = tmp_path / "kept"
    (kept / "checkpoints").mkdir(parents=True)
    discard(kept)
    assert kept.is_dir()
    empty = tmp_path / "empty"
    (empty / ".hydra").mkdir(parents=True)
    (empty / "train.log").write_text("")
    discard(empty)
    assert not empty.exists()


def test_output_dir_may_name_a_folder_that_does_not_exist_yet(tmp_path) -> None:
    """`dspo-train output_dir=NEW`: the fresh Hydra folder moves into NEW, which is created (it crashed with
    FileNotFoundError on the log file before)."""
    fresh = tmp_path / "train" / "fresh"
    (fresh / ".hydra").mkdir(parents=True)
    handler = logging.FileHandler(fresh / "train.log")
    logger = logging.getLogger("dspo.test_resume.new")
    logger.addHandler(handler)
    try:
        logger.warning("hello")
        move_into_run(fresh, tmp_path / "study" / "run")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert (tmp_path / "study" / "run" / "train.log").read_text().splitlines() == ["hello"]


def test_a_run_written_before_the_package_split_resumes_without_a_changed_settings_warning(caplog) -> None:
    """`.hydra/config.yaml` of a 4-step toy run written by dspo before its modules moved into folders (issue 71): its
    `_target_`s (dspo.module.DSPOModule, dspo.module.OptimizerConfig, dspo.checkpointing.AtomicCheckpointIO) read as
    today's, so resuming it with its own overrides warns of no changed setting but the key added since."""
    import yaml

    from dspo.runs.resume import _warn_changed_settings, config_differences, run_config
    from dspo.testing import compose_config

    run_dir = Path(__file__).parent / "fixtures" / "run_before_the_split"
    raw = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "_target_: dspo.module.DSPOModule" in raw and "dspo.checkpointing.AtomicCheckpointIO" in raw
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    today = compose_config("train", overrides)
    assert config_differences(run_config(run_dir), today) == ["callbacks.preemption.slurm_requeue: '<unset>' -> True"]
    with caplog.at_level("WARNING", logger="dspo.train"):
        _warn_changed_settings(today, run_dir)
    assert "(1 key(s))" in caplog.text and "_target_" not in caplog.text
