"""`Guard`: the run watches itself for collapse every round and acts (issue 55; config key `guard`).

At each round's end the detectors (`dspo.guard.detectors`) read the round's logged numbers; each one's score is
logged as `guard/<name>`, with `guard/rollbacks` and `guard/lr_scale`. When one fires, its action is taken:

- warn: a console line and a `guard.jsonl` entry;
- rollback: model, optimizer and scheduler restored from the newest checkpoint the guard marked healthy (for a
  validation drop: the checkpoint of the best validation, when one was kept), the learning rate scaled by `backoff`
  (`dspo.guard.rollback`); the sampler and RNG move on, so no prompt is replayed;
- stop: the run ends with `GuardStop` (non-zero exit), as does a rollback beyond `max_rollbacks`.

Healthy: a round's data is sampled by the weights of the previous checkpoint, so a checkpoint becomes healthy when a
later round ends with no detector firing (or suspecting the round, `Verdict.suspect`) since it was saved (a validation
after it included). The guard evaluates
before the round's checkpoint is written (Lightning runs checkpoint callbacks last), so that checkpoint holds the
restored weights after a rollback. With several ranks, rank 0's verdict is broadcast and every rank acts on it.
The run's last validation is read at once (no round follows it): a rollback asked for there ends the run on the
restored weights. The guard only reads unless it fires: a run where nothing fires trains exactly as without it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from dspo.callbacks.checkpoints import RoundCheckpoint, round_position
from dspo.guard.detectors import RoundSignals, Verdict, build_detectors
from dspo.guard.rollback import restore, set_lr_scale

log = logging.getLogger("dspo.guard")

SEVERITY = {"warn": 0, "rollback": 1, "stop": 2}


def validation_noise(trainer: pl.Trainer) -> float | None:
    """The standard error of the difference of two `val/subem_mean` values (a mean over B benchmarks of n_b
    questions each), at its widest (p = 0.5 in every benchmark): sqrt(2 * sum_b 0.25 / n_b) / B. None when the
    datamodule does not say how many questions it validates on."""
    sets = getattr(getattr(trainer, "datamodule", None), "val_sets", None) or {}
    sizes = [len(items) for items in sets.values() if len(items)]
    if not sizes:
        return None
    return math.sqrt(2 * sum(0.25 / n for n in sizes)) / len(sizes)


class GuardStop(RuntimeError):
    """The guard stopped the run (a detector whose action is stop, or more rollbacks than `guard.max_rollbacks`)."""


@dataclass(frozen=True)
class GuardEvent:
    """One `guard.jsonl` line: which detectors fired at which round on which numbers, and what was done."""

    step: int
    round_index: int
    detectors: dict[str, dict[str, Any]]  # name -> {"score", "reason", "action"}
    action: str  # warn | rollback | backoff (no healthy checkpoint yet: the rate only) | stop
    rollbacks: int
    lr_scale: float
    restored_from: str | None = None
    time: float = 0.0
    at_end: bool = False  # fired on the run's last validation: the run ends on the restored weights


class Guard(pl.Callback):
    """Args:
    enabled: false turns the guard off (no detector, no `guard/*` tag, no file).
    detectors: name -> settings (`dspo.guard.detectors.DETECTORS`; null turns one off); every detector by default.
    backoff: the learning rate is multiplied by it at each rollback (0 < backoff <= 1).
    max_rollbacks: a rollback asked for after this many stops the run instead.
    steps_per_round: M (algorithm.num_minibatches): the guard evaluates at the round's last mini-batch.
    steady_validation: false when the environment's validation moves with the step (`env.steady_validation`:
        env=simulated's noise curriculum): `val_drop` is off and no best-validation checkpoint is kept.
    """

    def __init__(
        self,
        enabled: bool = True,
        detectors: dict[str, dict[str, Any] | None] | None = None,
        backoff: float = 0.5,
        max_rollbacks: int = 3,
        steps_per_round: int = 1,
        steady_validation: bool = True,
    ) -> None:
        if not 0 < backoff <= 1:
            raise ValueError(f"guard.backoff={backoff}: must be in (0, 1] (the learning rate's factor per rollback)")
        if max_rollbacks < 0:
            raise ValueError(f"guard.max_rollbacks={max_rollbacks}: must be >= 0 (0: stop at the first rollback)")
        if steps_per_round < 1:
            raise ValueError(f"guard.steps_per_round={steps_per_round}: must be >= 1 (algorithm.num_minibatches)")
        self.enabled, self.backoff, self.max_rollbacks = enabled, backoff, max_rollbacks
        self.steps_per_round = steps_per_round
        self.detectors = build_detectors(detectors) if enabled else {}
        self.steady_validation = steady_validation
        if enabled and not steady_validation and self.detectors.pop("val_drop", None) is not None:
            log.info("guard: val_drop off: the environment's validation moves with the step (env.steady_validation)")
        self.rollbacks, self.lr_scale = 0, 1.0
        self.healthy: str | None = None  # the newest healthy checkpoint (the rollback target)
        self._healthy_at = -1  # the step of `healthy`
        self.best: str | None = None  # the checkpoint of the best validation (val_drop's target), when one was saved
        self.best_validation = float("-inf")
        self.last_fire_step = -1  # a checkpoint saved before this step is not healthy
        self.events: list[GuardEvent] = []
        self._round: dict[str, list[float]] = {}
        self._validation: float | None = None
        self._validation_noise: float | None = None

    # ------------------------------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checkpoint = self._checkpoint(trainer)
        if self.enabled and checkpoint is not None:  # resumed: protect the targets again
            checkpoint.kept = {role: path for role, path in (("healthy", self.healthy), ("best", self.best)) if path}

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.callback_metrics.get("val/subem_mean")
        if self.enabled and not trainer.sanity_checking and value is not None:
            if trainer.world_size > 1:  # every rank keeps the same files and takes the same decisions (barriers)
                value = trainer.strategy.broadcast(float(value), src=0)
            self._validation = float(value)
            self._validation_noise = validation_noise(trainer)
            if self.steady_validation:
                self._keep_best(trainer, float(value))
            if 0 < trainer.max_steps <= trainer.global_step:  # the last validation: no round follows to act on it
                self._end_check(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if not self.enabled:
            return
        self._collect_step(trainer, pl_module)
        position = round_position(batch)
        minibatch = position[1] if position is not None else trainer.global_step - 1
        if minibatch % self.steps_per_round != self.steps_per_round - 1:
            return
        round_index = position[0] if position is not None else trainer.global_step // self.steps_per_round
        signals = self._signals(trainer, round_index)
        verdicts = {name: detector.observe(signals) for name, detector in self.detectors.items()}
        fired, suspect = self._agreed(trainer, verdicts)
        self._log(pl_module, verdicts)
        action = self._act(trainer, pl_module, signals, fired) if fired else None
        if action in (None, "warn") and not suspect:  # a warning is a sign, not damage
            self._promote(trainer)

    # ------------------------------------------------------------------------------------------ signals
    def _collect_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """One optimizer step's train numbers (a skipped step logs none: it is counted instead)."""
        if getattr(pl_module, "_skipped_in_a_row", 0) > 0:
            self._round.setdefault("skipped", []).append(1.0)
            return
        for key in ("train/entropy", "train/response_tokens_mean", "train/grad_norm"):
            value = trainer.callback_metrics.get(key)
            if value is not None:
                self._round.setdefault(key, []).append(float(value))

    def _signals(self, trainer: pl.Trainer, round_index: int) -> RoundSignals:
        metrics, steps = trainer.callback_metrics, self._round
        self._round = {}

        def logged(key: str) -> float | None:
            return float(metrics[key]) if key in metrics else None

        def mean(key: str) -> float | None:
            return sum(steps[key]) / len(steps[key]) if steps.get(key) else None

        validation, self._validation = self._validation, None
        return RoundSignals(
            round_index=round_index,
            step=trainer.global_step,
            sampled_reward=logged("rollout/sampled_reward_mean"),
            entropy=mean("train/entropy"),
            response_tokens=mean("train/response_tokens_mean"),
            truncated_share=logged("rollout/truncated_share"),
            grad_norm=max(steps["train/grad_norm"]) if steps.get("train/grad_norm") else None,
            no_search_share=logged("rollout/no_search_share"),
            searched_reward=logged("rollout/searched_reward_mean"),
            validation=validation,
            validation_noise=self._validation_noise,
            skipped_steps=len(steps.get("skipped", [])),
        )

    def _agreed(self, trainer: pl.Trainer, verdicts: dict[str, Verdict]) -> tuple[dict[str, Verdict], bool]:
        """The detectors that fired, and whether any round looks bad (no checkpoint becomes healthy), as rank 0 sees
        them, on every rank: the ranks' own numbers differ (each logs its share of the round), and a rollback or a
        stop that only some ranks took would leave the others waiting in a collective."""
        fired = {n: v for n, v in verdicts.items() if v.fired}
        suspect = any(v.suspect for v in verdicts.values())  # a firing is acted on: a warning leaves it healthy
        if trainer.world_size == 1:
            return fired, suspect
        shared = {n: (v.score, v.reason) for n, v in fired.items()}
        shared, suspect = trainer.strategy.broadcast((shared, suspect), src=0)
        return {n: Verdict(score, True, reason) for n, (score, reason) in shared.items()}, suspect

    def _log(self, pl_module: pl.LightningModule, verdicts: dict[str, Verdict]) -> None:
        values = {f"guard/{name}": v.score for name, v in verdicts.items()}
        values.update({"guard/rollbacks": float(self.rollbacks), "guard/lr_scale": self.lr_scale})
        pl_module.log_dict(values, on_step=True, batch_size=1)

    def _end_check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The run's last validation, read by every detector (only `val_drop` and `non_finite` read it): one that
        would roll back restores its target (`_target`), whatever `max_rollbacks` says (no round follows to loop), so
        the exported model, the test stage and `last.ckpt` (written again) hold those weights, not the collapse."""
        noise = self._validation_noise
        signals = RoundSignals(-1, trainer.global_step, validation=self._validation, validation_noise=noise)
        self._validation = None
        verdicts = {name: detector.observe(signals) for name, detector in self.detectors.items()}
        fired, _ = self._agreed(trainer, verdicts)
        severe = {n: v for n, v in fired.items() if self.detectors[n].settings.action != "warn"}
        target = self._target(severe)
        if target is None:
            return
        self.rollbacks += 1
        restore(trainer, pl_module, target, self.lr_scale)
        actions = {n: self.detectors[n].settings.action for n in severe}
        detail = {n: {"score": v.score, "reason": v.reason, "action": actions[n]} for n, v in severe.items()}
        event = GuardEvent(
            trainer.global_step, -1, detail, "rollback", self.rollbacks, self.lr_scale, target, time.time(), True
        )
        self._record(trainer, event)
        checkpoint = self._checkpoint(trainer)
        if checkpoint is not None and checkpoint.last_model_path:  # a resume continues from the healthy weights
            trainer.save_checkpoint(checkpoint.last_model_path, weights_only=False)  # full: optimizer + loops

    # ------------------------------------------------------------------------------------------ actions
    def _act(self, trainer: pl.Trainer, pl_module: pl.LightningModule, signals: RoundSignals, fired) -> str:
        """Take the most severe action of the detectors that fired; returns what was done."""
        actions = {name: self.detectors[name].settings.action for name in fired}
        action = max(actions.values(), key=SEVERITY.__getitem__)
        if action != "warn":
            self.last_fire_step = trainer.global_step
        restored = None
        if action == "rollback" and self.rollbacks >= self.max_rollbacks:
            action = "stop"
        elif action == "rollback" and self._target(fired) is None:
            action = "backoff"  # nothing healthy saved yet: a smaller step is all there is to do
            self.lr_scale *= self.backoff
            set_lr_scale(pl_module, self.lr_scale)
        elif action == "rollback":
            self.rollbacks += 1
            self.lr_scale *= self.backoff
            restored = self._target(fired)
            restore(trainer, pl_module, restored, self.lr_scale)
            for detector in self.detectors.values():  # their trends restart from the restored policy's rounds
                detector.after_rollback()
        detail = {n: {"score": v.score, "reason": v.reason, "action": actions[n]} for n, v in fired.items()}
        event = GuardEvent(
            trainer.global_step,
            signals.round_index,
            detail,
            action,
            self.rollbacks,
            self.lr_scale,
            restored,
            time.time(),
        )
        self._record(trainer, event)
        if action == "stop":
            raise GuardStop(
                f"guard stopped the run at step {trainer.global_step} (round {signals.round_index}): "
                + "; ".join(f"{n}: {v.reason}" for n, v in fired.items())
                + f". Rollbacks so far: {self.rollbacks} (guard.max_rollbacks={self.max_rollbacks}); events in "
                f"{Path(trainer.default_root_dir) / 'guard.jsonl'}. Lower optimizer.lr, or turn the guard off with "
                "guard.enabled=false"
            )
        return action

    def _target(self, fired: dict[str, Verdict]) -> str | None:
        """Where a rollback goes: for a validation drop, the checkpoint of the best validation (the newest healthy
        one can already be rounds into a slow decline that validation, not the round signals, saw); else, and when
        no validated checkpoint was kept, the newest healthy checkpoint. None: nothing to go back to."""
        if not fired:
            return None
        return self.best if "val_drop" in fired and self.best else self.healthy

    def _record(self, trainer: pl.Trainer, event: GuardEvent) -> None:
        """The console line and the `guard.jsonl` entry (rank 0)."""
        self.events.append(event)
        if not trainer.is_global_zero:
            return
        what = "; ".join(f"{n} ({d['reason']}; score {d['score']:.3g})" for n, d in event.detectors.items())
        done = f"rolled back to {event.restored_from}" if event.restored_from else event.action
        done += " (the last validation: the run ends on these weights)" if event.at_end else ""
        log.warning(
            "guard: %s (step %d): %s -> %s (rollbacks %d/%d, lr x%.3g)",
            "end of run" if event.at_end else f"round {event.round_index}",
            event.step,
            what,
            done,
            event.rollbacks,
            self.max_rollbacks,
            event.lr_scale,
        )
        path = Path(trainer.default_root_dir) / "guard.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(json.dumps(asdict(event)) + "\n")

    def _promote(self, trainer: pl.Trainer) -> None:
        """A clean round: the newest checkpoint saved after the last firing becomes the healthy one."""
        checkpoint = self._checkpoint(trainer)
        if checkpoint is None or checkpoint.newest is None:
            return
        step, path = checkpoint.newest
        if step >= self.last_fire_step and path and step > self._healthy_at:
            self.healthy = checkpoint.keep(trainer, path)
            self._healthy_at = step

    def _keep_best(self, trainer: pl.Trainer, value: float) -> None:
        """A new best validation whose weights are on disk becomes the `best` target: the round checkpoint saved at
        this step (validation runs after it), or, for step 0's validation (the start's weights, which no round
        checkpoint holds), `start.ckpt` written here: a run that only declines still has its start to go back to.
        A step without a checkpoint of its own keeps the previous target."""
        checkpoint = self._checkpoint(trainer)
        if value <= self.best_validation:
            return
        self.best_validation = value
        if checkpoint is None:
            return
        if trainer.global_step == 0 and checkpoint.dirpath:
            start = str(Path(checkpoint.dirpath) / "start.ckpt")
            trainer.save_checkpoint(start, weights_only=False)  # full, as every dspo checkpoint
            self.best = checkpoint.keep(trainer, start, role="best")
        elif checkpoint.newest is not None and checkpoint.newest[0] == trainer.global_step:
            self.best = checkpoint.keep(trainer, checkpoint.newest[1], role="best")

    @staticmethod
    def _checkpoint(trainer: pl.Trainer) -> RoundCheckpoint | None:
        return next((c for c in trainer.callbacks if isinstance(c, RoundCheckpoint)), None)

    # ------------------------------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        return {
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "healthy": self.healthy,
            "healthy_step": self._healthy_at,
            "best": self.best,
            "best_validation": self.best_validation,
            "last_fire_step": self.last_fire_step,
            "detectors": {name: d.state_dict() for name, d in self.detectors.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.enabled or not state_dict:
            return
        self.rollbacks, self.lr_scale = int(state_dict["rollbacks"]), float(state_dict["lr_scale"])
        self.healthy, self._healthy_at = state_dict["healthy"], int(state_dict["healthy_step"])
        self.last_fire_step = int(state_dict["last_fire_step"])
        self.best = state_dict.get("best")  # absent in checkpoints written before the guard kept it
        self.best_validation = float(state_dict.get("best_validation", float("-inf")))
        for name, state in state_dict.get("detectors", {}).items():
            if name in self.detectors:
                self.detectors[name].load_state_dict(state)
