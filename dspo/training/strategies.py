"""`FSDP2Strategy`: pure data-parallel FSDP2 (`fully_shard`) through Lightning's `ModelParallelStrategy`.

Why not Lightning's `FSDPStrategy` (FSDP1): it refuses a CPU accelerator, so the sharded path could never run (or be
tested) without GPUs. `ModelParallelStrategy` runs FSDP2 on any device (gloo on CPU, nccl on GPU), but sizes its mesh
for 2D parallelism by default (data-parallel = nodes, tensor-parallel = processes per node). Here every process is a
data-parallel rank (tensor-parallel size 1); `DSPOModule.configure_model` applies `fully_shard` on the mesh's
"data_parallel" dimension.

Departure from Lightning's save: a distributed checkpoint is a folder (`last.ckpt/` holding `.distcp` shards,
`.metadata` and `meta.pt`) that ModelCheckpoint rewrites in place; a kill during that rewrite would leave a folder
mixing two steps. Each save goes to a hidden temporary folder beside the target, which then replaces the target
(rename old away, rename new in, delete old): a reader sees a whole checkpoint or, for a moment, none under that name
(`ckpt_path=last` then takes the step folder of the same step).

Departure from Lightning's load: torch's distributed loader requires every key of the module it loads into, so a
LightningModule with `strict_loading = False` whose checkpoints leave a child out (DSPOModule's frozen reference
model, reloaded from `model.path`) could not resume. The load goes to a view holding only the children the checkpoint
has, under the same names.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint, _load_checkpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from dspo.runs.checkpoint_files import temporary_name


class FSDP2Strategy(ModelParallelStrategy):
    """`ModelParallelStrategy` with data-parallel size = all processes and tensor-parallel size 1.

    The process-group backend is Lightning's default for the device unless given (gloo on CPU, nccl on GPU)."""

    def __init__(self, save_distributed_checkpoint: bool = True, process_group_backend: str | None = None, **kwargs):
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            **kwargs,
        )

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint or storage_options is not None or "://" in str(filepath):
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        target = Path(self.broadcast(str(filepath)))
        tmp = Path(self.broadcast(str(temporary_name(target))))  # rank 0's name on every rank
        if self.global_rank == 0:  # left by a run killed mid-save (one writer per target)
            for stale in target.parent.glob(f".{target.name}.tmp-*"):
                _remove(stale)
        self.barrier()
        super().save_checkpoint(checkpoint, tmp)
        self.barrier()
        if self.global_rank == 0:
            _replace_folder(tmp, target)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from dspo.runs.trust import folder_checkpoint_as_data

        # a folder's `.metadata` and non-tensor items are pickles: torch's reader reads them as data only, here and
        # in `_load_checkpoint`'s own read of the metadata (resume, and the guard's rollback, come through here)
        with folder_checkpoint_as_data("ckpt_path"):
            return self._load_checkpoint(checkpoint_path, weights_only)

    def _load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        module = self.lightning_module
        if module is None or module.strict_loading or not _is_sharded_checkpoint(path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        children = {
            name: child
            for name, child in module.named_children()
            if any(key.startswith(f"state_dict.{name}.") for key in saved)
        }
        view = nn.ModuleDict(children)
        if any(f"state_dict.{key}" not in saved for key in view.state_dict()):  # LoRA: the frozen base is left out
            return _load_saved_keys(path, view, self.optimizers, saved, weights_only)
        state = {"state_dict": view, **{f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}}
        return _load_checkpoint(path, state, strict=False, optimizer_states_from_list=True, weights_only=weights_only)


def _load_saved_keys(path: Path, view: nn.Module, optimizers: list, saved: Any, weights_only: bool | None) -> dict:
    """Lightning's sharded load (`_load_checkpoint`) reading only the tensors of `view` that the checkpoint holds: a
    LoRA policy's checkpoint has its adapters, not the frozen base (reloaded from model.path). Returns the metadata."""
    import torch
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model_state = {k: v for k, v in get_model_state_dict(view).items() if f"state_dict.{k}" in saved}
    load({"state_dict": model_state}, checkpoint_id=path)
    view.load_state_dict(model_state, strict=False)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(view, optimizer)}
        load(optimizer_state, checkpoint_id=path)
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(view, optimizer, optim_state_dict=optimizer_state[key], options=options)
    return torch.load(path / "meta.pt", weights_only=weights_only)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _replace_folder(new: Path, target: Path) -> None:
    """Put folder `new` at `target` (a file or folder there is replaced), with no instant at which `target` is missing
    (`dspo.cachedir.swap_into_place`): a reader of `last.ckpt` never finds it gone."""
    from dspo.cachedir import swap_into_place

    swap_into_place(new, target)
