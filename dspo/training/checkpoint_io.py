"""The trainer's CheckpointIO plugin: every single-file save atomic (dspo.runs.checkpoint_files has why)."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO

from dspo.runs.checkpoint_files import atomic_torch_save


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO whose local saves are atomic; remote URLs (s3://, ...) keep Lightning's own writer."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_torch_save(checkpoint, path)
