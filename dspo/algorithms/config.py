"""`AlgorithmConfig`: one object for every algorithm variant (dspo, gspo, dapo, grpo, and registered ones); the YAML
files in conf/algorithm/ are constructor calls of this class. Validated on construction, errors name the config key.

The choices by name resolve to registry records here, once: `objective` (`algorithm.loss`, with its settings from
`algorithm.loss_kwargs`), `group_filter` (`algorithm.filter`) and `estimator` (`algorithm.advantage`, with
`algorithm.advantage_kwargs`). Each record's own settings are validated by it (`dspo.algorithms.registry`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dspo.algorithms.advantages import ADVANTAGES, AdvantageEstimator
from dspo.algorithms.filters import FILTERS, GroupFilter
from dspo.algorithms.losses import KL_ESTIMATORS, OBJECTIVES, Objective
from dspo.algorithms.rollout_correction import RolloutCorrectionConfig, correction_level, sequence_modes


@dataclass
class AlgorithmConfig:
    name: str = "dspo"
    loss: str = "dspo"  # an objective of dspo.algorithms.losses.OBJECTIVES
    loss_kwargs: dict = field(default_factory=dict)  # the objective's own settings (dspo: clip_low, clip_high)
    filter: str = "mixed_outcome"  # a filter of dspo.algorithms.filters.FILTERS
    advantage: str = "group_norm"  # an estimator of dspo.algorithms.advantages.ADVANTAGES
    advantage_kwargs: dict = field(default_factory=dict)  # the estimator's own settings (group_norm: eps)
    group_size: int = 5  # G
    batch_groups: int = 8  # B: groups per round (all processes together)
    num_minibatches: int = 1  # M: optimizer steps per round (1 = fully on-policy)
    micro_batch_size: int = 8  # sequences per forward/backward (gradient accumulation inside a mini-batch)
    # tokens per forward/backward instead (padded: sequences x the longest), packed longest first; None = by count
    micro_batch_tokens: int | None = None
    kl_coef: float = 0.0  # β; 0 = no reference model is loaded
    kl_estimator: str = "k3"
    temperature: float = 1.0  # rollout sampling temperature; trainer logprobs use the same
    max_sampling_rounds: int = 20  # engine calls per round before giving up
    initial_keep_rate: float = 0.5  # prior of the filter's keep-rate for over-sampling
    max_prompts_per_call: int = 256
    logprob_chunk_size: int = 2048
    # engine/trainer mismatch weights (Hydra passes a dict, converted below); default as conf/algorithm/dspo.yaml
    rollout_correction: RolloutCorrectionConfig = field(default_factory=lambda: RolloutCorrectionConfig("seq_tis"))

    def __post_init__(self) -> None:
        def fail(key: str, why: str) -> None:
            raise ValueError(f"algorithm.{key}: {why}")

        if self.loss not in OBJECTIVES:
            fail("loss", f"unknown objective '{self.loss}'; choose one of {sorted(OBJECTIVES)}")
        if self.filter not in FILTERS:
            fail("filter", f"unknown group filter '{self.filter}'; choose one of {sorted(FILTERS)}")
        if self.advantage not in ADVANTAGES:
            fail("advantage", f"unknown advantage estimator '{self.advantage}'; choose one of {sorted(ADVANTAGES)}")
        for key in ("loss_kwargs", "advantage_kwargs"):
            if not isinstance(getattr(self, key), Mapping):
                fail(key, f"must be a mapping of settings, got {type(getattr(self, key)).__name__}")
            setattr(self, key, dict(getattr(self, key)))  # plain: hyper-parameters and checkpoints load weights_only
        self._objective_settings = self.objective.make_settings(self.loss_kwargs)
        self._advantage_settings = self.estimator.make_settings(self.advantage_kwargs)
        if self.group_size < 2:
            fail("group_size", f"must be >= 2 for group-normalized advantages, got {self.group_size}")
        if self.batch_groups < 1:
            fail("batch_groups", f"must be >= 1, got {self.batch_groups}")
        if self.num_minibatches < 1 or (self.batch_groups * self.group_size) % self.num_minibatches:
            fail(
                "num_minibatches",
                f"must divide B*G={self.batch_groups * self.group_size}, got {self.num_minibatches}",
            )
        if self.micro_batch_size < 1:
            fail("micro_batch_size", f"must be >= 1, got {self.micro_batch_size}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            fail(
                "micro_batch_tokens",
                f"must be >= 1 (or null: micro_batch_size sequences), got {self.micro_batch_tokens}",
            )
        if self.kl_coef < 0:
            fail("kl_coef", f"must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            fail("kl_estimator", f"unknown estimator '{self.kl_estimator}'; choose one of {sorted(KL_ESTIMATORS)}")
        if self.temperature <= 0:
            fail("temperature", f"must be > 0, got {self.temperature}")
        self._check_rollout_correction()

    # ----------------------------------------------------------------------------------------- the resolved records
    @property
    def objective(self) -> Objective:
        return OBJECTIVES[self.loss]

    @property
    def objective_settings(self) -> Any:
        """The objective's settings: its defaults with `loss_kwargs` applied."""
        return self._objective_settings

    @property
    def group_filter(self) -> GroupFilter:
        return FILTERS[self.filter]

    @property
    def estimator(self) -> AdvantageEstimator:
        return ADVANTAGES[self.advantage]

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """The configured estimator on outcome rewards [N, G] -> advantages [N, G]."""
        return self.estimator(rewards, self._advantage_settings)

    def _check_rollout_correction(self) -> None:
        correction = self.rollout_correction
        if isinstance(correction, Mapping):  # Hydra (and checkpoint hyperparameters) hand over a plain dict
            unknown = set(correction) - {"mode", "low", "high"}
            if unknown:
                raise ValueError(f"algorithm.rollout_correction: unknown keys {sorted(unknown)}; use mode, low, high")
            correction = self.rollout_correction = RolloutCorrectionConfig(**correction)
        if not isinstance(correction, RolloutCorrectionConfig):
            raise TypeError(
                f"algorithm.rollout_correction must be a mapping with mode/low/high, got {type(correction).__name__}"
            )
        level = correction_level(correction.mode)
        if self.objective.ratio_level == "sequence" and level != "sequence":
            raise ValueError(
                f"algorithm.rollout_correction.mode: '{correction.mode}' weighs single tokens, but objective "
                f"'{self.loss}' has one ratio per sequence; use {sequence_modes()}"
            )

    def check_world_size(self, world_size: int) -> None:
        """Per-rank split (issue 20): each of W processes fills B/W groups and cuts its (B/W)·G sequences into M
        mini-batches, so both divisions must be exact. Called when the run is built (RolloutCallback.setup)."""
        if world_size < 1 or self.batch_groups % world_size:
            raise ValueError(
                f"algorithm.batch_groups={self.batch_groups} must be divisible by the process count "
                f"(trainer.devices x nodes = {world_size})"
            )
        per_rank = self.batch_groups // world_size * self.group_size
        if per_rank % self.num_minibatches:
            raise ValueError(
                f"algorithm.num_minibatches={self.num_minibatches} must divide the sequences per process "
                f"(algorithm.batch_groups / trainer.devices) * algorithm.group_size = {per_rank} with "
                f"{world_size} processes; change one of these keys"
            )
