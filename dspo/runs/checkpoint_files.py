"""Checkpoints that are never half-written, and `ckpt_path=last` that skips the ones that cannot be loaded.

Lightning's default `TorchCheckpointIO` serialises the whole checkpoint into memory, writes it to a temporary file in
the system temp folder and moves it into place; when that folder is on another file system (node-local /tmp,
checkpoints on a shared one) the move is a copy, so a `kill -9` during it leaves a truncated `last.ckpt`.
`atomic_torch_save` streams into a temporary file beside the target, fsyncs it and `os.replace`s it over the target:
a reader sees the old file or the new one, never a part. `dspo.training.checkpoint_io.AtomicCheckpointIO` (the trainer's
`plugins`, conf/trainer/cpu.yaml, inherited by ddp/fsdp) serves every single-file save with it: ModelCheckpoint's, and
`failure.ckpt` / `non_finite.ckpt`. No Lightning here: tools that read a run's files need none.
The folder checkpoints of `trainer=fsdp` are replaced whole the same way by `dspo.training.strategies.FSDP2Strategy`.
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# Written after an error, possibly mid-round: `ckpt_path=last` never picks them (pass their path to resume from one).
ERROR_CHECKPOINTS = ("failure.ckpt", "non_finite.ckpt")


def temporary_name(path: Path) -> Path:
    """Hidden, and not ending in `.ckpt`, so neither ModelCheckpoint nor `ckpt_path=last` ever sees it."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save` to a temporary file in the target's folder, fsync, rename over the target, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a process killed mid-write; one writer per file
        stale.unlink(missing_ok=True)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power loss
    finally:
        os.close(directory)


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be resumed from (None when it can).

    Cheap even for a 100 GB checkpoint: `zipfile.is_zipfile` reads only the archive's end record (a truncated file
    has none), and `torch.load(mmap=True)` reads the pickled structure and maps the tensors without reading them."""
    path = Path(path)
    if path.is_dir():
        return _distributed_checkpoint_problem(path)
    try:
        size = path.stat().st_size
    except OSError as err:
        return f"cannot stat it ({err})"
    if size == 0:
        return "empty file (0 bytes)"
    if not zipfile.is_zipfile(path):
        return f"not a complete torch archive ({size:,} bytes, no zip end record: truncated?)"
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - any failure to load is a reason to skip it
        return f"torch.load(weights_only=True) failed: {type(err).__name__}: {str(err)[:300]}"
    return None


def _distributed_checkpoint_problem(path: Path) -> str | None:
    """A distributed checkpoint (a folder: `trainer=fsdp`, dspo.training.strategies.FSDP2Strategy) is complete when
    torch.distributed.checkpoint's `.metadata` (written after every shard) and Lightning's `meta.pt` are there and
    `meta.pt` loads; the strategy writes it in a temporary folder and renames it into place."""
    missing = [name for name in (".metadata", "meta.pt") if not (path / name).is_file()]
    if missing:
        return f"distributed checkpoint folder without {' and '.join(missing)} (an interrupted save?)"
    try:
        torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to load is a reason to skip it
        return f"torch.load(meta.pt, weights_only=True) failed: {type(err).__name__}: {str(err)[:300]}"
    return None


def resume_order(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Newest run folder first; within a folder `last.ckpt` first (it is written after the step file of the same
    step, and the best-on-validation file may be newer without being later), then the others newest first."""
    paths = [str(p) for p in paths]
    newest_in = {}
    for path in paths:
        folder = str(Path(path).parent)
        newest_in[folder] = max(newest_in.get(folder, 0.0), os.path.getmtime(path))

    def key(path: str) -> tuple[float, str, bool, float]:
        folder = str(Path(path).parent)
        return newest_in[folder], folder, Path(path).name == "last.ckpt", os.path.getmtime(path)

    return sorted(paths, key=key, reverse=True)


def newest_loadable(paths: Iterable[str | os.PathLike]) -> str | None:
    """The first of `paths` in `resume_order` that loads; each skipped file is named in a warning with the reason."""
    for path in resume_order(paths):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("ckpt_path=last: skipping %s: %s", path, problem)
    return None
