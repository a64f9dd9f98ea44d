"""Issue 76: a sweep run by Hydra's basic launcher (the default) runs its jobs one after another in one process, and
each job kept ~1 GiB of it (vLLM's gc.freeze of the engine, the first job's stack kept by a library's import traceback,
the heap's holes): the README's 20-job ablation did not fit 24 GiB. A job's end now frees what it left
(dspo.process.runtime.release_job_memory) and records its memory in its status.json."""

from __future__ import annotations

import mmap
import sys
import types

import pytest

from dspo.callbacks.status import record_job_memory
from dspo.process.runtime import drop_tracebacks_into, reset_peak_rss, rss_gib
from dspo.sweeps.status import read_status, sweep_jobs, write_status

JOBS = 6
PEAK_GROWTH = 1.15  # the last job's peak may exceed the first's by 15 % (it grew by 1 GiB per 2.5 GiB job before)


@pytest.mark.slow
def test_a_sweep_in_one_process_keeps_no_memory_of_its_jobs(run_train, short_default, tmp_path):
    """6 one-step toy jobs (vLLM in-process) in one process: the last job's peak RSS stays within 15 % of the first's.
    Before the fix the peaks were 2.5, 3.6, 4.6, ... GiB (+1.0 GiB a job)."""
    outputs = tmp_path / "outputs"
    seeds = ",".join(str(seed) for seed in range(JOBS))
    run_train(["-m", f"seed={seeds}", *short_default, "trainer.max_steps=1", "run_test=false"], outputs, finishes=JOBS)
    (sweep,) = list((outputs / "multirun").iterdir())
    statuses = [read_status(job.dir) or {} for job in sweep_jobs(sweep)]
    assert [status.get("state") for status in statuses] == ["finished"] * JOBS, statuses
    peaks = [status.get("rss_peak_gib") for status in statuses]
    starts = [status.get("rss_start_gib") for status in statuses]
    assert all(isinstance(value, float) for value in peaks + starts), statuses
    report = f"per-job peak RSS {peaks} GiB, RSS at each job's start {starts} GiB"
    print(report)  # shown with -rP: the numbers of a passing run
    assert peaks[-1] <= PEAK_GROWTH * peaks[0], report
    assert starts[-1] <= starts[1] + 0.15 * peaks[0], report  # what the jobs after the first left behind


def _kept_by_a_library(run: types.FunctionType) -> BaseException:
    """An ImportError caught and kept at module level, as vLLM 0.32 keeps torchcodec's, by an import that `run` made."""

    def import_a_missing_module() -> BaseException:
        try:
            import dspo_no_such_module  # noqa: F401
        except ImportError as error:
            return error
        raise AssertionError("dspo_no_such_module exists")

    return run(import_a_missing_module)


def test_a_kept_traceback_that_reaches_the_run_is_dropped(monkeypatch):
    """The kept exception's traceback holds the frames of the run that imported it (and their locals): dropped; one
    that does not reach the run keeps its traceback, and the exception its message."""

    def run(call):
        payload = bytearray(16)  # noqa: F841  a local of the run that the kept traceback would hold
        return call()

    def elsewhere(call):
        return call()

    library = types.ModuleType("dspo_test_library")
    library.from_the_run = _kept_by_a_library(run)
    library.from_elsewhere = _kept_by_a_library(elsewhere)
    library.chained = RuntimeError("wrapper")
    library.chained.__cause__ = _kept_by_a_library(run)
    monkeypatch.setitem(sys.modules, library.__name__, library)

    assert drop_tracebacks_into([run.__code__]) == 2
    assert library.from_the_run.__traceback__ is None and "dspo_no_such_module" in str(library.from_the_run)
    assert library.chained.__cause__.__traceback__ is None
    assert library.from_elsewhere.__traceback__ is not None


def test_the_job_memory_is_added_to_the_status_its_end_wrote(tmp_path):
    run_dir = tmp_path / "2_dspo_seed0"
    write_status(run_dir, "finished", step=4, max_steps=4, metric=0.5, job_num=2)
    record_job_memory(run_dir, rss_start_gib=1.04, rss_peak_gib=2.6049, missing=None)
    status = read_status(run_dir)
    assert status["state"] == "finished" and status["metric"] == 0.5 and status["job_num"] == 2
    assert status["rss_start_gib"] == 1.04 and status["rss_peak_gib"] == 2.605 and "missing" not in status
    (job,) = sweep_jobs(tmp_path)
    assert job.rss_peak_gib == 2.605 and "finished (0.5000), peak 2.60 GiB" in job.line()


def test_no_status_no_record(tmp_path):
    record_job_memory(tmp_path / "refused", rss_peak_gib=1.0)  # a command refused before it started left no folder
    assert not (tmp_path / "refused").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self: Linux")
def test_the_peak_after_a_reset_is_the_peak_since_the_reset():
    before = rss_gib("VmHWM")
    with mmap.mmap(-1, 256 * 2**20) as block:  # its own mapping, unmapped at the end whatever the allocator keeps
        block.write(b"x" * len(block))  # touched: resident
        held = rss_gib("VmHWM")
    assert reset_peak_rss()
    after = rss_gib("VmHWM")
    assert held >= before and held - after > 0.2, (before, held, after)
