"""`data=verifiers`: the prompts of a verifiers taskset (`env=verifiers`, dspo/env/verifiers_env.py), nothing read.

A verifiers taskset is a list of tasks, with no split of its own. Validation and test are its first `val_size` and
the next `test_size` tasks, held out of training when the taskset has more tasks than that (all of it trains
otherwise, and the docs say so). `env.id` / `env.args` are interpolated, so the data and the environment load the
same taskset.
"""

from __future__ import annotations

from collections.abc import Mapping

from dspo.data.datamodule import RolloutDataModule


class VerifiersDataModule(RolloutDataModule):
    """Args:
    id / args: the taskset (`env.id`, `env.args`).
    val_size / test_size: tasks for validation / test (0: none).
    benchmark: the name validation and test report under (default: the taskset's id).
    seed: the prompt order's seed.
    """

    def __init__(
        self,
        id: str,  # noqa: A002  verifiers' name for it
        args: Mapping | None = None,
        val_size: int = 0,
        test_size: int = 0,
        benchmark: str | None = None,
        seed: int = 0,
        eval_batch_size: int = 64,
    ) -> None:
        from dspo.env.verifiers_env import plain

        if not id:
            raise ValueError("data=verifiers reads the taskset from env.id: use it with env=verifiers env.id=<taskset>")
        self.taskset_id, self.args = id, plain(args)
        self.benchmark = benchmark or str(id).rsplit("/", 1)[-1]
        names = {self.benchmark: self.benchmark}
        super().__init__(
            train_files=["verifiers"],  # unused: setup loads the tasks
            val_files=names if val_size else None,
            test_files=names if test_size else None,
            eval_batch_size=eval_batch_size,
            seed=seed,
        )
        self.val_size, self.test_size = val_size, test_size
        self._loaded: list | None = None

    def _items(self) -> list:
        """The taskset's tasks as items, loaded once (setup runs per stage: fit, validate, test)."""
        if self._loaded is None:
            from dspo.env.verifiers_env import load, task_items

            self._loaded = task_items(load(self.taskset_id, self.args), self.benchmark)
        return self._loaded

    def setup(self, stage: str | None = None) -> None:
        items = self._items()
        held = self.val_size + self.test_size
        if stage in (None, "fit") and self.sampler is None:
            train = items[held:] if len(items) > held else items
            self.start_sampler(train)
        if stage in (None, "fit", "validate") and not self.val_sets and self.val_size:
            self.val_sets = {self.benchmark: items[: self.val_size]}
        if stage in (None, "test") and not self.test_sets and self.test_size:
            self.test_sets = {self.benchmark: items[self.val_size : held]}
