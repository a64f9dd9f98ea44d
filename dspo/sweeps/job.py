"""A run as one job of a sweep: its `status.json` at the end (finished, preempted, failed with its error line), the
mean over `trial_seeds` that scores a search trial, and whether this process is a Hydra multirun job. `dspo.train`
calls these; `dspo.sweeps.status` reads what they write (console lines, the report, resuming a sweep)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from dspo.sweeps.status import read_status, write_status

log = logging.getLogger("dspo.train")


class RunPreempted(RuntimeError):
    """A sweep's job stopped by a preemption signal after saving `last.ckpt`: raised so that the sweeper does not take
    the job's partial metric as its result (Hydra marks the job failed; Optuna does not score the trial; the local
    launcher prints `preempted`). The job's `status.json` says `preempted`; run the sweep again to resume it."""


def mean_over_seeds(cfg: DictConfig, run: Callable[[DictConfig], float | None]) -> float | None:
    """One run per seed of `trial_seeds`, each in `<output_dir>/seed<k>/`, one after another; returns the mean of
    their sweep metrics (runs that returned none left out; None if all did), so that a search trial is scored by
    several seeds rather than by one seed's luck (`run`: dspo.train.train). The job's own `status.json` gets the
    mean and each seed's value."""
    seeds = [int(seed) for seed in cfg.trial_seeds]
    values: dict[int, float | None] = {}
    for seed in seeds:
        one = copy.deepcopy(cfg)
        with open_dict(one):
            one.seed, one.trial_seeds = seed, None
            one.output_dir = str(Path(str(cfg.output_dir)) / f"seed{seed}")
        try:
            values[seed] = run(one)
        except RunPreempted:  # the requeued job resumes this seed
            write_end(cfg, "preempted", error=f"seed {seed} preempted")
            raise
        except BaseException as error:
            write_end(cfg, "failed", error=f"seed {seed}: {error_line(error)}")
            raise
        if (read_status(one.output_dir) or {}).get("state") == "preempted":  # outside a sweep: no exception
            write_end(cfg, "preempted", error=f"seed {seed} preempted")
            return None
    scored = [v for v in values.values() if v is not None]
    mean = sum(scored) / len(scored) if scored else None
    log.info("trial_seeds %s: %s = %s (mean of %s)", seeds, cfg.sweep_metric, mean, values)
    write_end(cfg, "finished", metric=mean, seed_metrics={str(k): v for k, v in values.items()})
    return mean


def error_line(error: BaseException) -> str:
    """The exception's type and last line: what the console line and the report name a failed job by."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1].strip()}" if lines else type(error).__name__


def write_end(cfg: DictConfig, state: str, **fields: Any) -> None:
    """`status.json` of the run (dspo.sweeps.status), from global rank 0 only; never hides the run's own outcome."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) != 0:
        return
    try:
        run_dir = Path(str(cfg.output_dir))
        if in_sweep():  # the local launcher's console line finds the job by it (dspo.sweeps.launchers.JobLines)
            fields.setdefault("job_num", hydra_job_config().get("num"))
        if (
            run_dir.is_dir()
        ):  # a command refused before it started removed its folder (dspo.runs.resume.discard): keep it so
            write_status(run_dir, state, **fields)
    except Exception as error:  # e.g. output_dir unresolvable outside Hydra: the run's outcome matters more
        log.warning("could not write status.json (%s)", error)


def hydra_job_config() -> Any:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().job if HydraConfig.initialized() else None


def in_sweep() -> bool:
    """True in a job of a Hydra multirun (a sweep), whatever its launcher."""
    from hydra.core.hydra_config import HydraConfig

    mode = HydraConfig.get().mode if HydraConfig.initialized() else None
    return mode is not None and mode.name == "MULTIRUN"
