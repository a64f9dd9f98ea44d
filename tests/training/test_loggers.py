"""Loggers (`logger=tensorboard|csv|wandb|mlflow|none`, or a list): each config composes and instantiates, and one
short run with all four gives each the same scalar names and the run's resolved config as its hyperparameters."""

from __future__ import annotations

import csv
import json
import os
import struct
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

from dspo.sweeps.analysis import find_runs, load_scalars
from dspo.train import CONF_DIR
from dspo.training.loggers import build_loggers, run_hyperparameters

LOGGERS = {
    "tensorboard": "TensorBoardLogger",
    "csv": "CSVLogger",
    "wandb": "WandbLogger",
    "mlflow": "MLFlowLogger",
}


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)  # ${hydra:...} and ${now:...} resolve as under dspo-train
        return cfg


@pytest.mark.parametrize("name", sorted(LOGGERS))
def test_each_logger_config_composes_and_instantiates(name, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = _compose([f"logger={name}", f"output_dir={tmp_path}", f"paths.outputs={tmp_path}"])
    (logger,) = build_loggers(cfg.logger)
    assert type(logger).__name__ == LOGGERS[name]
    assert str(tmp_path) in str(logger.save_dir)  # everything it writes goes under the run (mlflow: the outputs)


def test_none_several_and_an_unnamed_logger_config(tmp_path):
    assert build_loggers(_compose(["logger=none", f"output_dir={tmp_path}"]).logger) == []
    both = build_loggers(_compose(["logger=[tensorboard,csv]", f"output_dir={tmp_path}"]).logger)
    assert [type(logger).__name__ for logger in both] == ["TensorBoardLogger", "CSVLogger"]
    # a user's config written as one constructor call (no name) still works
    (single,) = build_loggers({"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(tmp_path)})
    assert type(single).__name__ == "CSVLogger"


def test_the_logged_config_is_resolved_and_leaves_hydra_out(tmp_path):
    cfg = _compose([f"output_dir={tmp_path}", "trainer.max_steps=7"])
    config = run_hyperparameters(cfg)
    assert "hydra" not in config and config["trainer"]["max_steps"] == 7
    assert config["module"]["optimizer"]["lr"] == config["optimizer"]["lr"]  # interpolations resolved
    assert config["logger"]["tensorboard"]["save_dir"] == str(tmp_path)
    json.dumps(config)  # plain containers only


# ------------------------------------------------------------------------------------------ readers of each store
def wandb_records(path: Path):
    """The records of a W&B run's transaction log (`run-<id>.wandb`): a 7-byte header, then LevelDB-style log records
    (4-byte checksum, 2-byte length, 1-byte type) in 32 KiB blocks, each payload a `Record` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0:
            break
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of a record split over blocks
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def wandb_scalars_and_config(run_dir: Path) -> tuple[set[str], dict]:
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    names, config = set(), {}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            names |= {item.key or "/".join(item.nested_key) for item in record.history.item}
        items = record.config.update if kind == "config" else record.run.config.update if kind == "run" else []
        config.update({item.key: json.loads(item.value_json) for item in items})
    own = {"_step", "_runtime", "_timestamp", "trainer/global_step"}  # W&B's bookkeeping and Lightning's x axis
    config.pop("_wandb", None)
    return names - own, config


def mlflow_scalars_and_params(store: Path) -> tuple[set[str], dict]:
    from mlflow.tracking import MlflowClient

    # MLflow 3 reads folder stores only with this set (dspo.training.loggers sets it for training; a reader needs it
    # too)
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{store}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "dspo"]
    (run,) = client.search_runs([experiment.experiment_id])
    return set(run.data.metrics), dict(run.data.params)


def csv_scalars(run_dir: Path) -> tuple[set[str], dict]:
    (metrics,) = run_dir.glob("csv/*/metrics.csv")
    with open(metrics, newline="") as file:
        header = next(csv.reader(file))
    hparams = yaml.safe_load((metrics.parent / "hparams.yaml").read_text())
    return set(header) - {"step"}, hparams


@pytest.mark.slow
def test_every_logger_gets_the_same_scalars_and_the_resolved_config(run_train, short_default_hf, tmp_path):
    from lightning.fabric.utilities.logger import _flatten_dict

    outputs, store = tmp_path / "outputs", tmp_path / "mlruns"
    loggers = [
        "logger=[tensorboard,csv,wandb,mlflow]",
        "logger.wandb.offline=true",
        f"logger.mlflow.tracking_uri=file:{store}",
    ]
    args = [
        *short_default_hf,
        "trainer.max_steps=2",
        "data.val_limit=4",
        "data.test_limit=4",
        "run_name=loggers",
        *loggers,
    ]
    result = run_train(args, outputs)
    (run,) = find_runs(outputs / "train")
    tensorboard = set(load_scalars(run.dir).tag)
    written = {"csv": csv_scalars(run.dir), "wandb": wandb_scalars_and_config(run.dir)}
    mlflow_names, mlflow_params = mlflow_scalars_and_params(store)
    for name, names in [("csv", written["csv"][0]), ("wandb", written["wandb"][0]), ("mlflow", mlflow_names)]:
        assert names == tensorboard, (
            f"{name}: missing {sorted(tensorboard - names)}, extra {sorted(names - tensorboard)}"
        )
    for tag in [
        "train/loss",
        "loss/clipfrac",
        "rollout/keep_rate",
        "mismatch/kl_k3",
        "val/subem_mean",
        "test/subem_mean",
    ]:
        assert tag in tensorboard, sorted(tensorboard)
    # the hyperparameters: the whole composed config, resolved, in every logger (not the module's model/algorithm/
    # optimizer alone, which Lightning logs by default: its `model` has no `_target_`)
    config = yaml.safe_load((run.dir / "tb" / "hparams.yaml").read_text())
    assert config["model"]["_target_"] and config["trainer"]["max_steps"] == 2 and config["run_name"] == "loggers"
    assert config["output_dir"] == str(run.dir) and "hydra" not in config
    assert written["csv"][1] == config and written["wandb"][1] == config
    assert mlflow_params == {key: str(value)[:250] for key, value in _flatten_dict(config).items()}
    for where in ["TensorBoard   : ", "CSV           : ", "W&B           : offline", "MLflow        : run "]:
        assert where in result.stdout, result.stdout[-2000:]
