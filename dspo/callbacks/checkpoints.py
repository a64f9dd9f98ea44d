"""Checkpoints counted in rounds, the newest K kept, and a clean save-and-stop on a scheduler's preemption signal.

Why not Lightning's own handling: `ModelCheckpoint` counts optimizer steps (a round is M of them, and a checkpoint
inside a round resumes with a fresh round), keeps "top K" only of a monitored value, and Lightning's SIGTERM handler
stops without saving (it also issues a collective from inside the signal handler). Here:

- `RoundCheckpoint` saves every `every_n_rounds` rounds (always at a round boundary) and keeps the `keep_last` newest
  (monitor = the global step, mode max), plus `last.ckpt`. A `kill -9` then loses at most `every_n_rounds` rounds.
  It also keeps the newest checkpoint the guard (`dspo.guard`) marked healthy, even when `keep_last` would drop it:
  that is the one a rollback restores.
- `PreemptionCheckpoint` turns SIGTERM / SIGUSR1 (SLURM's `--signal=USR1@120`, Kubernetes' SIGTERM before SIGKILL)
  into a flag; at the end of the current round every rank agrees (any rank signalled -> all stop), `last.ckpt` is
  written and the run stops cleanly. Under SLURM (`SLURM_JOB_ID` set) rank 0 then requeues the job with
  `scontrol requeue` (Lightning's own SIGUSR1 requeue handler is replaced by this one for the run). `dspo-train` skips
  the test pass and exits 0; `ckpt_path=last` (or `auto`) continues from the checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

from dspo.types import SavedCheckpoint

log = logging.getLogger(__name__)


class RoundCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` every `every_n_rounds` rounds of `steps_per_round` optimizer steps, keeping the newest
    `keep_last` (0 = only `last.ckpt`, -1 = all)."""

    def __init__(
        self,
        dirpath: str,
        every_n_rounds: int = 1,
        steps_per_round: int = 1,
        keep_last: int = 2,
        filename: str = "step{step:05d}",
    ) -> None:
        if every_n_rounds < 1:
            raise ValueError(f"callbacks.checkpoint.every_n_rounds must be >= 1, got {every_n_rounds}")
        if steps_per_round < 1:
            raise ValueError(
                f"callbacks.checkpoint.steps_per_round must be >= 1 (algorithm.num_minibatches), got {steps_per_round}"
            )
        if keep_last < -1:
            raise ValueError(
                f"callbacks.checkpoint.keep_last must be -1 (all), 0 (only last.ckpt) or more, got {keep_last}"
            )
        self.every_n_rounds, self.steps_per_round = every_n_rounds, steps_per_round
        self.newest: SavedCheckpoint | None = None  # the newest round checkpoint: its policy version, step, file
        # role -> file the guard keeps (`keep`: healthy, best, one awaiting judgement): never removed by keep_last
        self.kept: dict[str, str] = {}
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            auto_insert_metric_name=False,
            save_last=True,
            every_n_train_steps=every_n_rounds * steps_per_round,
            save_top_k=keep_last,
            monitor="step",  # always available: Lightning fills it with the global step
            mode="max",
            save_on_train_epoch_end=False,
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        position = round_position(batch)
        if position is None:  # not a dspo round slot: Lightning's own count of optimizer steps
            # With manual optimization Lightning 2.6 warns (and prints a code sample) that the checkpoint holds the
            # state after the optimizer step: what is wanted at a round boundary, the weights the next round samples.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        # Rounds, not optimizer steps: a skipped (non-finite) step leaves the global step behind the slots, and a
        # step-counted save would then land mid-round, where a resume drops the rest of the round.
        round_index, minibatch_index = position
        if minibatch_index != self.steps_per_round - 1 or (round_index + 1) % self.every_n_rounds:
            return
        if self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        # keep_last=0 keeps only last.ckpt, which the next round overwrites: `keep` copies it then. Its weights are
        # policy version round_index + 1 (rounds completed): the version the rounds they sample carry
        path = self.best_model_path or self.last_model_path
        self.newest = SavedCheckpoint(version=round_index + 1, step=trainer.global_step, path=path)

    def keep(self, trainer: pl.Trainer, path: str, role: str = "healthy") -> str:
        """Keep `path` as the guard's `role` checkpoint (`healthy`: the newest with no detector firing since; `best`:
        the one with the best validation) whatever `keep_last` says, and drop the file that role kept before unless
        another role or `keep_last` still holds it. `last.ckpt` (rewritten every round; keep_last=0) is kept as a copy,
        `<role>.ckpt`. Returns the kept file."""
        if Path(path).name == "last.ckpt":
            copy = Path(path).with_name(f"{role}.ckpt")
            if trainer.is_global_zero:
                _copy(Path(path), copy)
            trainer.strategy.barrier(f"dspo_guard_keep_{role}")
            path = str(copy)
        previous = self.kept.get(role)
        self.kept[role] = path
        stale = previous and previous not in self.kept.values() and previous not in self.best_k_models
        if stale and Path(previous).name != f"{role}.ckpt":
            self._remove_checkpoint(trainer, previous)  # the strategy removes it on rank 0 only
        return path

    def release(self, trainer: pl.Trainer, role: str) -> None:
        """The guard no longer needs its `role` checkpoint: its file is removed unless another role, `keep_last` or
        `last.ckpt` still holds it."""
        path = self.kept.pop(role, None)
        if path is None or path in self.kept.values() or path in self.best_k_models or path == self.last_model_path:
            return
        self._remove_checkpoint(trainer, path)

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if filepath in self.kept.values():  # a rollback target outlives keep_last
            return
        super()._remove_checkpoint(trainer, filepath)


def _copy(source: Path, target: Path) -> None:
    """`target` = a copy of `source` (a file, or the folder of a trainer=fsdp checkpoint). A copy, not a hard link:
    a save that bypasses dspo.runs.checkpoint_files's atomic replace may rewrite `last.ckpt` in place. copy2 keeps the
    mtime,
    so `ckpt_path=last` still prefers `last.ckpt`."""
    if target.is_dir():
        shutil.rmtree(target)
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy2(source, target)


def round_position(batch: Any) -> tuple[int, int] | None:
    """(round index, mini-batch index in the round) of a dspo train batch (`RoundSlot`), None for any other batch."""
    round_index, minibatch_index = getattr(batch, "round_index", -1), getattr(batch, "minibatch_index", -1)
    if not isinstance(round_index, int) or round_index < 0 or minibatch_index < 0:
        return None
    return round_index, minibatch_index


_SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1, "SIGUSR2": signal.SIGUSR2, "SIGINT": signal.SIGINT}


class PreemptionCheckpoint(Checkpoint):
    """Save `last.ckpt` at the next round boundary after one of `signals`, then stop the run cleanly.

    A `Checkpoint` (Lightning's base of checkpoint callbacks, no behaviour of its own) so that Lightning runs it after
    every other callback's hook, whatever order the config lists them in: in a round where the guard rolls back, the
    save holds the restored weights `guard.jsonl` names, not the ones rolled back from.

    Args:
        dirpath: checkpoint folder (the same as the round checkpoints', so `ckpt_path=last` finds it).
        steps_per_round: M; the save waits for the round's last mini-batch so that resume loses nothing.
        signals: names of the signals that mean "save and stop" (SIGTERM, SIGUSR1 by default).
        slurm_requeue: under SLURM, requeue the job after saving (its next start resumes with ckpt_path=auto).
    """

    def __init__(
        self,
        dirpath: str,
        steps_per_round: int = 1,
        signals: tuple[str, ...] | list[str] = ("SIGTERM", "SIGUSR1"),
        slurm_requeue: bool = True,
    ) -> None:
        unknown = [name for name in signals if name not in _SIGNALS]
        if unknown:
            raise ValueError(f"callbacks.preemption.signals: unknown {unknown}; choose from {sorted(_SIGNALS)}")
        if steps_per_round < 1:
            raise ValueError(f"callbacks.preemption.steps_per_round must be >= 1, got {steps_per_round}")
        self.dirpath, self.steps_per_round, self.signals = Path(dirpath), steps_per_round, list(signals)
        self.slurm_requeue = slurm_requeue
        self.received: str | None = None  # name of the signal that arrived (set by the handler only)
        self.saved_to: str | None = None  # the checkpoint written when the run stopped for it
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:  # a signal handler must only record: no I/O, no collectives
        self.received = signal.Signals(signum).name

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals not handled: training does not run in the main thread")
            return
        for name in self.signals:  # after Lightning registered its handlers, so these replace them for the run
            self._previous[_SIGNALS[name]] = signal.signal(_SIGNALS[name], self._handle)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        position = round_position(batch)
        minibatch_index = position[1] if position is not None else trainer.global_step - 1
        if minibatch_index % self.steps_per_round != self.steps_per_round - 1:
            return
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        path = self.dirpath / "last.ckpt"
        trainer.save_checkpoint(str(path), weights_only=False)  # a full checkpoint: the run resumes from it
        self.saved_to = str(path)
        trainer.should_stop = True
        log.warning(
            "%s received: checkpoint saved to %s at step %d (end of a round); stopping. Resume with ckpt_path=last",
            self.received or "a signal on another rank",
            path,
            trainer.global_step,
        )
        if self.slurm_requeue and trainer.is_global_zero and os.environ.get("SLURM_JOB_ID"):
            requeue_slurm_job(os.environ["SLURM_JOB_ID"])

    # Restored when training ends (normally or by an exception), not in `teardown`: Lightning puts back the handlers
    # it found before calling the callbacks' teardown, so restoring there would reinstall the handler Lightning used
    # during fit, and after fit SIGTERM would no longer end the process.
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def requeue_slurm_job(job_id: str) -> bool:
    """`scontrol requeue JOB`; a failure is logged (the checkpoint is saved either way), never raised."""
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("could not requeue SLURM job %s (%s); resubmit it with ckpt_path=auto", job_id, error)
        return False
    if result.returncode != 0:
        log.warning("scontrol requeue %s failed (%s); resubmit it with ckpt_path=auto", job_id, result.stderr.strip())
        return False
    log.warning("requeued SLURM job %s", job_id)
    return True


def preempted(trainer: pl.Trainer) -> str | None:
    """The checkpoint a `PreemptionCheckpoint` saved when the run stopped for a signal, else None."""
    for callback in trainer.callbacks:
        if isinstance(callback, PreemptionCheckpoint) and callback.saved_to:
            return callback.saved_to
    return None
