"""`StepProgressBar`: a run's progress as RL steps out of `trainer.max_steps`, with reward and keep-rate, and a short
table of the validation scores after each validation. `RoundLines`: the same progress as one log line per round, for a
console that shows no live bar (nohup, `| tee`, a SLURM log, CI) and for the run's `train.log`.

Why not Lightning's default bar: dspo's train stream is endless (a train batch is one optimizer step of a round), so
"epochs" mean nothing and the default description reads "Epoch 0/-2".

Why lines besides the bar: written to a file, Rich's bar prints nothing until the run ends, and its time left (Rich's
speed over its last 30 s) disappears once a step takes longer than that. A round line's time left comes from the
run's own mean wall time per round (`RoundClock`), which a slow step cannot blank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar

from dspo.callbacks.checkpoints import round_position
from dspo.process.progress_log import duration, progress_logger

log = progress_logger("train")


def validation_table(metrics: dict[str, float], step: int) -> str:
    """`step 25 · validation subEM  toy_1hop 0.410  toy_2hop 0.120  mean 0.265` from `val/<benchmark>/subem` values."""
    # `val/` only: the reward's components are logged as `reward/<name>` (`reward/subem` read as a benchmark "rd")
    scores = {
        k[len("val/") : -len("/subem")]: v
        for k, v in sorted(metrics.items())
        if k.startswith("val/") and k.endswith("/subem")
    }
    if not scores:
        return ""
    parts = [f"{name} {value:.3f}" for name, value in scores.items() if "/" not in name]
    if "val/subem_mean" in metrics:
        parts.append(f"mean {metrics['val/subem_mean']:.3f}")
    return f"step {step} · validation subEM  " + "  ".join(parts)


class StepProgressBar(RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        return "RL step"

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version number: not progress
        return items

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        line = validation_table({k: float(v) for k, v in trainer.callback_metrics.items()}, trainer.global_step)
        if line:
            if self.progress is not None:
                self.progress.console.print(line)
            else:
                print(line, flush=True)


@dataclass
class RoundClock:
    """This run's rounds in wall time (`time.monotonic()`), counted from the run's start or, resumed, from the resume.

    The mean time per round runs from the end of the run's first round to the end of its last: it includes the
    validations and checkpoints between rounds (they are part of what is left), and it leaves the first round out.
    That round pays what later ones do not when no validation ran before it (a resumed run, or
    `callbacks.validate_at_start.enabled=false`): the engine's first generation and the trainer's first update
    (measured on the toy, resumed, 2-core CPU: its first round's update took 9.0 s, the next two 4.2 and 1.0 s).
    Until a second round ends, the first round's own duration is the only estimate there is, and it is used.
    Being a mean over the whole run, it survives a slow round: Rich's bar's time left (its speed over the last
    30 s) disappears when a step takes longer than that."""

    first: tuple[float, float] | None = None  # (start, end) of this run's first round
    last_end: float | None = None
    later_rounds: int = 0  # rounds ended after the first

    def round_ended(self, started: float, ended: float) -> None:
        if self.first is None:
            self.first = (started, ended)
        else:
            self.later_rounds += 1
        self.last_end = ended

    def seconds_per_round(self) -> float | None:
        if self.first is None or self.last_end is None:
            return None
        if not self.later_rounds:
            return self.first[1] - self.first[0]
        return (self.last_end - self.first[1]) / self.later_rounds

    def time_left(self, rounds_left: int | None) -> float | None:
        per_round = self.seconds_per_round()
        return None if per_round is None or rounds_left is None else per_round * rounds_left


def rounds_left(global_step: int, max_steps: int, steps_per_round: int) -> int | None:
    """Rounds still to train to reach `max_steps` (None when the run has no step limit, max_steps < 0)."""
    if max_steps < 0:
        return None
    return math.ceil(max(0, max_steps - global_step) / steps_per_round)


def round_line(
    step: int,
    max_steps: int,
    round_number: int,
    reward: float | None,
    keep: float | None,
    round_s: float,
    per_round_s: float | None,
    left_s: float | None,
) -> str:
    """`step 4/100 (round 2) · sampled reward 0.412 · keep 0.75 · 38.2 s/round (this one 36.0 s) · 31m 20s left`.
    Unknown parts are left out."""
    total = f"/{max_steps}" if max_steps >= 0 else ""
    parts = [f"step {step}{total} (round {round_number})"]
    if reward is not None:
        parts.append(f"sampled reward {reward:.3f}")
    if keep is not None:
        parts.append(f"keep {keep:.2f}")
    speed = f"{per_round_s:.1f} s/round (this one {round_s:.1f} s)" if per_round_s is not None else None
    parts.append(speed or f"this round {round_s:.1f} s")
    if left_s is not None:
        parts.append(f"{duration(left_s)} left" if left_s > 0 else "done")
    return " · ".join(parts)


class RoundLines(pl.Callback):
    """One `dspo.progress.train` log line per completed round (`round_line`), a line when the run's first round
    starts, and a start and an end line (with its duration) for each validation and test pass.

    Where they show: in `train.log` always; on the console only when it shows no live display, i.e. when the output
    is redirected (`dspo.process.progress_log.route_progress_lines`). In a terminal the console is unchanged (the bar
    shows the same numbers); `train.log` gets them there too, since one line per round costs nothing and the file then
    reads the same however the run was started.

    The reward is the round's sampled reward (`RoundReport.sampled_reward`: every episode it sampled, filtered-out
    groups included, the policy's score; the bar's `reward` is the mean of the mixed-outcome groups it trains on) and
    the keep rate the round's `rollout/keep_rate`. Put first among the callbacks (conf/callbacks/default.yaml): its
    `on_train_batch_start` then runs before the rollout callback generates the round, so a round's time includes its
    generation. Rank 0 only.

    Args:
        steps_per_round: optimizer steps per round (`algorithm.num_minibatches`).
    """

    def __init__(self, steps_per_round: int = 1) -> None:
        if steps_per_round < 1:
            raise ValueError(
                f"callbacks.round_lines.steps_per_round must be >= 1 (algorithm.num_minibatches), got {steps_per_round}"
            )
        self.steps_per_round = steps_per_round
        self.clock = RoundClock()
        self._round_start: float | None = None
        self._sampled: tuple[float | None, float | None] = (None, None)  # (sampled reward, keep rate) of the round
        self._eval_start: float | None = None
        self.now = time.monotonic  # the clock (tests set their own)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock, self._round_start = RoundClock(), None  # a fit (a resumed one too) measures its own rounds

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if self._round_start is not None:
            return
        self._round_start = self.now()
        if self.clock.first is None and trainer.is_global_zero:
            which = "the run's first round" if trainer.global_step == 0 else "the resumed run's first round"
            step, max_steps = trainer.global_step, trainer.max_steps
            log.info("step %d/%d: %s started (its line follows when it ends)", step, max_steps, which)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        position = round_position(batch)
        if position is None or self._round_start is None:
            return
        round_index, minibatch_index = position
        if minibatch_index == 0:
            report = getattr(batch, "report", None)
            keep = trainer.callback_metrics.get("rollout/keep_rate")
            self._sampled = (
                None if report is None else report.sampled_reward,
                None if keep is None else float(keep),
            )
        if minibatch_index != self.steps_per_round - 1:
            return
        started, ended = self._round_start, self.now()
        self._round_start = None
        self.clock.round_ended(started, ended)
        if trainer.is_global_zero:
            log.info(self._line(trainer, round_index + 1, ended - started))

    def _line(self, trainer: pl.Trainer, round_number: int, round_s: float) -> str:
        left = rounds_left(trainer.global_step, trainer.max_steps, self.steps_per_round)
        reward, keep = self._sampled
        per_round = self.clock.seconds_per_round()
        return round_line(
            trainer.global_step, trainer.max_steps, round_number, reward, keep, round_s, per_round,
            self.clock.time_left(left),
        )  # fmt: skip

    def _eval_started(self, trainer: pl.Trainer, what: str) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        self._eval_start = self.now()
        log.info("%s at step %d: started", what, trainer.global_step)

    def _eval_ended(self, trainer: pl.Trainer, what: str) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or self._eval_start is None:
            return
        took, self._eval_start = self.now() - self._eval_start, None
        log.info("%s at step %d: done in %s", what, trainer.global_step, duration(took))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_started(trainer, "validation")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_ended(trainer, "validation")

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_started(trainer, "test")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_ended(trainer, "test")
