"""`status.json` while a run trains (dspo.sweeps.status reads it: the sweep's per-job console lines, `dspo-sweep`),
and the run's command-line overrides as a TensorBoard text entry, so `tensorboard --logdir SWEEP_DIR` says which
settings each job's curves belong to."""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning.pytorch as pl

from dspo.sweeps.status import read_status, write_status


def hydra_job() -> tuple[int | None, list[str]]:
    """(job number in a sweep or None, command-line overrides) of this Hydra job; (None, []) outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None, []
    hydra = HydraConfig.get()
    num = hydra.job.get("num") if hydra.mode is not None and hydra.mode.name == "MULTIRUN" else None
    return (int(num) if num is not None else None), [str(o) for o in hydra.overrides.task]


class RunStatus(pl.Callback):
    """Writes `state: running, step, max_steps` to `run_dir/status.json` when training starts and at most every
    `every_s` seconds after (rank 0 only); dspo.train writes the end state (finished / preempted / failed)."""

    def __init__(self, run_dir: str, every_s: float = 2.0) -> None:
        self.run_dir, self.every_s = Path(run_dir), every_s
        self._written = 0.0

    def _write(self, trainer: pl.Trainer) -> None:
        job_num, _ = hydra_job()
        where = {
            "pid": os.getpid(),
            "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        }
        write_status(
            self.run_dir, "running", step=trainer.global_step, max_steps=trainer.max_steps, job_num=job_num, **where
        )
        self._written = time.monotonic()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self._write(trainer)
        _, overrides = hydra_job()
        for logger in trainer.loggers:  # the text tab of TensorBoard: one entry per job of a sweep
            if hasattr(getattr(logger, "experiment", None), "add_text"):
                logger.experiment.add_text("run/overrides", " ".join(overrides) or "(none)", trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero and time.monotonic() - self._written >= self.every_s:
            self._write(trainer)


def record_job_memory(run_dir: str | Path, **gib: float | None) -> None:
    """Add the job's resident memory (`rss_start_gib`, `rss_peak_gib`, in GiB; None: not measured) to the `status.json`
    its end wrote (rank 0 only; nothing without one, e.g. a command refused before it started): `dspo-sweep`
    shows each job's peak, and a sweep whose `rss_start_gib` grows from job to job keeps what its jobs leave."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    status = read_status(run_dir)
    if status is None or getattr(rank_zero_only, "rank", 0) != 0:
        return
    kept = {key: value for key, value in status.items() if key not in ("state", "updated")}
    measured = {key: round(value, 3) for key, value in gib.items() if value is not None}
    write_status(run_dir, str(status.get("state")), **kept, **measured)
