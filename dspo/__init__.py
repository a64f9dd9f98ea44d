"""dspo: train LLM search agents with DSPO (sequence-level clipped policy optimization + dynamic outcome filter)."""

from omegaconf import OmegaConf

from dspo.process import resources as _resources  # noqa: F401  registers ${dspo.data_dir:} for the Hydra configs

__version__ = "0.1.0"


def precision_for(accelerator: str) -> str:
    """Trainer precision that follows the accelerator (`${dspo.precision:${.accelerator}}` in conf/trainer/fsdp.yaml):
    "32-true" on the CPU (bf16 autocast there is slow and not what the CPU vLLM engine runs), "bf16-mixed" on GPUs
    (as the paper setups). "auto" counts as a GPU only when CUDA is available."""
    if accelerator == "auto":
        import torch

        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    return "32-true" if accelerator == "cpu" else "bf16-mixed"


OmegaConf.register_new_resolver("dspo.precision", precision_for, replace=True)


def by_staleness(synchronous: str, ahead: str, *, _root_) -> str:
    """`${dspo.by_staleness:A,B}` (conf/algorithm/dspo.yaml's rollout correction): A at `rollout.max_staleness` 0 or
    where the config has no rollout group, B at k >= 1 (rounds sampled by older weights: chosen by bench/correction.py,
    docs/async.md)."""
    k = OmegaConf.select(_root_, "rollout.max_staleness", default=0)
    return ahead if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else synchronous


OmegaConf.register_new_resolver("dspo.by_staleness", by_staleness, replace=True)
