"""The registry shape every named choice of an algorithm config uses (issue 30): records added at test time (the
built-in ones were registered at import), lookups, removal, and settings made from a config's keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dspo.algorithms.advantages import ADVANTAGES, AdvantageEstimator, register_advantage
from dspo.algorithms.filters import FILTERS, register_filter
from dspo.algorithms.losses import ClipRange, Objective
from dspo.algorithms.registry import Registry, make_settings


def test_a_registry_holds_named_records_and_names_its_config_key():
    registry: Registry[int] = Registry("widget", "algorithm.widget")
    assert (registry.kind, registry.config_key, len(registry), list(registry)) == ("widget", "algorithm.widget", 0, [])
    registry.add("a", 1)
    registry.add("b", 2)
    registry.add("a", 3)  # registered again (a module imported twice): replaced
    assert registry["a"] == 3 and "b" in registry and "c" not in registry and dict(registry.items()) == {"a": 3, "b": 2}
    with pytest.raises(KeyError) as error:
        registry["c"]
    assert error.value.args[0] == "unknown widget 'c' (config key algorithm.widget); choose one of ['a', 'b']"
    assert registry.pop("b") == 2 and "b" not in registry and registry.pop("b", -1) == -1 and registry.pop("b") is None


@dataclass(frozen=True)
class Knobs:
    size: int = 3
    rate: float = 0.5


def test_settings_come_from_the_defaults_and_a_configs_keywords():
    assert make_settings(Knobs(), {"rate": 0.25}, "algorithm.loss_kwargs", "objective 'x'") == Knobs(3, 0.25)
    assert make_settings(Knobs(), None, "k", "o") == Knobs() and make_settings(None, {}, "k", "o") is None
    with pytest.raises(ValueError) as error:
        make_settings(Knobs(), {"depth": 1}, "algorithm.loss_kwargs", "objective 'x'")
    assert (
        str(error.value)
        == "algorithm.loss_kwargs.depth: objective 'x' has no setting 'depth' (its settings: size, rate)"
    )
    with pytest.raises(
        ValueError, match=r"^algorithm.advantage_kwargs.eps: estimator 'y' has no setting 'eps' \(it has no settings\)$"
    ):
        make_settings(None, {"eps": 1.0}, "algorithm.advantage_kwargs", "estimator 'y'")


def test_records_check_their_facts_and_call_their_functions():
    with pytest.raises(ValueError) as error:
        Objective("toy", lambda *a: None, normalizer_unit="word")
    assert str(error.value) == "objective 'toy': normalizer_unit must be one of ('sequence', 'token'), got 'word'"
    with pytest.raises(ValueError, match="^objective 'toy': ratio_level must be one of .*, got 'chunk'$"):
        Objective("toy", lambda *a: None, ratio_level="chunk")
    assert Objective("toy", print, settings=ClipRange(0.1, 0.2)).make_settings({"clip_low": 0.3}) == ClipRange(0.3, 0.2)

    def scaled(rewards, settings):
        return rewards * settings.size

    estimator = AdvantageEstimator("scaled", scaled, Knobs(size=2))
    rewards = torch.tensor([[1.0, 0.0]])
    assert estimator(rewards).tolist() == [[2.0, 0.0]]  # its default settings
    assert estimator(rewards, Knobs(size=5)).tolist() == [[5.0, 0.0]]  # the config's
    assert estimator.make_settings({"size": 4}) == Knobs(4, 0.5)


def test_decorators_register_records_with_their_defaults():
    """Called at test time: mutation testing switches a mutant on after the built-ins were registered at import."""
    try:
        register_filter("toy_default")(lambda rewards: rewards[:, 0] > 0)
        record = FILTERS["toy_default"]
        assert record.name == "toy_default" and record.keeps_everything is False

        def doubled(rewards, settings):
            return rewards * 2

        assert register_advantage("toy_doubled", settings=Knobs())(doubled) is doubled
        estimator = ADVANTAGES["toy_doubled"]
        assert (estimator.name, estimator.estimate, estimator.settings) == ("toy_doubled", doubled, Knobs())
    finally:
        FILTERS.pop("toy_default")
        ADVANTAGES.pop("toy_doubled")
