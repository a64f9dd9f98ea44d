"""dspo.sweeps.status: each job's state from its status.json (and, for a killed job, its log), the console lines, the
CLI,
and which finished jobs a resumed sweep skips; fake sweep folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspo.sweeps import status as sweep


def fake_job(root: Path, name: str, status: dict | None, log: str = "", overrides: str = "") -> Path:
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(overrides or f"- algorithm={name.split('_')[1]}\n")
    if status is not None:
        (job / sweep.STATUS_FILE).write_text(json.dumps(status))
    if log:
        (job / "train.log").write_text(log)
    return job


@pytest.fixture()
def sweep_dir(tmp_path) -> Path:
    fake_job(tmp_path, "0_dspo_seed0", {"state": "finished", "step": 4, "max_steps": 4, "metric": 0.5})
    fake_job(tmp_path, "1_gspo_seed0", {"state": "failed", "step": 2, "error": "ConnectionError: retriever down"})
    killed = "[INFO] - step 3\nRuntimeError: CUDA out of memory. Tried to allocate 2 GiB\nslurmstepd: CANCELLED\n"
    fake_job(tmp_path, "2_dapo_seed0", {"state": "running", "step": 3, "max_steps": 4}, log=killed)
    fake_job(tmp_path, "10_grpo_seed0", {"state": "preempted", "step": 2, "max_steps": 4})
    fake_job(tmp_path, "3_grpo_seed1", None)  # written before status files existed
    return tmp_path


def test_job_states_name_each_outcome_and_the_last_error_line(sweep_dir) -> None:
    jobs = {job.name: job for job in sweep.sweep_jobs(sweep_dir)}
    assert [job.name for job in sweep.sweep_jobs(sweep_dir)] == [
        "0_dspo_seed0", "1_gspo_seed0", "2_dapo_seed0", "3_grpo_seed1", "10_grpo_seed0",
    ]  # fmt: skip
    assert jobs["0_dspo_seed0"].state == "finished" and jobs["0_dspo_seed0"].metric == 0.5
    assert jobs["1_gspo_seed0"].error == "ConnectionError: retriever down"
    assert jobs["2_dapo_seed0"].state == "stopped"  # marked running, but the sweep is over: killed without a word
    assert jobs["2_dapo_seed0"].error == "slurmstepd: CANCELLED"  # the last line that reads like an error
    assert jobs["3_grpo_seed1"].state == "unknown" and jobs["10_grpo_seed0"].state == "preempted"
    assert jobs["2_dapo_seed0"].overrides == ("algorithm=dapo",)
    running = {job.name: job for job in sweep.sweep_jobs(sweep_dir, sweep_running=True)}
    assert running["2_dapo_seed0"].line().split()[1:4] == ["running", "step", "3/4"]
    assert [job.name for job in sweep.incomplete_jobs(sweep_dir)] == ["1_gspo_seed0", "2_dapo_seed0", "10_grpo_seed0"]


def test_cli_prints_a_line_per_job_and_fails_when_one_did_not_finish(sweep_dir, capsys) -> None:
    assert sweep.main([str(sweep_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("0_dspo_seed0") and "finished (0.5000)" in out[0] and "[algorithm=dspo]" in out[0]
    assert "failed at step 2: ConnectionError: retriever down" in out[1]
    assert out[-1] == "5 jobs: 1 failed, 1 finished, 1 preempted, 1 stopped, 1 unknown"
    for name in ("1_gspo_seed0", "2_dapo_seed0", "10_grpo_seed0"):
        (sweep_dir / name / sweep.STATUS_FILE).unlink()
    assert sweep.main([str(sweep_dir)]) == 0
    with pytest.raises(FileNotFoundError, match="outputs/multirun"):
        sweep.main([str(sweep_dir / "nope")])


def test_write_status_keeps_earlier_fields_and_replaces_atomically(tmp_path) -> None:
    sweep.write_status(tmp_path, "running", step=1, max_steps=4, job_num=3)
    sweep.write_status(tmp_path, "finished", metric=0.25)
    status = sweep.read_status(tmp_path)
    assert status["state"] == "finished" and status["job_num"] == 3 and status["metric"] == 0.25
    assert [p.name for p in tmp_path.iterdir()] == [sweep.STATUS_FILE]  # no partial file left behind


# a status write of each kind dspo makes, with the fields it gives (dspo.train, dspo.sweeps.job, RunStatus)
_WRITES = {
    "running": lambda n: {"step": n, "max_steps": 8, "job_num": 1, "pid": 100 + n, "cores": [0]},
    "preempted": lambda n: {"step": n, "max_steps": 8, "checkpoint": f"/ckpt/{n}"},
    "failed": lambda n: {"error": f"RuntimeError: attempt {n}"},
    "finished": lambda n: {"step": 8, "max_steps": 8, "metric": n / 10},
}


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(sorted(_WRITES)), st.integers(0, 8)), min_size=1, max_size=8))
def test_a_status_write_never_carries_an_earlier_outcome(writes) -> None:
    """Issue 70 (5): "preempted at step 60: RuntimeError: retriever unreachable" from an earlier attempt. For any
    sequence of writes, the file holds the last write's own fields, plus only the job's number and progress from
    before: never an earlier error, metric, checkpoint or process."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        carried: dict = {}
        for state, n in writes:
            fields = _WRITES[state](n)
            sweep.write_status(folder, state, **fields)
            expected = {**{k: v for k, v in carried.items() if k in sweep.CARRIED_FIELDS}, **fields, "state": state}
            status = sweep.read_status(folder)
            assert {k: v for k, v in status.items() if k != "updated"} == expected
            carried = status


def test_finished_result_skips_only_a_run_that_finished_as_far_as_asked(tmp_path) -> None:
    assert sweep.finished_result(tmp_path, 4) == (False, None)  # never ran
    sweep.write_status(tmp_path, "preempted", step=2, max_steps=4)
    assert sweep.finished_result(tmp_path, 4) == (False, None)  # resumed, not skipped
    sweep.write_status(tmp_path, "finished", step=4, max_steps=4, metric=0.5)
    assert sweep.finished_result(tmp_path, 4) == (True, 0.5)
    assert sweep.finished_result(tmp_path, 8) == (False, None)  # asked for more steps: resume it further
