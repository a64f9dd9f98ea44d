"""One model exporter: a trained policy as a Hugging Face model folder the engines, `dspo-eval` and `dspo-rollout`
load. The end of training (`dspo.callbacks.rollout_callback.RolloutCallback.export`, from the policy in memory) and
`dspo-eval ckpt_path=...` (`dspo.eval.cli.export_checkpoint`, from a checkpoint and the base model folder on disk)
both write theirs with `export_model`.

A folder holds the policy's weights with any LoRA adapters merged in, its config and tokenizer files, and the record
of the run that trained it (`dspo_run.json`, `dspo.runs.record`; the settings dspo-eval and dspo-rollout adopt). A LoRA
policy's adapter is also written, as a peft adapter folder beside it (`<folder>_adapter`, `dspo.models.lora`).

The config and tokenizer files come from one of two sources (`ModelFiles`): the model in memory writes its own
(`InMemoryModel`: Hugging Face's `save_pretrained`), or the base model folder's are copied beside weights written here
(`BaseModelFolder`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dspo.models.lora import LoraConfig, adapter_dir, save_adapter

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")
MAX_SHARD_SIZE = "5GB"  # Hugging Face's default: a bigger policy is written as shards with an index


class ModelFiles(Protocol):
    """Writes a model folder's config, tokenizer and weight files."""

    def write(self, folder: Path, weights: dict[str, torch.Tensor]) -> None: ...


@dataclass(frozen=True)
class InMemoryModel:
    """The policy in memory writes its config, generation config and `weights` (`save_pretrained`), its tokenizer
    the tokenizer files."""

    model: Any  # a transformers PreTrainedModel (the architecture `weights` belong to)
    tokenizer: Any

    def write(self, folder: Path, weights: dict[str, torch.Tensor]) -> None:
        self.model.save_pretrained(str(folder), state_dict=weights)
        self.tokenizer.save_pretrained(str(folder))


@dataclass(frozen=True)
class BaseModelFolder:
    """The files of the base model folder `path` but its weights and run record (config, generation config,
    tokenizer) are copied; `weights` are written as safetensors (shards of at most 5 GB, with an index)."""

    path: str

    def write(self, folder: Path, weights: dict[str, torch.Tensor]) -> None:
        from huggingface_hub import split_torch_state_dict_into_shards
        from safetensors.torch import save_file

        from dspo.runs.record import RECORD_FILE

        folder.mkdir(parents=True, exist_ok=True)
        for item in Path(self.path).iterdir():  # config, generation config, tokenizer files: everything but weights
            skip = item.name.endswith(WEIGHT_SUFFIXES) or item.name.endswith(".index.json") or item.name == RECORD_FILE
            if item.is_file() and not skip:
                shutil.copy2(item, folder / item.name)
        split = split_torch_state_dict_into_shards(weights, max_shard_size=MAX_SHARD_SIZE)
        for filename, names in split.filename_to_tensors.items():
            tensors = {name: weights[name].contiguous() for name in names}
            save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@dataclass(frozen=True)
class Adapter:
    """A LoRA policy's adapter, written as a peft adapter folder beside the merged model."""

    config: LoraConfig  # model.lora: rank, alpha, dropout, target modules
    weights: Sequence[tuple[str, torch.Tensor]]  # the policy's unmerged weights, or its adapters only ('.lora_' keys)
    base_model: str  # the base model's folder, recorded for peft


@dataclass(frozen=True)
class ExportedModel:
    folder: Path  # the Hugging Face model folder
    adapter: Path | None  # the peft adapter folder beside it (LoRA policies), else None


def export_model(
    folder: str | Path,
    weights: dict[str, torch.Tensor],
    files: ModelFiles,
    record: Mapping[str, Any] | None = None,
    step: int | None = None,
    adapter: Adapter | None = None,
) -> ExportedModel:
    """Write the policy's `weights` (Hugging Face names; LoRA adapters already merged in) with `files`' config and
    tokenizer to `folder`, the run `record` (None: none; `step`: the training step it was exported at) and the LoRA
    `adapter` beside it (None: not a LoRA policy)."""
    from dspo.runs.record import write_record

    target = Path(folder)
    files.write(target, weights)
    if record is not None:  # the settings it was trained with, which dspo-eval and dspo-rollout adopt
        write_record(target, record, step)
    written = None
    if adapter is not None:
        written = save_adapter(adapter_dir(target), adapter.config, adapter.weights, adapter.base_model)
    return ExportedModel(target, written)
