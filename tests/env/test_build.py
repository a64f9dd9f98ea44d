"""The reward layers end to end (issue 73): `env/reward=[judge,rubric]` trains 4 steps on the toy, logs the judge's and
the rubric's components, and its test report scores the judge beside subEM and pins the judge; `dspo-eval` of the
exported model adopts the layers from the run's record and pins the same judge."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import yaml

from dspo.eval.pipeline import read_results
from dspo.testing import run_to_exit
from tests.conftest import train_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_judge_and_rubric_train_on_the_toy_and_their_report_pins_the_judge(
    run_train, short_default_hf, toy_cache, tmp_path
):
    layers = ["env/reward=[judge,rubric]", "+env.reward.rubric.criteria.judge=1.0", "env.reward.rubric.outcome=judge"]
    outputs = tmp_path / "outputs"
    run_train([*short_default_hf, *layers, "trainer.max_steps=4", "run_name=layers"], outputs)
    (run,) = list((outputs / "train").glob("layers_*"))
    metrics = yaml.safe_load((run / "metrics.yaml").read_text())
    for name in ("judge", "judge_agrees", "judge_error", "judge_calls", "rubric", "format", "subem"):
        assert math.isfinite(metrics[f"reward/{name}"]), name
    assert metrics["reward/judge_error"] == 0.0  # the local judge picks a choice word: always a verdict
    rows, pinned = read_results(run / "test" / "results.json")
    judged = [row for name, row in rows.items() if name != "average"]
    assert judged and all({"subem", "em", "f1", "judge", "judge_agreement"} <= set(row) for row in judged)
    assert pinned["judge"]["model_digest"] and pinned["judge"]["prompt_digest"]
    assert "rubric" not in pinned["env"]["reward"]  # what trained, in the model's digest: not how the report scores

    out = tmp_path / "eval"  # the run's record: its env with both layers, its agent, its retriever
    command = [sys.executable, "-m", "dspo.eval.cli", f"model.path={run / 'model'}", f"eval.output_dir={out}"]
    result = run_to_exit(command, train_env(toy_cache, tmp_path / "cli"), 600, finished="results written to", cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "results.json").read_text() == (run / "test" / "results.json").read_text()  # the same report
