"""A run preempted at any step ends as an uninterrupted one does (issue 70, item 5).

The toy default (shortened, one optimizer step a round, transformers engine), 3 steps: once uninterrupted, then once
per step s = 1, 2, 3 with SIGUSR1 at step s's end (`dspo.testing.signal_at_step`), resumed with `ckpt_path=last`. A
job preempted in its last round used to save `last.ckpt` at max_steps and be refused on resume as "nothing to train"
(reported failed, its test pass never run). Each resumed run must end `finished` at step 3 with the uninterrupted
run's metric and test results, and the preempted attempt's status must say `preempted` at step s.

The runs share one Python process (a subprocess of the test, so signals and Hydra's state stay out of pytest's):
`dspo.train.train` as `dspo-train` calls it, 7 runs without 7 interpreter start-ups."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = 3

SCRIPT = """
import json, sys
from pathlib import Path
from dspo.sweeps.status import read_status
from dspo.testing import compose_config
from dspo.train import train

base, outputs, steps = json.loads(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])

def run(name, extra):
    folder = outputs / "train" / f"{name}_0"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = compose_config("train", [*base, f"run_name={name}", f"output_dir={folder}", *extra])
    return train(cfg), folder

def outcome(folder, returned):
    status = read_status(folder)
    test = json.loads((folder / "test" / "results.json").read_text())
    return {"status": {k: status.get(k) for k in ("state", "step", "max_steps", "metric")}, "returned": returned,
            "test": test, "model": (folder / "model" / "config.json").is_file()}

returned, folder = run("whole", [])
results = {"whole": outcome(folder, returned)}
for step in range(1, steps + 1):
    preempt = ["+callbacks.preempt._target_=dspo.testing.signal_at_step", f"+callbacks.preempt.step={step}"]
    first, folder = run(f"cut{step}", preempt)
    stopped = {k: read_status(folder).get(k) for k in ("state", "step", "max_steps")}
    returned, folder = run(f"cut{step}", ["ckpt_path=last"])
    results[f"cut{step}"] = {**outcome(folder, returned), "stopped": stopped}
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.slow
def test_a_run_preempted_at_any_step_ends_as_the_uninterrupted_one(toy_cache, short_default_hf, tmp_path) -> None:
    from tests.conftest import train_env

    base = [*short_default_hf, "algorithm.num_minibatches=1", f"trainer.max_steps={STEPS}"]
    base += ["trainer.val_check_interval=100", "callbacks.validate_at_start=null", "logger=csv", "data.test_limit=8"]
    outputs = tmp_path / "outputs"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(base), str(outputs), str(STEPS)],
        env=train_env(toy_cache, outputs),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    results = json.loads(line.removeprefix("RESULTS "))
    whole = results.pop("whole")
    assert whole["status"]["state"] == "finished" and whole["status"]["step"] == STEPS and whole["model"]
    for step in range(1, STEPS + 1):
        cut = results[f"cut{step}"]
        assert cut["stopped"] == {"state": "preempted", "step": step, "max_steps": STEPS}, cut
        assert cut["status"] == whole["status"] and cut["returned"] == whole["returned"], (step, cut, whole)
        assert cut["test"] == whole["test"] and cut["model"], step
    assert "finishing it: no training" in result.stdout + result.stderr  # the step-3 case took the finishing path
