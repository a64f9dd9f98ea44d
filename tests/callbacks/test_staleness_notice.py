"""Issue 38: `RolloutCallback` tells, when the run is built, that the configured rollout correction does not
correct rounds sampled ahead of training (`dspo.algorithms.rollout_correction.staleness_notice`)."""

import logging

import pytest

from dspo.algorithms.config import AlgorithmConfig
from dspo.callbacks.rollout_callback import RolloutCallback
from dspo.models import ModelConfig

LOGGER = "dspo.rollout.settings"  # where RolloutCallback's settings are checked


def _build(mode: str, max_staleness: int, caplog) -> list[logging.LogRecord]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        algorithm = AlgorithmConfig(rollout_correction={"mode": mode})
        RolloutCallback(None, None, None, algorithm, ModelConfig(path="unused"), max_staleness=max_staleness)
    return [r for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize(("mode", "k", "level"), [("none", 1, "WARNING"), ("seq_rs", 2, "WARNING"),
                                                   ("seq_tis", 1, "INFO")])  # fmt: skip
def test_a_correction_that_does_not_correct_staleness_is_reported(mode: str, k: int, level: str, caplog) -> None:
    (record,) = _build(mode, k, caplog)
    assert record.levelname == level
    assert f"algorithm.rollout_correction.mode={mode}" in record.getMessage()
    assert f"rollout.max_staleness={k}" in record.getMessage()


@pytest.mark.parametrize(("mode", "k"), [("none", 0), ("seq_tis", 0), ("seq_prod_tis", 1)])
def test_nothing_is_reported_at_k_0_or_with_the_importance_weight(mode: str, k: int, caplog) -> None:
    assert _build(mode, k, caplog) == []
