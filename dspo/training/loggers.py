"""Loggers of a run (`logger=tensorboard|csv|wandb|mlflow|none`, or several: `logger=[tensorboard,wandb]`).

Each option of conf/logger/ is one Lightning logger under its own name (`logger.<name>`), like the callbacks; every
logger gets the same scalars (the module and the callbacks log through Lightning, validation through every logger in
`trainer.loggers`) and the same hyperparameters: the run's composed config, every interpolation resolved, logged once
when fitting starts (`LogRunConfig`). Lightning's own logging of the module's hyperparameters (model, algorithm and
optimizer only, and again at `trainer.test`) is turned off by `dspo.train.build`; the checkpoints keep them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf


def build_loggers(node: Any) -> list[Any]:
    """The loggers of a `logger` config: named constructor calls (`{tensorboard: {_target_: ...}, ...}`), or one
    constructor call (a config written for dspo before loggers were named). Empty = no logger."""
    from hydra.utils import instantiate

    if not node:
        return []
    if "_target_" in node:
        return [instantiate(node)]
    return [instantiate(entry) for entry in node.values() if entry is not None]


def run_hyperparameters(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as plain containers, every interpolation resolved (what `.hydra/config.yaml` holds,
    with `${...}` replaced by the values the run used)."""
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]), resolve=True)


class LogRunConfig(pl.Callback):
    """Logs `config` as the hyperparameters of every logger, once per fit, before anything else is logged (so that
    TensorBoard's and the CSV logger's `hparams.yaml`, written at Lightning's first `save()`, hold it)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for logger in trainer.loggers:  # each logger's log_hyperparams writes on global rank 0 only
            logger.log_hyperparams(self.config)


def mlflow_logger(
    experiment_name: str = "dspo",
    run_name: str | None = None,
    tracking_uri: str | None = None,
    save_dir: str = "mlruns",
    **kwargs: Any,
) -> Any:
    """Lightning's `MLFlowLogger`. Without `tracking_uri` (a server, a database) runs go to a local folder store in
    `save_dir`. MLflow 3 refuses folder stores (`file:` URIs) unless MLFLOW_ALLOW_FILE_STORE is set, as they are in
    maintenance mode; it is set for this process here, where the config asked for a folder."""
    from lightning.pytorch.loggers import MLFlowLogger

    if not tracking_uri or tracking_uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MLFlowLogger(
        experiment_name=experiment_name, run_name=run_name, tracking_uri=tracking_uri, save_dir=save_dir, **kwargs
    )


def describe(logger: Any) -> str:
    """One line saying where a logger's records are (for dspo-train's closing summary)."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    if isinstance(logger, TensorBoardLogger):
        return f"TensorBoard   : tensorboard --logdir {logger.log_dir}"
    if isinstance(logger, CSVLogger):
        return f"CSV           : {Path(logger.log_dir) / 'metrics.csv'}"
    if isinstance(logger, WandbLogger):
        run = logger.experiment
        where = f"offline, upload with: wandb sync {Path(run.dir).parent}" if run.offline else run.url
        return f"W&B           : {where}"
    if isinstance(logger, MLFlowLogger):
        where = logger.save_dir or os.environ.get("MLFLOW_TRACKING_URI", "the tracking server")
        return f"MLflow        : run {logger.run_id} ({where})"
    return f"{type(logger).__name__:<14}: {getattr(logger, 'log_dir', None) or getattr(logger, 'save_dir', '')}"
