"""`Guard`: the run watches itself for collapse every round and acts (issue 55; config key `guard`).

At each round's end the detectors (`dspo.guard.detectors`) read the round's logged numbers; each one's score is
logged as `guard/<name>`, with `guard/rollbacks` and `guard/lr_scale`. When one fires, its action is taken:

- warn: a console line and a `guard.jsonl` entry;
- rollback: model, optimizer and scheduler restored from the newest checkpoint the guard marked healthy (for a
  validation drop: the checkpoint of the best validation, when one was kept), the learning rate scaled by `backoff`
  (`dspo.guard.rollback`); the sampler and RNG move on, so no prompt is replayed;
- stop: the run ends with `GuardStop` (non-zero exit), as does a rollback beyond `max_rollbacks`.

Healthy (`dspo.guard.health`): a checkpoint's weights are judged by the rounds they sampled, whatever
`rollout.max_staleness` is; the round's typed `RoundReport` (made by the round producer) carries its sampling versions,
and the module's `StepReport` each step's numbers: the guard reads no logger keys. A backoff (a rollback with nothing
healthy to go to, e.g. before the first checkpoint) counts as a rollback: the rate never falls below
`backoff ** max_rollbacks` of its start before the run stops. The guard evaluates before the round's checkpoint is
written (Lightning runs checkpoint callbacks last, the preemption save included), so that checkpoint holds the
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
from dspo.guard.health import HealthLedger
from dspo.guard.rollback import restore, set_lr_scale
from dspo.types import RoundReport, SavedCheckpoint, StepReport

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
    action: str  # warn | rollback | backoff (nothing healthy to go to: the rate only; counts as a rollback) | stop
    rollbacks: int
    lr_scale: float
    restored_from: str | None = None
    time: float = 0.0
    at_end: bool = False  # fired on the run's last validation: the run ends on the restored weights


class Guard(pl.Callback):
    """Args:
    enabled: false turns the guard off (no detector, no `guard/*` tag, no file).
    detectors: name -> settings (`dspo.guard.detectors.DETECTORS`; null turns one off); every detector by default.
    backoff: the learning rate is multiplied by it at each rollback or backoff (0 < backoff <= 1).
    max_rollbacks: rollbacks and backoffs allowed; one more asked for stops the run instead.
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
        self.ledger = HealthLedger()  # waiting and healthy checkpoints by policy version (dspo.guard.health)
        self.best: SavedCheckpoint | None = None  # the checkpoint of the best validation (val_drop's target)
        self.best_validation = float("-inf")
        self.events: list[GuardEvent] = []
        self._steps: list[StepReport] = []
        self._report: RoundReport | None = None
        self._validation: float | None = None
        self._validation_noise: float | None = None

    @property
    def healthy(self) -> str | None:
        """The newest healthy checkpoint's file (the rollback target), None before the first."""
        return self.ledger.healthy.path if self.ledger.healthy else None

    # ------------------------------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled:
            return
        if not hasattr(pl_module, "step_report"):
            raise ValueError(
                f"guard: {type(pl_module).__name__} reports no steps (a `step_report` attribute, dspo.types.StepReport"
                "): the guard cannot watch this module. Use dspo.training.module.DSPOModule, or turn the guard off "
                "with guard.enabled=false"
            )
        checkpoint = self._checkpoint(trainer)
        if checkpoint is not None:  # resumed: protect the targets and the checkpoints awaiting judgement again
            checkpoint.kept = {role: c.path for role, c in self._roles().items()}

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
        self._steps.append(pl_module.step_report)
        if getattr(batch, "report", None) is not None:  # the round's first slot carries its report
            self._report = batch.report
        position = round_position(batch)
        minibatch = position[1] if position is not None else trainer.global_step - 1
        if minibatch % self.steps_per_round != self.steps_per_round - 1:
            return
        report, self._report = self._report, None
        if report is None:
            raise RuntimeError(
                f"guard: a round ended at step {trainer.global_step} without its RoundReport: the guard needs dspo's "
                "round slots (callbacks.rollout: dspo.callbacks.rollout_callback.RolloutCallback). Turn the guard off "
                "with guard.enabled=false to train without them"
            )
        self._judge_round(trainer, pl_module, report)

    # ------------------------------------------------------------------------------------------ the round
    def _judge_round(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: RoundReport) -> None:
        """Detectors on the round's signals; the checkpoint ledger moved by the verdict; the action taken."""
        signals = self._signals(trainer, report)
        verdicts = {name: detector.observe(signals) for name, detector in self.detectors.items()}
        fired, suspect = self._agreed(trainer, verdicts)
        self._log(pl_module, verdicts)
        self._register_newest(trainer)
        severe = {n: v for n, v in fired.items() if self.detectors[n].settings.action != "warn"}
        if severe or suspect:  # a warning is a sign, not damage: its round still vouches for its weights
            bad = max(report.newest_version, report.round_index if "val_drop" in severe else -1)
            self._release(trainer, self.ledger.bad(bad))
        else:
            promoted, judged = self.ledger.clean(report.oldest_version)
            if promoted is not None:  # kept as healthy first, so that releasing its waiting role keeps the file
                self._keep(trainer, promoted, "healthy")
            self._release(trainer, judged)
        if fired:
            round_bound = report.oldest_version if set(severe) - {"val_drop"} else None
            self._act(trainer, pl_module, report.round_index, fired, round_bound)
        self._protect_waiting(trainer)

    def _signals(self, trainer: pl.Trainer, report: RoundReport) -> RoundSignals:
        steps, self._steps = [s for s in self._steps if s is not None], []
        trained = [s for s in steps if not s.skipped]

        def mean(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return sum(present) / len(present) if present else None

        norms = [s.grad_norm for s in trained if s.grad_norm is not None]
        validation, self._validation = self._validation, None
        return RoundSignals(
            round_index=report.round_index,
            step=trainer.global_step,
            sampled_reward=report.sampled_reward,
            entropy=mean([s.entropy for s in trained]),
            response_tokens=mean([s.response_tokens for s in trained]),
            truncated_share=report.truncated_share,
            grad_norm=max(norms) if norms else None,
            no_search_share=report.no_search_share,
            searched_reward=report.searched_reward,
            validation=validation,
            validation_noise=self._validation_noise,
            skipped_steps=len(steps) - len(trained),
        )

    def _agreed(self, trainer: pl.Trainer, verdicts: dict[str, Verdict]) -> tuple[dict[str, Verdict], bool]:
        """The detectors that fired, and whether any round looks bad (no checkpoint becomes healthy), as rank 0 sees
        them, on every rank: the ranks' own numbers differ (each logs its share of the round), and a rollback or a
        stop that only some ranks took would leave the others waiting in a collective."""
        fired = {n: v for n, v in verdicts.items() if v.fired}
        suspect = any(v.suspect for v in verdicts.values())
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
        target = self._target(severe, None)
        if target is None:
            return
        self.rollbacks += 1
        restore(trainer, pl_module, target.path, self.lr_scale)
        actions = {n: self.detectors[n].settings.action for n in severe}
        detail = {n: {"score": v.score, "reason": v.reason, "action": actions[n]} for n, v in severe.items()}
        event = GuardEvent(
            trainer.global_step, -1, detail, "rollback", self.rollbacks, self.lr_scale, target.path, time.time(), True
        )
        self._record(trainer, event)
        checkpoint = self._checkpoint(trainer)
        if checkpoint is not None and checkpoint.last_model_path:  # a resume continues from the healthy weights
            trainer.save_checkpoint(checkpoint.last_model_path, weights_only=False)  # full: optimizer + loops

    # ------------------------------------------------------------------------------------------ actions
    def _act(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, round_index: int, fired, bound: int | None
    ) -> str:
        """Take the most severe action of the detectors that fired; returns what was done. A rollback goes to a
        checkpoint older than `bound` (the bad round's oldest sampling weights; None: no round bound); with none, the
        rate alone is lowered (backoff). Both count toward `max_rollbacks`, and the detectors start over."""
        actions = {name: self.detectors[name].settings.action for name in fired}
        action = max(actions.values(), key=SEVERITY.__getitem__)
        restored = None
        if action == "rollback" and self.rollbacks >= self.max_rollbacks:
            action = "stop"
        elif action == "rollback":
            self.rollbacks += 1
            self.lr_scale *= self.backoff
            target = self._target(fired, bound)
            if target is None:
                action = "backoff"  # nothing healthy to go back to: a smaller step is all there is to do
                set_lr_scale(pl_module, self.lr_scale)
            else:
                restored = target.path
                restore(trainer, pl_module, restored, self.lr_scale)
            for detector in self.detectors.values():  # their trends restart from the restored (or slowed) policy
                detector.after_rollback()
        detail = {n: {"score": v.score, "reason": v.reason, "action": actions[n]} for n, v in fired.items()}
        event = GuardEvent(
            trainer.global_step, round_index, detail, action, self.rollbacks, self.lr_scale, restored, time.time()
        )
        self._record(trainer, event)
        if action == "stop":
            raise GuardStop(
                f"guard stopped the run at step {trainer.global_step} (round {round_index}): "
                + "; ".join(f"{n}: {v.reason}" for n, v in fired.items())
                + f". Rollbacks so far: {self.rollbacks} (guard.max_rollbacks={self.max_rollbacks}); events in "
                f"{Path(trainer.default_root_dir) / 'guard.jsonl'}. Lower optimizer.lr, or turn the guard off with "
                "guard.enabled=false"
            )
        return action

    def _target(self, fired: dict[str, Verdict], bound: int | None) -> SavedCheckpoint | None:
        """Where a rollback goes: for a validation drop, the checkpoint of the best validation (the newest healthy
        one can already be rounds into a slow decline that validation, not the round signals, saw); else, and when
        no validated checkpoint was kept, the newest healthy checkpoint; either only if older than `bound`. None:
        nothing to go back to."""
        if not fired:
            return None
        best = self.best if self.best and (bound is None or self.best.version < bound) else None
        return best if "val_drop" in fired and best else self.ledger.target(bound)

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

    # ------------------------------------------------------------------------------------------ checkpoint files
    def _register_newest(self, trainer: pl.Trainer) -> None:
        """The round checkpoint saved since the last round waits for a round its weights sampled."""
        checkpoint = self._checkpoint(trainer)
        if checkpoint is not None and checkpoint.newest is not None and checkpoint.newest.path:
            self.ledger.saved(checkpoint.newest)

    def _roles(self) -> dict[str, SavedCheckpoint]:
        """The files the guard needs kept, by role: the healthy and best targets and each waiting checkpoint."""
        roles = {f"waiting-v{c.version}": c for c in self.ledger.waiting}
        roles.update({role: c for role, c in (("healthy", self.ledger.healthy), ("best", self.best)) if c})
        return roles

    def _keep(self, trainer: pl.Trainer, saved: SavedCheckpoint, role: str) -> SavedCheckpoint:
        """`saved` kept as `role` (a copy when it is `last.ckpt`, which the next round overwrites); returns it kept."""
        checkpoint = self._checkpoint(trainer)
        if checkpoint is None:
            return saved
        kept = SavedCheckpoint(saved.version, saved.step, checkpoint.keep(trainer, saved.path, role=role))
        if role == "healthy":
            self.ledger.healthy = kept
        return kept

    def _protect_waiting(self, trainer: pl.Trainer) -> None:
        """At k >= 1 a checkpoint waits rounds for its judgement: keep_last must not drop it meanwhile, nor must the
        next round's `last.ckpt` overwrite it (keep_last=0: copied once). At k = 0 nothing is left waiting here."""
        checkpoint = self._checkpoint(trainer)
        if checkpoint is None:
            return
        for index, waiting in enumerate(self.ledger.waiting):
            role = f"waiting-v{waiting.version}"
            if role not in checkpoint.kept:
                self.ledger.waiting[index] = self._keep(trainer, waiting, role)

    def _release(self, trainer: pl.Trainer, checkpoints: list[SavedCheckpoint]) -> None:
        checkpoint = self._checkpoint(trainer)
        for saved in checkpoints:
            if checkpoint is not None:
                checkpoint.release(trainer, f"waiting-v{saved.version}")

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
            self.best = self._keep(trainer, SavedCheckpoint(0, 0, start), "best")
        elif checkpoint.newest is not None and checkpoint.newest.step == trainer.global_step:
            self.best = self._keep(trainer, checkpoint.newest, "best")

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
            "ledger": self.ledger.state_dict(),
            "best": asdict(self.best) if self.best else None,
            "best_validation": self.best_validation,
            "detectors": {name: d.state_dict() for name, d in self.detectors.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.enabled or not state_dict:
            return
        self.rollbacks, self.lr_scale = int(state_dict["rollbacks"]), float(state_dict["lr_scale"])
        self.ledger = HealthLedger.from_state(state_dict["ledger"]) if "ledger" in state_dict else self._old(state_dict)
        best = state_dict.get("best")  # absent in checkpoints written before the guard kept it
        self.best = SavedCheckpoint(**best) if isinstance(best, dict) else self._old_best(best)
        self.best_validation = float(state_dict.get("best_validation", float("-inf")))
        for name, state in state_dict.get("detectors", {}).items():
            if name in self.detectors:
                self.detectors[name].load_state_dict(state)

    def _old(self, state: dict[str, Any]) -> HealthLedger:
        """A checkpoint written before the ledger (healthy file and step, the step of the last firing): versions
        from steps (M steps a round); at the k = 0 those guards assumed, the fired round's version was one less."""
        healthy, step = state.get("healthy"), int(state.get("healthy_step", -1))
        saved = SavedCheckpoint(step // self.steps_per_round, step, healthy) if healthy else None
        fired = int(state.get("last_fire_step", -1))
        return HealthLedger(healthy=saved, last_bad=fired // self.steps_per_round - 1 if fired >= 0 else -1)

    def _old_best(self, path: str | None) -> SavedCheckpoint | None:
        if not path:
            return None
        step = 0 if Path(path).name == "start.ckpt" else checkpoint_file_step(path)
        return SavedCheckpoint(step // self.steps_per_round, step, path)


def checkpoint_file_step(path: str) -> int:
    """The global step in a round checkpoint's name (`step00012.ckpt` -> 12); 0 when the name has none."""
    digits = "".join(ch for ch in Path(path).stem if ch.isdigit())
    return int(digits) if digits else 0
