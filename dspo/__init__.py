"""dspo: train LLM search agents with DSPO (sequence-level clipped policy optimization + dynamic outcome filter)."""

from dspo import resources as _resources  # noqa: F401  registers ${dspo.data_dir:} for the Hydra configs

__version__ = "0.1.0"
