"""FSDP helpers: resolve the decoder-layer classes named in `model.decoder_layers`; FSDP2 sharding for the logprob
path (`shard_for_logprobs`); a gradient-norm clip that works on DTensor shards."""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def layer_classes(names: list[str]) -> set[type[nn.Module]]:
    """{class} for each dotted name, e.g. `transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer`."""
    classes = set()
    for name in names:
        module_name, _, class_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"model.decoder_layers: cannot import '{name}' ({err}); use module.ClassName") from err
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"model.decoder_layers: '{name}' is not a torch.nn.Module class")
        classes.add(cls)
    return classes


def shard_for_logprobs(lm: nn.Module, mesh, layer_names: list[str], frozen: bool = False) -> nn.Module:
    """FSDP2: one `fully_shard` unit per decoder layer, and a `MaskedLogprobs(lm)` wrapper as the root unit.

    Returns the wrapper; call it instead of `masked_token_logprobs(lm, ...)`. `lm` keeps its own class and
    parameter names (now DTensor shards). `frozen` (the reference model: no-grad forwards only) reshards the root
    after each forward, which otherwise stays gathered until a backward that never comes.
    """
    from torch.distributed.fsdp import fully_shard

    from dspo.models.logprobs import MaskedLogprobs

    classes = tuple(layer_classes(layer_names))
    layers = [m for m in lm.modules() if isinstance(m, classes)]
    if not layers:
        raise ValueError(
            f"model.decoder_layers={layer_names}: no module of {type(lm).__name__} is one of these classes; name "
            "the model's decoder layer class (FSDP shards per layer)"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    wrapper = MaskedLogprobs(lm)
    fully_shard(wrapper, mesh=mesh, reshard_after_forward=True if frozen else None)
    return wrapper


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` whose returned norm is a plain tensor also under FSDP2.

    With DTensor gradients torch computes the norm over all shards (clipping uses that global norm) and returns it as
    a DTensor; `full_tensor()` makes it the same plain value on every rank, for logging and the finiteness check."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
