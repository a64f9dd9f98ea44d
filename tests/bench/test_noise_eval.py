"""bench/_noise_eval.py: what it pushes into the shared engine and which runs' settings it scores with."""

from __future__ import annotations

from pathlib import Path

import torch

from dspo.process.resources import data_dir


def test_a_model_is_pushed_with_its_tied_output_layer(bench) -> None:
    """The file stores a tied lm_head once (under the embedding's name); pushing only the file's tensors left the
    engine's output layer at the previous model's (measured: 1-hop 0.46 vs 0.48 of the model's own engine)."""
    weights = dict(bench("_noise_eval").model_weights(data_dir() / "toy_warmstart" / "model"))
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert any(name.startswith("model.layers.0.") for name in weights)


def test_a_run_is_scored_with_its_own_overrides_less_the_noise_and_hydras(bench, tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(
        "- seed=2\n- env=goal_reflect\n- env.tools.search.noise=0.3\n- hydra.sweep.dir=/x\n- +extra.key=1\n"
    )
    assert bench("_noise_eval").run_overrides(tmp_path) == ["seed=2", "env=goal_reflect", "+extra.key=1"]
