"""`DSPOModule` outside the train step: validation and test metrics, and the checkpoint and setup hooks."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from dspo.testing import build_toy_lm, recording_logger
from dspo.training.module import DSPOModule


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    return build_toy_lm(str(tmp_path_factory.mktemp("toy_lm")))


class _Answers(pl.Callback):
    """The environment callback's part in evaluation: answers from a table (question id -> answer) put into each
    `EvalSlot`, and the batches it answered, per stage."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.recorded = answers, []

    def _answer(self, stage: str, slot) -> None:
        from dspo.eval.pipeline import Prediction

        slot.predictions = [
            Prediction(i.id, i.benchmark, i.question, i.golden_answers, self.answers[i.id], 0.0, 0.0, 0.0, 1, 0)
            for i in slot.items
        ]
        self.recorded.append((stage, [i.id for i in slot.items]))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._answer("val", batch)

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._answer("test", batch)


def test_validation_and_test_log_subem_per_benchmark_and_their_mean(lm_dir, tmp_path):
    """Two benchmarks: `val/<name>/subem|em|f1` per benchmark and `val/subem_mean` (the mean of the two subEMs,
    not of the questions) reach the logger at x = the number of applied updates; test returns them from
    trainer.test(); the module scores the predictions the callback put into each batch."""
    from dspo.algorithms.config import AlgorithmConfig
    from dspo.data.datamodule import EvalSlot, RolloutDataModule
    from dspo.models import ModelConfig
    from dspo.training.module import OptimizerConfig
    from dspo.types import QAItem

    def items(name, n):
        return [QAItem(id=f"{name}{i}", question=f"q{i}", golden_answers=["Paris"], benchmark=name) for i in range(n)]

    sets = {"one": items("one", 4), "two": items("two", 2)}
    test_sets = {"three": items("three", 5)}  # other names than validation's: each stage gets its own metrics
    right = {"one0", "one1", "one2", "two0", "three0"}  # one: 3/4, two: 1/2 (mean over benchmarks 0.625); three: 1/5
    every = [i for group in (*sets.values(), *test_sets.values()) for i in group]
    answers = {i.id: ("Paris" if i.id in right else "Rome") for i in every}
    datamodule = RolloutDataModule(train_files=["unused"], val_files={"one": "-", "two": "-"}, eval_batch_size=3)
    datamodule.test_files = {"three": "-"}
    datamodule.val_sets, datamodule.test_sets = sets, test_sets
    module = DSPOModule(ModelConfig(path=lm_dir), AlgorithmConfig(group_size=2, batch_groups=1), OptimizerConfig())
    module.configure_model()
    answering = _Answers(answers)
    logger = recording_logger()
    trainer = pl.Trainer(
        accelerator="cpu", logger=logger, callbacks=[answering], enable_progress_bar=False, default_root_dir=tmp_path
    )
    trainer.validate(module, datamodule=datamodule)
    [(step, logged)] = [(s, m) for s, m in logger.records if "val/subem_mean" in m]
    assert step == 0
    assert trainer.callback_metrics["val/subem_mean"] == pytest.approx(0.625)  # what checkpoint monitors read
    assert logged["val/one/subem"] == pytest.approx(0.75) and logged["val/two/subem"] == pytest.approx(0.5)
    assert logged["val/subem_mean"] == pytest.approx(0.625)
    assert {"val/one/em", "val/one/f1", "val/two/em", "val/two/f1"} <= logged.keys()
    results = {k: v for per_loader in trainer.test(module, datamodule=datamodule) for k, v in per_loader.items()}
    assert results["test/subem_mean"] == pytest.approx(0.2) and results["test/three/subem"] == pytest.approx(0.2)
    assert not any(k.startswith("val/") for k in results)
    assert len([m for _, m in logger.records if "test/subem_mean" in m]) == 1  # logged once, by Lightning
    stages = [stage for stage, _ in answering.recorded]
    assert stages.count("val") == 3 and stages.count("test") == 2  # 4 + 2 and 5 questions in batches of 3
    assert sorted(i for stage, ids in answering.recorded if stage == "test" for i in ids) == sorted(
        i.id for i in test_sets["three"]
    )
    datamodule.val_files, datamodule.val_sets = {"two": "-"}, {"two": sets["two"]}  # one loader: no dataloader_idx
    trainer.validate(module, datamodule=datamodule)
    assert trainer.callback_metrics["val/two/subem"] == pytest.approx(0.5)
    with pytest.raises(RuntimeError, match="carries no predictions; RolloutCallback"):
        module.validation_step(EvalSlot(sets["one"]), 0)  # nobody answered it


def test_checkpoint_hooks_drop_the_reference_and_restore_the_applied_step_count(lm_dir):
    from dspo.algorithms.config import AlgorithmConfig
    from dspo.models import ModelConfig
    from dspo.training.module import OptimizerConfig, _safe_key

    module = DSPOModule(ModelConfig(path=lm_dir), AlgorithmConfig(group_size=2, batch_groups=1), OptimizerConfig())
    module.weights_version = 7
    checkpoint = {"state_dict": {"policy.w": 1, "reference.w": 2, "referenced.x": 3}}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["state_dict"] == {"policy.w": 1, "referenced.x": 3}
    assert checkpoint["dspo"] == {"model_dir": lm_dir, "weights_version": 7}
    module.on_load_checkpoint({"dspo": {"weights_version": 5}, "global_step": 9})
    assert module.weights_version == 5
    module.on_load_checkpoint({"global_step": 9})  # a checkpoint from before weights_version was stored
    assert module.weights_version == 9
    module.on_load_checkpoint({})
    assert module.weights_version == 0
    assert _safe_key("nq.dev/v1") == "nq_dev_v1" and _safe_key("toy_2hop") == "toy_2hop"


def test_hooks_work_without_a_datamodule_or_a_state_dict(lm_dir):
    """Fitting with plain dataloaders (no datamodule) creates no eval metrics; a checkpoint dict without a state
    dict still gets dspo's entry."""
    from types import SimpleNamespace

    from dspo.algorithms.config import AlgorithmConfig
    from dspo.models import ModelConfig
    from dspo.training.module import OptimizerConfig

    module = DSPOModule(ModelConfig(path=lm_dir), AlgorithmConfig(group_size=2, batch_groups=1), OptimizerConfig())
    module._trainer = SimpleNamespace(datamodule=None)
    module.setup("fit")
    assert len(module.eval_metrics) == 0
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(val_benchmarks=["a.b"]))  # no test_benchmarks
    module.setup("fit")
    assert set(module.eval_metrics) == {"val__a_b", "test__a_b"}
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint == {"dspo": {"model_dir": lm_dir, "weights_version": 0}}
