"""dspo's Hydra launchers (dspo.sweeps.launchers): resume added to each job, the cores divided between local jobs, the
SLURM
sbatch script rendered from conf/hydra/launcher/slurm.yaml (not submitted: no cluster here), and a real 2-job sweep
through submitit's local executor, read back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from dspo.sweeps.launchers import check_devices, core_slots, with_resume

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_each_job_resumes_unless_the_command_line_chose_a_checkpoint() -> None:
    assert with_resume(["algorithm=dspo"]) == ["algorithm=dspo", "ckpt_path=auto"]
    assert with_resume(["ckpt_path=last", "seed=1"]) == ["ckpt_path=last", "seed=1"]
    assert with_resume(["+ckpt_path=/a.ckpt"]) == ["+ckpt_path=/a.ckpt"]


def test_cores_are_divided_without_oversubscription() -> None:
    assert core_slots([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert core_slots([0, 1], 2) == [[0], [1]]
    with pytest.raises(ValueError, match="hydra.launcher.parallel_jobs=3: use 1..2"):
        core_slots([0, 1], 3)


def test_slurm_tasks_must_match_the_trainer_devices() -> None:
    check_devices({"devices": -1}, 8)
    check_devices({"devices": 8}, 8)
    with pytest.raises(ValueError, match="trainer.devices=4 but hydra.launcher.gpus_per_node=8"):
        check_devices({"devices": 4}, 8)


def _launcher(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    return launcher


def test_slurm_launcher_renders_the_documented_sbatch_script(tmp_path, monkeypatch) -> None:
    """The script submitit would submit for a 4-job sweep (docs/sweeps.md#a-sweep-on-slurm): one array task per job,
    one task per GPU, SIGUSR1 5 min before the limit (dspo's preemption callback), requeue allowed. `srun` is a
    stand-in on PATH (submitit looks for it); nothing is submitted."""
    (tmp_path / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    overrides = ["hydra/launcher=slurm", "trainer=fsdp", "hydra.sweep.dir=/shared/sweep"]
    launcher = _launcher([*overrides, "hydra.launcher.partition=gpu", "hydra.launcher.account=proj"])
    lines = set(launcher.sbatch_script(4).splitlines())
    expected = [
        "--array=0-3%4", "--nodes=1", "--gpus-per-node=8", "--ntasks-per-node=8", "--cpus-per-task=12",
        "--time=1440", "--signal=USR1@300", "--requeue", "--partition=gpu", "--account=proj", "--open-mode=append",
        "--output=/shared/sweep/.submitit/%A_%a/%A_%a_0_log.out",
    ]  # fmt: skip
    assert {f"#SBATCH {flag}" for flag in expected} <= lines, sorted(lines)
    two_nodes = _launcher([*overrides, "trainer.num_nodes=2", "hydra.launcher.gpus_per_node=4"])
    assert {"#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4"} <= set(two_nodes.sbatch_script(2).splitlines())
    wrong = _launcher(["hydra/launcher=slurm", "trainer.devices=2", "hydra.sweep.dir=/shared/sweep"])
    with pytest.raises(ValueError, match="trainer.devices=2 but hydra.launcher.gpus_per_node=8"):
        wrong.launch([["seed=0"]], 0)


@pytest.mark.slow
def test_local_sweep_runs_two_jobs_in_parallel_processes_and_reads_them_back(
    run_train, short_default_hf, toy_cache, tmp_path
) -> None:
    """Two tiny runs through submitit's local executor: each its own process on its own core, one console line per
    change of state, TensorBoard's text tab naming each job's overrides, the ablation report reading both back (a
    resumed sweep skipping them: tests/test_train_unit.py)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dspo.sweeps import report as ablation
    from dspo.sweeps.status import read_status

    outputs = tmp_path / "outputs"
    short = [o for o in short_default_hf if not o.startswith(("data.val_limit", "trainer.val_check_interval"))]
    args = [*short, "trainer.max_steps=2", "trainer.val_check_interval=2", "data.val_limit=8", "run_test=false"]
    args += ["callbacks.validate_at_start=null", "sweep_metric=val/subem_mean", f"hydra.sweep.dir={outputs}/sweep"]
    result = run_train(
        ["-m", "hydra/launcher=local", "hydra.launcher.poll_s=0.5", "algorithm=dspo,gspo", *args], outputs
    )
    sweep = outputs / "sweep"
    jobs = {name: read_status(sweep / name) for name in ("0_dspo_seed0", "1_gspo_seed0")}
    assert all(status["state"] == "finished" and status["step"] == 2 for status in jobs.values()), jobs
    assert len({status["pid"] for status in jobs.values()}) == 2  # separate processes
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(jobs["0_dspo_seed0"]["cores"]) & set(jobs["1_gspo_seed0"]["cores"])  # no shared core
    for num, name in enumerate(jobs):
        assert f"[sweep] job {num} ({name}): finished ({jobs[name]['metric']:.4f})" in result.stdout, result.stdout
        assert f"[sweep] job {num} ({name}): running step " in result.stdout
        events = EventAccumulator(str(sweep / name / "tb"))
        events.Reload()
        (text,) = [tag for tag in events.Tags()["tensors"] if tag.startswith("run/overrides")]
        assert f"algorithm={name.split('_')[1]}" in events.Tensors(text)[0].tensor_proto.string_val[0].decode()
    assert sorted(ablation.report(sweep)["summary"]) == ["dspo", "gspo"]


def test_console_lines_follow_each_jobs_status_and_print_only_changes(tmp_path, capsys) -> None:
    """dspo.sweeps.launchers.JobLines on a sweep folder written here: queued, started, running step N/M (a run's own
    status.json, or a trial_seeds run inside the job's folder), finished with its value, failed with the last line."""
    from hydra.core.utils import JobReturn, JobStatus

    from dspo.sweeps.launchers import JobLines, failed_return
    from dspo.sweeps.status import write_status

    lines = JobLines(tmp_path, [0, 1, 2])
    lines.started(0)
    lines.started(1)
    write_status(tmp_path / "0_dspo_seed0", "running", step=1, max_steps=4, job_num=0)
    write_status(tmp_path / "1" / "seed0", "running", step=3, max_steps=4, job_num=1)
    lines.show()
    lines.show()  # nothing changed: nothing printed
    done = JobReturn(status=JobStatus.COMPLETED)
    done.return_value = 0.5
    lines.ended(0, done)
    lines.ended(1, failed_return(["seed=0"], RuntimeError("engine died\nCUDA error: out of memory")))
    lines.show()
    assert capsys.readouterr().out.splitlines() == [
        "[sweep] job 0 (0_dspo_seed0): running step 1/4",
        "[sweep] job 1 (1/seed0): running step 3/4",
        "[sweep] job 2: queued",
        "[sweep] job 0 (0_dspo_seed0): finished (0.5000)",
        "[sweep] job 1 (1/seed0): failed: RuntimeError: CUDA error: out of memory",
    ]


@pytest.mark.parametrize("returned", ["completed", "raised"])
def test_a_preempted_job_is_reported_preempted_whatever_it_returned(tmp_path, capsys, returned) -> None:
    """Issue 70 (5): a preempted job returned its partial metric and the local launcher printed "finished". Its
    status.json decides the line: `preempted`, whether the job returned a value (a run outside dspo-train's raise) or
    raised `RunPreempted` (a dspo-train sweep job)."""
    from hydra.core.utils import JobReturn, JobStatus

    from dspo.sweeps.job import RunPreempted
    from dspo.sweeps.launchers import JobLines, failed_return
    from dspo.sweeps.status import write_status

    lines = JobLines(tmp_path, [0])
    lines.started(0)
    write_status(tmp_path / "0_dspo_seed0", "preempted", step=6, max_steps=8, job_num=0, checkpoint="last.ckpt")
    result = JobReturn(status=JobStatus.COMPLETED)
    result.return_value = 0.25
    if returned == "raised":
        result = failed_return(["seed=0"], RunPreempted("preempted at step 6/8"))
    lines.ended(0, result)
    lines.show()
    assert capsys.readouterr().out.splitlines() == [
        "[sweep] job 0 (0_dspo_seed0): preempted at step 6/8: run the sweep again to resume it from its last.ckpt"
    ]
