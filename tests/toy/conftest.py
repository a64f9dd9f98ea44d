"""A small toy world and its tokenizer, built once per test session for the toy-default tests."""

from __future__ import annotations

import pytest

from dspo.toy.warmstart import build_toy_tokenizer
from dspo.toy.world import ToyWorldConfig, build_toyworld

SMALL_WORLD = ToyWorldConfig(
    seed=5, num_countries=8, num_people=80, num_companies=40, num_rivers=8, num_distractors=20,
    num_train=40, num_val=20, num_test=20, num_demo=40,
)  # fmt: skip


@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    """(ToyWorldFiles of a small world, folder of a tokenizer trained on it)."""
    root = tmp_path_factory.mktemp("toy")
    world = build_toyworld(str(root / "world"), SMALL_WORLD)
    return world, build_toy_tokenizer(world, str(root / "tok"), vocab_size=1024)
