"""The state of each job of a sweep, from the `status.json` every run writes, for the console, the report and resume.

    dspo-sweep SWEEP_DIR          # one line per job: queued / running step N/M / finished / failed

A run's `status.json` (in its run directory, written by rank 0) holds `state` and what goes with it:

- `running`: `step` / `max_steps`, rewritten as training advances (dspo.callbacks.status.RunStatus);
- `finished`: the run ended normally; `metric` is what `dspo-train` returned to the sweeper (`sweep_metric`);
- `preempted`: stopped by a scheduler's signal after saving `last.ckpt` (the requeued job resumes it);
- `failed`: `error` is the exception's last line, `step` where it stopped.

At its end a run adds its resident memory in GiB (dspo.train): `rss_start_gib`, what the process held when the job
began (in a sweep run in one process, what the earlier jobs left), and `rss_peak_gib`, the job's own peak.

A job killed without a chance to write (`kill -9`, the node died, out of memory) stays `running`: once nothing runs
(the sweep is over, `dspo-report`), such a job is reported as `stopped`, with the last error line of its
log files. A folder with no `status.json` was written before status files existed: it is taken as it is (`unknown`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"
DONE_STATES = ("finished",)
# states whose run is not a complete result: the ablation report lists these jobs instead of averaging them
INCOMPLETE_STATES = ("failed", "preempted", "stopped")
_ERROR_WORDS = ("Error", "Exception", "Killed", "CANCELLED", "DUE TO TIME LIMIT", "out of memory", "Traceback")


# What a new state takes over from the previous file when not given: the job's identity (number, process, cores) and
# its progress (a failure is reported at the last step a running state wrote). Outcomes (`error`, `metric`,
# `checkpoint`, ...) never carry over: an attempt's error is not the next attempt's, nor a finished run's metric a
# later failure's.
CARRIED_FIELDS = ("job_num", "pid", "cores", "step", "max_steps")


def write_status(run_dir: str | Path, state: str, **fields: Any) -> None:
    """Replace `run_dir/status.json` atomically (a reader never sees half a file) with `state` and `fields`, plus the
    `CARRIED_FIELDS` of the previous file that `fields` does not give."""
    path = Path(run_dir) / STATUS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = read_status(path.parent) or {}
    carried = {key: previous[key] for key in CARRIED_FIELDS if key in previous}
    data = {**carried, **fields, "state": state, "updated": time.time()}
    partial = path.with_name(f".{STATUS_FILE}.{os.getpid()}")
    partial.write_text(json.dumps(data, default=str) + "\n")
    os.replace(partial, path)


def read_status(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's status, or None without a readable `status.json`."""
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def last_error_line(run_dir: str | Path) -> str | None:
    """The last line that reads like an error in the run's log files (its `*.log`, and submitit's `*.err`/`*.out`
    when the job folder is inside the run): what a killed job left to say."""
    run_dir = Path(run_dir)
    logs = sorted([*run_dir.glob("*.log"), *run_dir.glob(".submitit/*/*_log.*")], key=os.path.getmtime)
    found = None
    for path in logs:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        hits = [line.strip() for line in lines if any(word in line for word in _ERROR_WORDS)]
        found = hits[-1] if hits else found
    return found


@dataclass(frozen=True)
class JobState:
    """One job of a sweep: its folder, its state (see the module docstring) and what goes with it."""

    dir: Path
    state: str
    step: int | None = None
    max_steps: int | None = None
    error: str | None = None
    metric: float | None = None
    overrides: tuple[str, ...] = ()
    rss_peak_gib: float | None = None

    @property
    def name(self) -> str:
        return self.dir.name

    def line(self) -> str:
        """`0_dspo_seed0  running step 3/10  algorithm=dspo seed=0`: the console's line for this job."""
        if self.state == "running" and self.step is not None:
            what = f"running step {self.step}/{self.max_steps if self.max_steps is not None else '?'}"
        elif self.state == "finished":
            what = "finished" + (f" ({self.metric:.4f})" if self.metric is not None else "")
            what += f", peak {self.rss_peak_gib:.2f} GiB" if self.rss_peak_gib is not None else ""
        elif self.state in INCOMPLETE_STATES:
            step = f" at step {self.step}" if self.step is not None else ""
            what = f"{self.state}{step}" + (f": {self.error}" if self.error else "")
        else:
            what = self.state
        return f"{self.name:<28} {what}" + (f"   [{' '.join(self.overrides)}]" if self.overrides else "")


def job_state(run_dir: str | Path, sweep_running: bool = False) -> JobState:
    """A job folder's state. `sweep_running=False` (the sweep is over): a job still marked `running` was killed
    without writing its end, and is `stopped`."""
    run_dir = Path(run_dir)
    status = read_status(run_dir)
    overrides = tuple(job_overrides(run_dir))
    if status is None:
        return JobState(run_dir, "unknown" if (run_dir / ".hydra").is_dir() else "queued", overrides=overrides)
    state = str(status.get("state", "unknown"))
    error = status.get("error")
    if state == "running" and not sweep_running:
        state, error = "stopped", last_error_line(run_dir) or "no error line in its logs (killed?)"
    elif state in ("failed", "preempted") and not error:
        error = last_error_line(run_dir)
    metric, peak = status.get("metric"), status.get("rss_peak_gib")
    return JobState(
        run_dir,
        state,
        step=status.get("step"),
        max_steps=status.get("max_steps"),
        error=error,
        metric=float(metric) if isinstance(metric, int | float) else None,
        overrides=overrides,
        rss_peak_gib=float(peak) if isinstance(peak, int | float) else None,
    )


def job_overrides(run_dir: str | Path) -> list[str]:
    """The command-line overrides of a job (Hydra's `.hydra/overrides.yaml`), [] when absent."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    from omegaconf import OmegaConf

    try:
        return [str(item) for item in OmegaConf.load(path)]
    except Exception:  # a truncated file from a killed job: the state matters more than its overrides
        return []


def sweep_jobs(sweep_dir: str | Path, sweep_running: bool = False) -> list[JobState]:
    """Every job folder directly under `sweep_dir` (those with `.hydra/` or a status file), by job number."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep folder {sweep_dir} does not exist: pass outputs/multirun/<timestamp>")
    folders = [
        p for p in sweep_dir.iterdir() if p.is_dir() and ((p / ".hydra").is_dir() or (p / STATUS_FILE).is_file())
    ]
    return [job_state(p, sweep_running) for p in sorted(folders, key=_job_order)]


def _job_order(path: Path) -> tuple[int, str]:
    head = path.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, path.name)


def incomplete_jobs(sweep_dir: str | Path) -> list[JobState]:
    """The jobs of a finished sweep that did not end normally (failed, preempted, stopped)."""
    return [job for job in sweep_jobs(sweep_dir) if job.state in INCOMPLETE_STATES]


def finished_result(run_dir: str | Path, max_steps: int | None) -> tuple[bool, float | None]:
    """(True, metric) when the run in `run_dir` finished with at least `max_steps` steps (a resumed sweep skips it),
    else (False, None)."""
    status = read_status(run_dir)
    if not status or status.get("state") not in DONE_STATES:
        return False, None
    done_steps = status.get("max_steps")
    if max_steps is not None and max_steps >= 0 and (done_steps is None or int(done_steps) < max_steps):
        return False, None  # asked to train further than it did: resume it instead
    metric = status.get("metric")
    return True, float(metric) if isinstance(metric, int | float) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspo-sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="a multirun folder, e.g. outputs/multirun/<timestamp>")
    parser.add_argument("--running", action="store_true", help="the sweep still runs: `running` jobs are not stopped")
    args = parser.parse_args(argv)
    jobs = sweep_jobs(args.sweep, sweep_running=args.running)
    for job in jobs:
        print(job.line())
    counts = {state: sum(job.state == state for job in jobs) for state in sorted({job.state for job in jobs})}
    print(f"{len(jobs)} jobs: " + ", ".join(f"{n} {state}" for state, n in counts.items()))
    return 1 if any(job.state in INCOMPLETE_STATES for job in jobs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
