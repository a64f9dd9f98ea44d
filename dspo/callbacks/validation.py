"""`ValidateAtStart`: one validation pass before the first optimizer step, logged at step 0.

Why: an RL curve means little without its starting point. Lightning validates every `val_check_interval` steps but
never before training (its sanity check logs nothing), so the warm start's score would only be known from a separate
evaluation. This runs the fit loop's own validation loop once at `on_train_start`, the way Lightning runs it in the
middle of an epoch, so the metrics go through the same `self.log` path and land at step 0 in every logger.
A resumed run (global step > 0) skips it: its curves already start at step 0.
"""

from __future__ import annotations

import lightning.pytorch as pl


class ValidateAtStart(pl.Callback):
    """Args:
    enabled: False turns it off (`callbacks.validate_at_start.enabled=false`; or `~callbacks.validate_at_start`).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.ran = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled or trainer.global_step > 0 or not trainer.enable_validation:
            return
        trainer.validating = True  # selects the validation loop as the active one (logging, hooks)
        trainer.fit_loop.epoch_loop.val_loop.run()
        trainer.training = True
        self.ran = True
