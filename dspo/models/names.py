"""Parameter names without the prefixes that wrappers insert (FSDP1, activation checkpointing, `torch.compile`,
DDP), so that they match the Hugging Face checkpoint's. The bottom of `dspo.models`: `lora` and `weights` use it."""

from __future__ import annotations

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def clean_parameter_name(name: str) -> str:
    """`policy._fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight` ->
    `policy.model.layers.0.mlp.up_proj.weight`."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
