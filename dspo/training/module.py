"""`DSPOModule`: the policy and its frozen reference model; one optimizer step per train batch.

Manual optimization, on purpose: a train batch is one mini-batch of a round (one optimizer step), split into
micro-batches for memory. The objective's normalizer is the whole mini-batch's sequence (or token) count, so the
accumulated gradient equals the mini-batch gradient exactly; token counts are summed over ranks and divided by their
number, so that DDP/FSDP's gradient averaging yields the global token mean (`losses.token_normalizer`).
`weights_version` counts the optimizer steps applied: the environment pushes weights to the engine when it moves.
A step whose loss or gradient is not finite is skipped with a warning; `max_consecutive_skips` of them in a row stop
the run with a checkpoint.

Old logprobs (Algorithm 1, step 3): with M = 1 mini-batch per round the data is exactly on-policy and logπ_old is the
detached current logπ (s_i = 1 in value, gradient as in Eq. 8) — one forward saved. With M > 1 they are computed for
the whole round in the round's first step, before its first update. Both happen inside `training_step`, so FSDP's
root parameters are gathered as in any forward. That logπ_old is also what the rollout-correction weights compare with
the engine's logprobs (`algorithm.rollout_correction`, logged as `mismatch/*` every step whatever the mode).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from dspo.algorithms.blocks import loss_normalizer, token_normalizer
from dspo.algorithms.config import AlgorithmConfig
from dspo.algorithms.losses import kl_penalty
from dspo.algorithms.rollout_correction import correction_weights
from dspo.data.datamodule import EvalSlot, RoundSlot
from dspo.eval.answer_metrics import answer_metrics
from dspo.models import ModelConfig, load_causal_lm, lora
from dspo.models.fsdp import clip_grad_norm
from dspo.models.logprobs import masked_token_logprobs
from dspo.models.lora import adapters_disabled, add_adapters, check_same_lora, is_adapter_key, lora_config
from dspo.runs.record import with_index
from dspo.training.step_stats import MiniBatchStats
from dspo.types import PolicyBatch, StepReport

log = logging.getLogger(__name__)


@dataclass
class OptimizerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    max_consecutive_skips: int = 3
    # torch's fused AdamW kernel (one pass over each parameter; CPU and CUDA): null = use it where torch supports the
    # parameters, else the multi-tensor one; true = require it; false = the multi-tensor one (foreach)
    fused: bool | None = None

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.max_consecutive_skips < 1:
            raise ValueError("optimizer.warmup_steps must be >= 0 and optimizer.max_consecutive_skips >= 1")
        self.betas = tuple(self.betas)


def train_mode_without_dropout(model: nn.Module) -> None:
    """Train mode (Hugging Face returns models in eval mode, where its gradient checkpointing never acts) with every
    dropout at 0: the trainer must score exactly the distribution the engine sampled from (TRL's default too)."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if hasattr(model, "config") and isinstance(getattr(model.config, "attention_dropout", None), float):
        model.config.attention_dropout = 0.0


def build_adamw(params: list[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW with `cfg.fused` resolved: the fused kernel where torch runs it for these parameters (bench/README.md: the
    AdamW step of a 151k-vocabulary model), else the multi-tensor implementation."""
    kwargs = {"lr": cfg.lr, "betas": cfg.betas, "weight_decay": cfg.weight_decay}
    if cfg.fused is False:
        return torch.optim.AdamW(params, foreach=True, **kwargs)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError) as err:  # a device or dtype the fused kernel does not cover
        if cfg.fused:
            raise ValueError(f"optimizer.fused=true, but torch has no fused AdamW for these parameters: {err}") from err
        return torch.optim.AdamW(params, foreach=True, **kwargs)


@dataclass(frozen=True)
class MiniBatchCounts:
    """What a mini-batch's micro-batches are normalized by (`DSPOModule._counts`)."""

    sequences: int  # this rank's sequences
    tokens: float  # this rank's trained tokens
    objective: float  # the objective's normalizer (its unit, counted over the mini-batch and all ranks)
    kl: float  # the KL's token normalizer (all ranks)
    episodes: int = 0  # this rank's episodes (its sequences, unless some episode is split into samples)


class NonFiniteTraining(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


def _safe_key(name: str) -> str:
    return name.replace(".", "_").replace("/", "_")


class DSPOModule(pl.LightningModule):
    def __init__(self, model: ModelConfig, algorithm: AlgorithmConfig, optimizer: OptimizerConfig) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = (
            False  # the frozen reference model (and, with LoRA, the frozen base) is not in checkpoints
        )
        self.model_cfg, self.algo, self.optim_cfg = model, algorithm, optimizer
        # in checkpoints; loggers get the whole resolved config (dspo.training.loggers) instead
        self.save_hyperparameters(
            {"model": asdict(model), "algorithm": asdict(algorithm), "optimizer": asdict(optimizer)}, logger=False
        )
        self.policy: nn.Module | None = None
        self.reference: nn.Module | None = None
        self.run_record: dict | None = None  # the run's settings (dspo.runs.record), set by dspo.train: in checkpoints
        self.eval_metrics = nn.ModuleDict()
        self._skipped_in_a_row = 0
        self.weights_version = 0  # optimizer steps applied; the engine is re-synced whenever it moves
        self.step_report: StepReport | None = None  # the last optimizer step, for the guard (dspo.guard)
        self._checkpoint_lr: float | None = None  # optimizer.lr of the run a resumed checkpoint was written by
        # FSDP2 only: {"policy"|"reference": MaskedLogprobs root unit}, a plain dict so that they stay out of the
        # module tree (parameter names stay `policy.*`); see dspo.models.fsdp.shard_for_logprobs
        self._sharded_logprobs: dict[str, nn.Module] = {}

    # ----------------------------------------------------------------------------------------------- model
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self.policy = load_causal_lm(self.model_cfg)
        self.policy.config.use_cache = False
        train_mode_without_dropout(self.policy)
        if self.model_cfg.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.model_cfg.lora is not None:  # after the dropout reset: the adapters' own dropout is model.lora's
            add_adapters(self.policy, self.model_cfg.lora)
        elif self.algo.kl_coef > 0:  # with LoRA the reference is the policy with its adapters off (_reference_logprobs)
            self.reference = load_causal_lm(self.model_cfg).eval().requires_grad_(False)
        if self.device_mesh is not None:  # FSDP2 (dspo.training.strategies.FSDP2Strategy)
            self._shard(self.device_mesh["data_parallel"])

    def _shard(self, mesh) -> None:
        """FSDP2: shard per decoder layer, with a logprob wrapper as the root unit of each model."""
        from dspo.models.fsdp import shard_for_logprobs

        layers = self.model_cfg.decoder_layers
        self._sharded_logprobs["policy"] = shard_for_logprobs(self.policy, mesh, layers)
        if self.reference is not None:
            self._sharded_logprobs["reference"] = shard_for_logprobs(self.reference, mesh, layers, frozen=True)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        names = list(getattr(datamodule, "val_benchmarks", [])) + list(getattr(datamodule, "test_benchmarks", []))
        for stage_name in ("val", "test"):
            for name in dict.fromkeys(names):
                key = f"{stage_name}__{_safe_key(name)}"
                if key not in self.eval_metrics:
                    self.eval_metrics[key] = answer_metrics().clone(prefix=f"{stage_name}/{name}/")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if k.startswith("reference.") or self._frozen_base_key(k)]:
            del state[key]
        checkpoint["dspo"] = {"model_dir": self.model_cfg.path, "weights_version": self.weights_version}
        if self.model_cfg.lora is not None:  # the adapters hold only on this base: resume compares (check_same_base)
            checkpoint["dspo"]["base_digest"] = lora.base_digest(self.model_cfg.path)
        if self.run_record is not None:  # what dspo-eval / dspo-rollout adopt from this checkpoint (dspo.runs.record)
            checkpoint["dspo"]["run"] = with_index(self.run_record)

    def _frozen_base_key(self, key: str) -> bool:
        """With LoRA, the policy's frozen base weights: reloaded from model.path, never stored in checkpoints."""
        return self.model_cfg.lora is not None and key.startswith("policy.") and not is_adapter_key(key)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = (checkpoint.get("hyper_parameters") or {}).get("model")
        if isinstance(saved, dict):  # the state dict loads non-strictly: a LoRA mismatch would pass in silence
            check_same_lora(lora_config(saved.get("lora")), self.model_cfg.lora)
        if self.model_cfg.lora is not None:
            lora.check_same_base(checkpoint.get("dspo") or {}, self.model_cfg.path)
        self.weights_version = int(checkpoint.get("dspo", {}).get("weights_version", checkpoint.get("global_step", 0)))
        saved_lr = ((checkpoint.get("hyper_parameters") or {}).get("optimizer") or {}).get("lr")
        self._checkpoint_lr = float(saved_lr) if isinstance(saved_lr, int | float) else None

    def on_train_start(self) -> None:
        """A run resumed with another `optimizer.lr` trains at the new rate: Lightning restored the scheduler's base
        rates (and the optimizer's current ones) from the checkpoint, which would ignore it. Both are scaled by
        new / old, so a factor the guard applied (its backoffs) is kept."""
        old, self._checkpoint_lr = self._checkpoint_lr, None
        if old is None or old <= 0 or old == self.optim_cfg.lr:
            return
        factor = self.optim_cfg.lr / old
        scheduler = self.lr_schedulers()
        scheduler.base_lrs = [base * factor for base in scheduler.base_lrs]
        for group in scheduler.optimizer.param_groups:
            group["lr"] *= factor
        log.warning(
            "optimizer.lr changed on resume (%g -> %g): training goes on at the new rate", old, self.optim_cfg.lr
        )

    # ----------------------------------------------------------------------------------------------- train
    def _logprobs(self, model: nn.Module, batch: PolicyBatch, with_entropy: bool = False):
        name = "policy" if model is self.policy else "reference" if model is self.reference else ""
        runner = self._sharded_logprobs.get(name)  # FSDP2: the root unit, whose forward hooks gather its parameters
        return (partial(masked_token_logprobs, model) if runner is None else runner)(
            batch.input_ids,
            batch.attention_mask,
            batch.loss_mask,
            temperature=self.algo.temperature,
            chunk_size=self.algo.logprob_chunk_size,
            with_entropy=with_entropy,
        )

    @property
    def has_reference(self) -> bool:
        """Whether the loss has a KL term: a reference model, or (LoRA) the policy with its adapters off."""
        return self.algo.kl_coef > 0

    @torch.no_grad()
    def _reference_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        if self.reference is not None:
            return self._logprobs(self.reference, batch)[0]
        with adapters_disabled(self.policy):  # LoRA: the frozen base is the reference
            return self._logprobs(self.policy, batch)[0]

    @torch.no_grad()
    def _prepare_round(self, batches: list[PolicyBatch]) -> None:
        """Old (when M > 1) and reference (when β > 0) logprobs, before the round's first update."""
        for batch in batches:
            moved = batch.to(self.device)
            if self.algo.num_minibatches > 1 and batch.old_logprobs is None:
                batch.old_logprobs = self._logprobs(self.policy, moved)[0].cpu()
            if self.has_reference and batch.ref_logprobs is None:
                batch.ref_logprobs = self._reference_logprobs(moved).cpu()

    def training_step(self, slot: RoundSlot, batch_idx: int) -> torch.Tensor | None:
        """Algorithm 1, steps 3-4, for one mini-batch of a round (one optimizer step): the round's old and reference
        logprobs on its first step; each micro-batch's loss and backward; the update; the step's logs. A non-finite
        loss or gradient on any rank skips the step on every rank."""
        if not slot.micro_batches:
            raise RuntimeError("empty train batch: RolloutCallback must be in trainer.callbacks (conf/callbacks)")
        self.step_report = None  # set by this step's update or skip
        if slot.round_batches:
            self._prepare_round(slot.round_batches)
        micro = [b.to(self.device) for b in slot.micro_batches]
        counts = self._counts(micro)
        stats = MiniBatchStats(counts.sequences, counts.tokens, len(micro), counts.episodes)
        for batch in micro:
            loss, parts = self.micro_batch_loss(batch, counts)
            if not self._all_ranks_finite(loss):  # agreed before the backward's collectives (DDP, FSDP)
                return self._skip_step(slot)
            self.manual_backward(loss)
            stats.add(batch, loss, **parts)
        grad_norm = self._clip_gradients()
        if not self._all_ranks_finite(grad_norm):
            return self._skip_step(slot)
        lr = self._optimizer_step()
        self._log_step(stats, micro, grad_norm, lr, slot)
        return torch.tensor(stats.totals["train/loss"])

    def _counts(self, micro: list[PolicyBatch]) -> MiniBatchCounts:
        """The mini-batch's sequences and episodes (this rank) and trained tokens (this rank, and all ranks), and the
        normalizers that make gradient accumulation give the mini-batch's loss: a sequence mean counts episodes (an
        episode's samples share its weight, `PolicyBatch.sample_scale`), a token mean tokens, both summed over ranks
        and divided by their number (DDP and FSDP average the ranks' gradients)."""
        num_sequences = sum(len(b) for b in micro)
        num_episodes = sum(int(b.episode_heads().sum()) for b in micro)
        num_tokens = float(sum(b.loss_mask.sum() for b in micro))
        world = self.trainer.world_size if self._trainer is not None else 1
        global_tokens, global_episodes = float(num_tokens), float(num_episodes)
        if world > 1:
            global_tokens, global_episodes = self._all_ranks_sum([num_tokens, float(num_episodes)])
        objective = loss_normalizer(self.algo.objective.normalizer_unit, global_episodes / world, global_tokens, world)
        kl = token_normalizer(global_tokens, world)
        return MiniBatchCounts(num_sequences, num_tokens, objective, kl, num_episodes)

    def micro_batch_loss(self, batch: PolicyBatch, counts: MiniBatchCounts) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss of one micro-batch (the objective, + β·KL), normalized by the whole mini-batch, and its parts:
        `kl`, `entropy` [N, L], the objective's statistics, the engine/trainer mismatch statistics and the correction
        weights [N, L]."""
        logprobs, entropy = self._logprobs(self.policy, batch, with_entropy=True)
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        correction, mismatch = self._rollout_correction(old, batch)
        loss, objective = self.algo.objective.compute(  # `episodes` reaches objectives that take them (one ratio each)
            logprobs,
            old,
            batch.advantages,
            batch.loss_mask,
            self.algo.objective_settings,
            normalizer=counts.objective,
            weights=self._episode_share(correction, batch),
            episodes=batch.episode_ids,
        )
        kl = torch.zeros((), device=self.device)
        if self.has_reference:
            ref = batch.ref_logprobs if batch.ref_logprobs is not None else self._reference_logprobs(batch)
            kl = kl_penalty(logprobs, ref, batch.loss_mask, self.algo.kl_estimator, counts.kl)
            loss = loss + self.algo.kl_coef * kl
        parts = {"kl": kl, "entropy": entropy, "objective": objective, "mismatch": mismatch, "correction": correction}
        return loss, parts

    def _episode_share(self, weights: torch.Tensor, batch: PolicyBatch) -> torch.Tensor:
        """A sequence-mean objective's weights [N, L] times each row's share of its episode's trained tokens
        (`PolicyBatch.sample_scale`), so that a split episode contributes what it would unsplit; a token mean weighs
        every token once already. The shares of an episode's rows add to 1: an objective with one ratio per episode
        (dspo, gspo: `Objective.takes_episodes`) counts the episode's clipped term once, and grpo's per-row token mean
        becomes the episode's token mean."""
        if self.algo.objective.normalizer_unit != "sequence" or batch.sample_scale is None:
            return weights
        return weights * batch.sample_scale.to(weights)[:, None]  # exact where the scale is 1: unsplit runs unchanged

    def _optimizer_step(self) -> float:
        """AdamW step, then the scheduler's; returns the learning rate the step applied."""
        optimizer = self.optimizers()
        self._skipped_in_a_row = 0
        lr = float(optimizer.param_groups[0]["lr"])  # the rate this step applies (the scheduler then moves it)
        optimizer.step()
        self.weights_version += 1
        optimizer.zero_grad(set_to_none=True)
        self.lr_schedulers().step()
        return lr

    def _skip_step(self, slot: RoundSlot) -> None:
        self.optimizers().zero_grad(set_to_none=True)
        self.step_report = StepReport(skipped=True)
        self._on_non_finite(slot)

    def _log_step(
        self, stats: MiniBatchStats, micro: list[PolicyBatch], grad_norm: torch.Tensor, lr: float, slot: RoundSlot
    ) -> None:
        totals = stats.totals
        heads = torch.cat([b.episode_heads() for b in micro])  # statistics of episodes count episodes, not samples
        rewards = torch.cat([b.rewards for b in micro])[heads]
        lengths = torch.cat([b.loss_mask.sum(1) for b in micro])
        tokens_per_episode = lengths.mean() if bool(heads.all()) else lengths.sum() / heads.sum().clamp(min=1)
        totals.update(
            {
                "train/reward_mean": float(rewards.mean()),
                "train/response_tokens_mean": float(tokens_per_episode),
                "train/samples_per_episode": len(heads) / max(int(heads.sum()), 1),  # > 1: some episode was split
                "train/grad_norm": float(grad_norm),
                "train/lr": lr,
                "train/policy_version": float(slot.round_index),
            }
        )
        self.log_dict(totals, on_step=True, prog_bar=False, batch_size=stats.num_sequences)
        self.log("reward", totals["train/reward_mean"], prog_bar=True, logger=False, batch_size=stats.num_sequences)
        self.step_report = StepReport(
            entropy=totals["train/entropy"],
            response_tokens=totals["train/response_tokens_mean"],
            grad_norm=totals["train/grad_norm"],
        )

    def _all_ranks_finite(self, value: torch.Tensor) -> bool:
        """Whether `value` is finite on every rank. One rank deciding alone would skip a backward (or an optimizer
        step) that the others run, and their gradient all-reduce (DDP; reduce-scatter under FSDP) would wait for it."""
        finite = bool(torch.isfinite(value))
        if self._trainer is None or self.trainer.world_size == 1:
            return finite
        return bool(self.trainer.strategy.reduce_boolean_decision(finite, all=True))

    def _all_ranks_sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (one collective)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        return [float(v) for v in self.trainer.strategy.reduce(tensor, reduce_op="sum")]

    def _rollout_correction(self, old: torch.Tensor, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """Weights [N, L] for the objective and mismatch stats: logπ_old (as the objective uses it) vs the engine's."""
        if batch.engine_logprobs is None:
            raise RuntimeError(
                "PolicyBatch.engine_logprobs is missing: build train batches with "
                "dspo.data.round_builder.collate_trajectories"
            )
        cfg = self.algo.rollout_correction
        mask, engine = batch.loss_mask, batch.engine_logprobs
        return correction_weights(old, engine, mask, cfg.mode, cfg.low, cfg.high, episodes=batch.episode_ids)

    def _clip_gradients(self) -> torch.Tensor:
        root = self.trainer.strategy.model if self.trainer is not None else self
        if hasattr(root, "clip_grad_norm_"):  # FSDP root: norm over all shards
            return root.clip_grad_norm_(self.optim_cfg.max_grad_norm)
        params = [p for p in self.policy.parameters() if p.grad is not None]
        return clip_grad_norm(params, self.optim_cfg.max_grad_norm)  # FSDP2: global norm over the DTensor shards

    def _on_non_finite(self, slot: RoundSlot) -> None:
        self._skipped_in_a_row += 1
        log.warning(
            "non-finite loss or gradient at round %d mini-batch %d: step skipped (%d in a row)",
            slot.round_index,
            slot.minibatch_index,
            self._skipped_in_a_row,
        )
        self.log("train/skipped_steps", float(self._skipped_in_a_row), on_step=True, batch_size=1)
        if self._skipped_in_a_row >= self.optim_cfg.max_consecutive_skips:
            path = Path(self.trainer.default_root_dir) / "checkpoints" / "non_finite.ckpt"
            self.trainer.save_checkpoint(str(path), weights_only=False)  # full: optimizer + loops
            raise NonFiniteTraining(
                f"{self._skipped_in_a_row} consecutive non-finite steps (optimizer.max_consecutive_skips); "
                f"checkpoint saved to {path}. Lower optimizer.lr or check the data of round {slot.round_index}."
            )

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = build_adamw(params, self.optim_cfg)
        warmup = self.optim_cfg.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------------------------------------- eval
    def _eval_step(self, stage: str, slot: EvalSlot, dataloader_idx: int) -> None:
        """Score the greedy predictions the environment callback put into the batch (`EvalSlot.predictions`)."""
        if not isinstance(slot, EvalSlot) or slot.predictions is None:
            raise RuntimeError(
                f"{stage}: the batch carries no predictions; RolloutCallback (conf/callbacks) makes them at "
                f"on_{'validation' if stage == 'val' else 'test'}_batch_start from the RolloutDataModule's EvalSlot"
            )
        datamodule = self.trainer.datamodule
        names = datamodule.val_benchmarks if stage == "val" else datamodule.test_benchmarks
        metrics = self.eval_metrics[f"{stage}__{_safe_key(names[dataloader_idx])}"]
        metrics.update([p.answer for p in slot.predictions], [p.golden_answers for p in slot.predictions])

    def validation_step(self, slot: EvalSlot, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step("val", slot, dataloader_idx)

    def test_step(self, slot: EvalSlot, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step("test", slot, dataloader_idx)

    def _log_eval(self, stage: str) -> None:
        values: dict[str, torch.Tensor] = {}
        for key, metrics in self.eval_metrics.items():
            if not key.startswith(f"{stage}__") or not any(m.update_called for m in metrics.values()):
                continue
            values.update(metrics.compute())
            metrics.reset()
        if values:
            subems = [v for k, v in values.items() if k.endswith("/subem")]
            values[f"{stage}/subem_mean"] = torch.stack(subems).mean()
            scalars = {k: float(v) for k, v in values.items()}
            # already reduced across processes by torchmetrics; sync_dist only silences Lightning's warning. Lightning
            # would log a validation after k updates at x = k - 1 (its batch index); loggers get x = k instead, so
            # the step-0 validation (callbacks.validate_at_start) is the warm start and x counts applied updates.
            # (trainer.test() returns only logger=True metrics: test keeps Lightning's logging, at the final step.)
            self.log_dict(scalars, sync_dist=True, add_dataloader_idx=False, logger=stage == "test")
            if stage != "test":
                for logger in self.loggers:
                    logger.log_metrics(scalars, step=self.global_step)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")
