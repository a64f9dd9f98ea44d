"""Full (unsharded) policy weights for the engine push and the final export.

Under FSDP1 the parameters live as flat shards; a full state dict of the *root* wrapped module is gathered once per
round (`FULL_STATE_DICT`, offloaded to CPU) and the policy's entries are picked by prefix. Under FSDP2 (`fully_shard`,
`dspo.training.strategies.FSDP2Strategy`) each parameter is a DTensor shard: the policy's entries are picked first and
gathered one by one (`full_tensor()`, an all-gather every rank joins, in the same order), so the reference model is
never gathered; every rank gets the full weights, as every rank pushes them into its own engine. Wrapper prefixes that
FSDP and activation checkpointing insert into names are removed so names match the Hugging Face checkpoint the engine
loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from dspo.models.lora import is_adapter_key, lora_scalings, merge_adapters
from dspo.models.names import clean_parameter_name


def select_prefixed(state_dict: dict[str, torch.Tensor], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name without prefix, tensor) for every clean name under `prefix` (e.g. "policy.")."""
    for name, tensor in state_dict.items():
        clean = clean_parameter_name(name)
        if clean.startswith(prefix):
            yield clean[len(prefix) :], tensor


def full_state_dict(root: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with every tensor whole, whether `root` is FSDP1-wrapped, FSDP2-sharded or neither."""
    if not _is_fsdp1(root):
        return dict(_gathered(root.state_dict(keep_vars=True).items()))
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, config):
        return root.state_dict()


def _is_fsdp1(root: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FSDP) for m in root.modules())


def _gathered(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole detached tensor); DTensor shards are all-gathered (once per tensor: tied weights share one) and
    moved to the CPU, as FSDP1's `offload_to_cpu` does, so a full copy never sits beside the shards on the GPU."""
    from torch.distributed.tensor import DTensor

    done: dict[int, torch.Tensor] = {}
    for name, tensor in items:
        if isinstance(tensor, DTensor):
            if id(tensor) not in done:
                done[id(tensor)] = tensor.detach().full_tensor().cpu()
            yield name, done[id(tensor)]
        else:
            yield name, tensor.detach()


def policy_weights(root: nn.Module, prefix: str = "policy.", merged: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The policy's full weights with Hugging Face names, detached. Under FSDP every rank must call it.

    With LoRA adapters (`model.lora`) the whole tensors are gathered first, then merged (`merge_adapters`: the base
    weight plus the scaled low-rank update, under the base model's names), so any wrapper or sharding pushes the same
    plain model; `merged=False` returns the adapters' and base layers' own tensors (the adapter export)."""
    if _is_fsdp1(root):
        weights = [(name, tensor.detach()) for name, tensor in select_prefixed(full_state_dict(root), prefix)]
    else:
        weights = list(_gathered(select_prefixed(root.state_dict(keep_vars=True), prefix)))
    if not merged or not any(is_adapter_key(name) for name, _ in weights):
        return weights
    return merge_adapters(weights, lora_scalings(root, prefix))
