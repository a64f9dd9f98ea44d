"""dspo.process.runtime: process-level thread and allocator settings, their scope (`process_settings`), and how a
command
ends (`run_command`)."""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import pytest
import torch

from dspo.process.runtime import configure_allocator

THREAD_ENV = (
    "DSPO_NUM_THREADS",
    "OMP_NUM_THREADS",
    "LOCAL_WORLD_SIZE",
    "SLURM_CPUS_PER_TASK",
    "SLURM_NTASKS_PER_NODE",
)
SCOPED_ENV = (
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "TOKENIZERS_PARALLELISM",
    "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_CONFIGURE_LOGGING",
    "DSPO_VERBOSE",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("DSPO_MALLOC", "DSPO_MALLOC_KEEP_BYTES", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def torch_threads(monkeypatch):
    """What `configure_threads` passes to torch.set_num_threads (recorded, not applied: an in-process vLLM engine
    started earlier in the session pins torch's threads and turns later calls into no-ops)."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


# ---------------------------------------------------------------------------------------------------- threads
@pytest.mark.parametrize(
    ("env", "affinity", "local", "expected"),
    [
        ({}, 2, None, 2),  # one process on this 2-core machine: both cores (the seeded reference runs)
        ({}, 2, 1, 2),  # dspo-train's trainer=cpu passes trainer.devices=1
        ({}, 2, 2, 1),  # 2 DDP ranks on 2 cores: one thread each, not 2 x 2
        ({}, 2, 3, 1),  # at least one
        ({"LOCAL_WORLD_SIZE": "4"}, 16, None, 4),  # torchrun's processes on this node
        ({"LOCAL_WORLD_SIZE": "4"}, 16, 2, 4),  # torchrun knows what it started
        ({"SLURM_NTASKS_PER_NODE": "4"}, 16, None, 4),  # SLURM tasks sharing the node's mask
        ({"SLURM_CPUS_PER_TASK": "4"}, 64, None, 4),  # the scheduler's share, not the node's cores
        ({"SLURM_CPUS_PER_TASK": "8"}, 4, None, 4),  # the affinity mask when it is smaller
        ({"SLURM_CPUS_PER_TASK": "8"}, 64, 2, 4),  # one task, 2 ranks started inside it by Lightning
        # SLURM started the ranks (one task each): cpus-per-task is already each rank's share
        ({"SLURM_CPUS_PER_TASK": "8", "SLURM_NTASKS_PER_NODE": "4"}, 64, 4, 8),
        ({"OMP_NUM_THREADS": "3"}, 16, 2, 3),  # the user's OpenMP setting
        ({"OMP_NUM_THREADS": "6,2"}, 16, None, 6),  # nested OpenMP: the outer level
        ({"OMP_NUM_THREADS": "many"}, 2, None, 2),  # not a number: ignored, as OpenMP ignores it
        ({"DSPO_NUM_THREADS": "5", "OMP_NUM_THREADS": "3"}, 2, 2, 5),  # explicit beats everything
        ({"DSPO_NUM_THREADS": "0", "LOCAL_WORLD_SIZE": "2"}, 8, None, 4),  # 0: choose automatically
    ],
)
def test_thread_count_precedence(env, affinity, local, expected):
    from dspo.process.runtime import thread_count

    threads, source = thread_count(env, affinity, local)
    assert threads == expected
    assert source  # says where the number came from (logged)


def test_thread_count_names_its_sources_and_rejects_bad_values():
    from dspo.process.runtime import thread_count

    assert "DSPO_NUM_THREADS" in thread_count({"DSPO_NUM_THREADS": "3"}, 2)[1]
    assert "OMP_NUM_THREADS" in thread_count({"OMP_NUM_THREADS": "3"}, 2)[1]
    assert "SLURM_CPUS_PER_TASK" in thread_count({"SLURM_CPUS_PER_TASK": "1"}, 2)[1]
    assert "LOCAL_WORLD_SIZE" in thread_count({"LOCAL_WORLD_SIZE": "2"}, 2)[1]
    with pytest.raises(ValueError, match="DSPO_NUM_THREADS='two'"):
        thread_count({"DSPO_NUM_THREADS": "two"}, 2)
    with pytest.raises(ValueError, match="DSPO_NUM_THREADS='-1'"):
        thread_count({"DSPO_NUM_THREADS": "-1"}, 2)
    with pytest.raises(ValueError, match="local_processes=0"):
        thread_count({}, 2, 0)


def test_configure_threads_shares_the_usable_cores_between_local_ranks(monkeypatch, torch_threads):
    """Two ranks of torchrun on a 2-core mask set one thread each (the old code took os.cpu_count() on every rank)."""
    from dspo.process.runtime import configure_threads

    for name in THREAD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the node has more cores than this process may use
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert configure_threads() == 1 and torch_threads == [1]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert configure_threads() == 2 and torch_threads == [1, 2]  # one process: the whole mask
    assert configure_threads(local_processes=2) == 1  # what the config says (trainer.devices of a CPU run)


# ---------------------------------------------------------------------------------------------------- allocator
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_blocks_stay_on_the_heap_without_exporting_it_to_child_processes(clean_env):
    """mallopt acts in this process; `MALLOC_*_` variables would reach every child (compilers, scontrol, a GPU
    run's engine workers), where nothing measured a gain. DDP ranks run `train()` and apply it themselves."""
    assert configure_allocator() is True
    clean_env.setenv("DSPO_MALLOC_KEEP_BYTES", str(2**30))
    assert configure_allocator() is True
    assert "MALLOC_MMAP_MAX_" not in os.environ and "MALLOC_TRIM_THRESHOLD_" not in os.environ


def test_system_mode_leaves_glibc_alone_and_bad_values_are_named(clean_env):
    clean_env.setenv("DSPO_MALLOC", "system")
    assert configure_allocator() is False and "MALLOC_MMAP_MAX_" not in os.environ
    clean_env.setenv("DSPO_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="DSPO_MALLOC='jemalloc'"):
        configure_allocator()
    clean_env.setenv("DSPO_MALLOC", "keep")
    clean_env.setenv("DSPO_MALLOC_KEEP_BYTES", "0")
    with pytest.raises(ValueError, match="DSPO_MALLOC_KEEP_BYTES=0"):
        configure_allocator()


# ---------------------------------------------------------------------------------------------------- scope
@pytest.fixture
def scoped(monkeypatch, tmp_path):
    """No VLLM_*/TOKENIZERS_PARALLELISM set, a private temp directory, and a spy on the allocator."""
    for name in SCOPED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr("dspo.process.runtime.configure_allocator", lambda: calls.append("mallopt") or True)
    return calls


@pytest.mark.parametrize(("accelerator", "allocator"), [("cpu", ["mallopt"]), ("gpu", []), ("cuda", []), (None, [])])
def test_process_settings_apply_the_allocator_only_to_cpu_training(scoped, accelerator, allocator):
    from dspo.process.runtime import process_settings

    with process_settings(accelerator=accelerator):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert scoped == allocator


def test_process_settings_give_the_session_its_environment_and_warning_filters_back(scoped, monkeypatch):
    """`train()` from a notebook: the VLLM_* defaults and dspo's warning filters hold during the run, then the
    notebook's own values (and the absence of the others) come back, also when the run fails."""
    from dspo.process.runtime import process_settings

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the user's choice is kept during the run, too
    filters = list(warnings.filters)
    with pytest.raises(RuntimeError, match="run failed"), process_settings(accelerator="cpu"):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
        assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and os.path.isfile(os.environ["VLLM_LOGGING_CONFIG_PATH"])
        assert warnings.filters != filters  # dspo's filters are in place
        raise RuntimeError("run failed")
    assert warnings.filters == filters
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH"):
        assert name not in os.environ, name
    assert scoped == ["mallopt"]


COMMAND = """
import atexit, concurrent.futures, sys, threading, time
from pathlib import Path
from dspo.process.runtime import run_command

out = Path(sys.argv[1])

def main():
    def late():
        time.sleep(0.3)
        (out / "thread.txt").write_text("joined")
    threading.Thread(target=late).start()  # non-daemon: the interpreter would wait for it
    # an executor left open (its idle worker is a non-daemon thread): shut down before threads are joined, as the
    # interpreter does; joined first, the process never ended (issue 38, point 10: a finished DDP run hung)
    global pool  # still referenced (an unreferenced executor's worker ends by itself)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    pool.submit(time.sleep, 0.01).result()
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
    with open(out / "data.txt", "w") as handle:
        handle.write("kept")
    print("buffered line")  # stdout is a pipe: block-buffered, flushed only at exit
    how = sys.argv[2]
    if how == "exit2":
        raise SystemExit(2)
    if how == "message":
        sys.exit("a message")
    if how == "crash":
        raise RuntimeError("boom")
    return 3.5  # a return value (dspo-train's sweep metric) is not an exit status

run_command(main)
"""


@pytest.mark.parametrize(
    ("how", "status", "stderr"),
    [("ok", 0, ""), ("exit2", 2, ""), ("message", 1, "a message"), ("crash", 1, "RuntimeError: boom")],
)
def test_a_command_ends_with_its_status_after_threads_atexit_and_buffered_output(tmp_path, how, status, stderr):
    import subprocess

    script = tmp_path / "command.py"
    script.write_text(COMMAND)
    command = [sys.executable, str(script), str(tmp_path), how]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)  # a hang fails, not stalls
    assert result.returncode == status, result.stderr
    assert result.stdout == "buffered line\n"
    assert stderr in result.stderr
    assert (tmp_path / "data.txt").read_text() == "kept"
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
