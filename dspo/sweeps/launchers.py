"""Hydra launchers of dspo sweeps, on Hydra's submitit launcher (`hydra/launcher=local`, `hydra/launcher=slurm`).

Hydra accepts launcher classes from its `hydra_plugins` package only: the configs name
`hydra_plugins.dspo_launcher.dspo_launcher.{LocalLauncher,SlurmLauncher}`, thin subclasses of the ones here.

Both run each job through submitit as Hydra's own plugin does (a job is `run_job` of `dspo-train`'s task in a process
of its own) and add what a dspo sweep needs:

- **resume, not restart:** a job gets `ckpt_path=auto` unless its command line names a `ckpt_path`. In a sweep job
  `auto` looks in the job's own folder only (dspo.runs.resume), so a fresh job starts fresh, a requeued or rerun one
  continues from its `last.ckpt`, and a finished one is not run again (its `status.json`, dspo.sweeps.status).
- **local** (`LocalLauncher`): at most `parallel_jobs` jobs at once (default: one per core, never more jobs than
  cores), each pinned to its own share of this process's cores (CPU affinity, which dspo.process.runtime.thread_count
  turns into torch threads), so that jobs never oversubscribe the machine; one console line per job as its state changes
  (queued, running step N/M, finished, preempted, failed); a failed or preempted job does not stop the others, and the
  sweep fails at the end.
- **SLURM** (`SlurmLauncher`): submitit's job array (`conf/hydra/launcher/slurm.yaml` for the resources). The signal
  before the time limit is SIGUSR1, which dspo's preemption callback handles (save `last.ckpt` at the round's end,
  `scontrol requeue`): submitit's own SIGUSR2 handling is not used. A preempted job then waits to be killed by the
  requeue instead of returning, so submitit records no result for it and the requeued job writes the real one.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
except ImportError as error:  # pragma: no cover - the cluster extra is in dev
    raise ImportError(
        "hydra/launcher=local|slurm needs Hydra's submitit launcher: pip install -e '.[cluster]' (docs/sweeps.md)"
    ) from error

from dspo.sweeps.status import read_status

log = logging.getLogger(__name__)


def with_resume(overrides: list[str]) -> list[str]:
    """A job's overrides with `ckpt_path=auto` added, unless the command line chose a `ckpt_path` itself."""
    if any(o.lstrip("+~").split("=", 1)[0] == "ckpt_path" for o in overrides):
        return list(overrides)
    return [*overrides, "ckpt_path=auto"]


def core_slots(cores: list[int], parallel: int) -> list[list[int]]:
    """`cores` split into `parallel` disjoint, contiguous shares as even as possible (the first ones get the extra)."""
    if parallel < 1 or parallel > len(cores):
        raise ValueError(
            f"hydra.launcher.parallel_jobs={parallel}: use 1..{len(cores)} (the cores this process may use)"
        )
    size, extra = divmod(len(cores), parallel)
    slots, start = [], 0
    for index in range(parallel):
        end = start + size + (1 if index < extra else 0)
        slots.append(cores[start:end])
        start = end
    return slots


class _DspoLauncher(BaseSubmititLauncher):
    """`__call__` (runs in the job's process) with resume, the core share, and the SLURM requeue wait."""

    def __call__(  # type: ignore[override]
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
        cores: list[int] | None = None,
    ) -> JobReturn:
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)  # before torch starts its threads: they follow the mask
        result = super().__call__(with_resume(sweep_overrides), job_dir_key, job_num, job_id, singleton_state)
        self._wait_if_requeued(result)
        return result

    def _wait_if_requeued(self, result: JobReturn) -> None:
        """Under SLURM, a job that dspo stopped for preemption has asked SLURM to requeue it: returning now would let
        submitit record the partial run as the job's result, so it waits (up to 10 min) for SLURM to end it."""
        if not os.environ.get("SLURM_JOB_ID") or result.working_dir is None:
            return
        status = read_status(Path(result.working_dir)) or {}
        if status.get("state") == "preempted":
            log.warning("preempted: waiting for SLURM to requeue job %s", os.environ["SLURM_JOB_ID"])
            time.sleep(600)

    def _job_params(self, job_overrides: Any, initial_job_idx: int) -> list[tuple]:
        params = []
        for index, overrides in enumerate(job_overrides):
            num = initial_job_idx + index
            log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
            params.append((list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state()))
        return params


class SlurmLauncherBase(_DspoLauncher):
    """Submitit's SLURM job array with dspo's resume and requeue (module docstring)."""

    _EXECUTOR = "slurm"

    def executor(self) -> Any:
        """submitit's SLURM executor with this config's parameters, as Hydra's plugin builds it (its `launch`)."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        executor = submitit.AutoExecutor(
            cluster="slurm", folder=self.params["submitit_folder"], slurm_max_num_timeout=self.params["max_num_timeout"]
        )
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        skip = {"submitit_folder", "max_num_timeout"}
        executor.update_parameters(
            **{k if k in base else f"slurm_{k}": v for k, v in self.params.items() if k not in skip}
        )
        return executor

    def sbatch_script(self, jobs: int) -> str:
        """The sbatch script submitit writes for a sweep of `jobs` jobs (an array), without submitting anything."""
        from submitit.slurm.slurm import _make_sbatch_string

        slurm = self.executor()._executor
        return _make_sbatch_string(
            command="<submitit's job command>", folder=slurm.folder, map_count=jobs, **slurm.parameters
        )

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        assert self.config is not None
        check_devices(self.config.get("trainer"), self.params.get("gpus_per_node"))
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("Submitit 'slurm' sweep output dir : %s", sweep_dir)
        params = self._job_params(job_overrides, initial_job_idx)
        jobs = self.executor().map_array(self, *zip(*params, strict=True))
        return [_job_result(job, p[0]) for job, p in zip(jobs, params, strict=True)]


def check_devices(trainer: Any, gpus_per_node: int | None) -> None:
    """A job's ranks per node are `tasks_per_node` = `gpus_per_node` (one task per GPU): `trainer.devices` must be
    the same number, or -1 / auto (all the GPUs the job got)."""
    devices = trainer.get("devices") if trainer is not None else None
    if gpus_per_node is None or devices in (None, -1, "auto", "-1") or devices == gpus_per_node:
        return
    raise ValueError(
        f"trainer.devices={devices} but hydra.launcher.gpus_per_node={gpus_per_node}: each SLURM job starts one task "
        f"per GPU and Lightning one rank per device, so they must agree. Set hydra.launcher.gpus_per_node={devices} "
        f"or trainer.devices={gpus_per_node} (or trainer.devices=-1)"
    )


class LocalLauncherBase(_DspoLauncher):
    """Parallel jobs on this machine, each on its own cores, with one console line per job (module docstring)."""

    _EXECUTOR = "local"

    def __init__(self, parallel_jobs: int | None = None, poll_s: float = 2.0, **params: Any) -> None:
        super().__init__(**params)
        self.parallel_jobs, self.poll_s = parallel_jobs, poll_s

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        params = self._job_params(job_overrides, initial_job_idx)
        return run_local_jobs(self, params, sweep_dir)

    def executor_parameters(self) -> dict[str, Any]:
        """submitit's parameters from the launcher config, named as Hydra's plugin names them."""
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        base = set(OmegaConf.structured(BaseQueueConf).keys())
        return {k if k in base else f"local_{k}": v for k, v in self.params.items() if k != "submitit_folder"}


def run_local_jobs(launcher: LocalLauncherBase, params: list[tuple], sweep_dir: Path) -> list[JobReturn]:
    """Run the jobs with at most `parallel_jobs` at once, each on its core share; print a line per change of a job."""
    import submitit

    executor = submitit.AutoExecutor(cluster="local", folder=launcher.params["submitit_folder"])
    executor.update_parameters(**launcher.executor_parameters())
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    parallel = min(launcher.parallel_jobs or len(cores), len(params))
    free = list(range(parallel))
    slots = core_slots(cores, parallel)
    waiting, running, results = list(params), {}, {}
    lines = JobLines(sweep_dir, [p[2] for p in params])
    while waiting or running:
        while waiting and free:
            slot, job_params = free.pop(0), waiting.pop(0)
            running[job_params[2]] = (executor.submit(launcher, *job_params, slots[slot]), slot, job_params[0])
            lines.started(job_params[2])
        for num, (job, slot, overrides) in list(running.items()):
            if job.done():
                results[num] = _job_result(job, overrides)
                lines.ended(num, results[num])
                free.append(slot)
                del running[num]
        lines.show()
        if waiting or running:
            time.sleep(launcher.poll_s)
    return [results[p[2]] for p in params]


def _job_result(job: Any, overrides: list[str]) -> JobReturn:
    try:
        return job.results()[0]
    except Exception as error:  # the job's process died (killed, out of memory): submitit has no result for it
        return failed_return(overrides, error)


class JobLines:
    """One console line per job of a local sweep, printed when the job's state changes: queued, started, running step
    N/M (from its `status.json`, dspo.callbacks.status), finished, failed (with the error's last line)."""

    def __init__(self, sweep_dir: Path, job_nums: list[int]) -> None:
        self.sweep_dir = sweep_dir
        self.states = {num: "queued" for num in job_nums}
        self.shown: dict[int, str] = {}

    def started(self, num: int) -> None:
        self.states[num] = "started"

    def ended(self, num: int, result: JobReturn) -> None:
        status = self._statuses().get(num, {})
        if status.get("state") == "preempted":  # not a result, whatever the job returned (dspo.sweeps.job.RunPreempted)
            at = f" at step {status.get('step')}/{status.get('max_steps')}" if status.get("step") is not None else ""
            self.states[num] = f"preempted{at}: run the sweep again to resume it from its last.ckpt"
        elif result.status == JobStatus.COMPLETED:
            self.states[num] = _finished(result.return_value)
        else:
            error = status.get("error") or _last_line(result._return_value)
            self.states[num] = f"failed: {error}"

    def show(self) -> None:
        statuses = self._statuses()
        for num, state in self.states.items():
            status = statuses.get(num, {})
            if state == "started" and status.get("state") == "running":
                state = f"running step {status.get('step')}/{status.get('max_steps')}"
            elif state == "started" and status.get("state") == "finished":  # written just before the process ends
                state = _finished(status.get("metric"))
            if self.shown.get(num) != state:
                folder = status.get("dir", "")
                print(f"[sweep] job {num}{f' ({folder})' if folder else ''}: {state}", flush=True)
                self.shown[num] = state

    def _statuses(self) -> dict[int, dict]:
        """{job number: its newest status}: the job folder's own, or a run inside it (`trial_seeds`' seed<k>/)."""
        found: dict[int, dict] = {}
        for path in [*self.sweep_dir.glob("*/status.json"), *self.sweep_dir.glob("*/*/status.json")]:
            status = read_status(path.parent) or {}
            num = status.get("job_num")
            if isinstance(num, int) and status.get("updated", 0) >= found.get(num, {}).get("updated", 0):
                where = path.parent.relative_to(self.sweep_dir)
                found[num] = {**status, "dir": str(where)}
        return found


def _finished(value: Any) -> str:
    return "finished" + (f" ({value:.4f})" if isinstance(value, int | float) else "")


def _last_line(error: Any) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1].strip() if lines else ''}"


def failed_return(overrides: list[str], error: BaseException) -> JobReturn:
    """A JobReturn for a job whose process failed: Hydra's sweeper raises `error` when it reads the return value."""
    result = JobReturn(overrides=overrides, status=JobStatus.FAILED)
    result._return_value = error
    return result
