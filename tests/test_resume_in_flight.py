"""A k = 1 run preempted at a round boundary and resumed logs the scalars of the run never stopped, bit for bit
(issue 74).

The toy default (shortened, one optimizer step a round, the transformers engine) at `rollout.max_staleness=1`: once
uninterrupted, then once per round boundary with SIGUSR1 at its end (`dspo.testing.signal_at_step`), resumed with
`ckpt_path=last`; and the deep miniature with partial rollouts, preempted at two boundaries. The checkpoint stores the
round the engine process generated but the trainer had not trained, the engine process's sampler position, keep-rate
prior, RNG states and carried episodes (`dspo.rollout.in_flight`); before, the resumed run regenerated that round at the
restored weights with staleness 0 and dropped the carried episodes, and its scalars differed from the next step on.

Compared: every scalar either run logged (CSV logger, every session's file), but wall-clock ones (`*_s`,
`*_per_s`), which differ between two uninterrupted runs too. Two things are not differences: the validation
Lightning runs when a run stops (the preempted attempt logs `val/*` at its last step), and a key the uninterrupted run
shows at a step only because Lightning repeats a key logged at an earlier step with its earlier value (a round whose
agent made no call of some invalid kind logs no `rollout/invalid/<tool>/<kind>`; the resumed session has no earlier
value to repeat). The runs share one Python process (a subprocess of the test), as tests/test_preempt_every_step.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import csv, json, sys
from pathlib import Path
from dspo.testing import compose_config
from dspo.train import train

base, outputs, cuts = json.loads(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])

def run(name, extra):
    folder = outputs / "train" / f"{name}_0"
    folder.mkdir(parents=True, exist_ok=True)
    train(compose_config("train", [*base, f"run_name={name}", f"output_dir={folder}", *extra]))
    return folder

def scalars(folder):
    steps = {}
    for path in sorted((folder / "csv").glob("*/metrics.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                steps.setdefault(row["step"], {}).update({k: v for k, v in row.items() if v and k != "step"})
    return steps

results = {"whole": scalars(run("whole", []))}
for step in cuts:
    preempt = ["+callbacks.preempt._target_=dspo.testing.signal_at_step", f"+callbacks.preempt.step={step}"]
    run(f"cut{step}", preempt)
    results[str(step)] = scalars(run(f"cut{step}", ["ckpt_path=last"]))
print("RESULTS " + json.dumps(results))
"""

BASE = [
    "rollout.max_staleness=1",
    "algorithm.group_size=4",
    "algorithm.batch_groups=2",
    "algorithm.micro_batch_size=4",
    "algorithm.num_minibatches=1",
    "rollout=hf",
    "trainer.val_check_interval=100",
    "callbacks.validate_at_start=null",
    "callbacks.rollout.sample_every_n_rounds=0",
    "logger=csv",
    "run_test=false",
    "data.val_limit=4",
]


def wall_clock(key: str) -> bool:
    return key.endswith("_s")


def differences(whole: dict, cut: dict, stopped_at: int) -> list[tuple]:
    """(step, key, uninterrupted, resumed) for every scalar that differs (module docstring)."""
    found, before = [], {}
    for step in sorted(set(whole) | set(cut), key=int):
        ours, theirs = whole.get(step, {}), cut.get(step, {})
        for key, value in theirs.items():
            on_stop = key.startswith("val/") and int(step) == stopped_at and key not in ours
            if not wall_clock(key) and not on_stop and ours.get(key) != value:
                found.append((step, key, ours.get(key), value))
        for key, value in ours.items():
            repeated = before.get(key) == value
            if not wall_clock(key) and key not in theirs and not repeated:
                found.append((step, key, value, None))
        before.update(ours)
    return found


def preempt_and_resume(toy_cache: Path, tmp_path: Path, args: list[str], cuts: list[int]) -> dict:
    from tests.conftest import train_env

    outputs = tmp_path / "outputs"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(args), str(outputs), json.dumps(cuts)],
        env=train_env(toy_cache, outputs),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    return json.loads(line.removeprefix("RESULTS "))


def check_equal(results: dict, steps: int) -> None:
    whole = results.pop("whole")
    assert sorted(int(s) for s in whole) == list(range(steps)) and results
    for stopped_at, cut in results.items():
        assert set(cut) == set(whole), stopped_at  # the resumed run logs every step
        assert differences(whole, cut, int(stopped_at)) == [], stopped_at


@pytest.mark.slow
def test_a_k1_run_preempted_at_each_round_boundary_logs_the_uninterrupted_scalars(toy_cache, tmp_path) -> None:
    steps = 4
    results = preempt_and_resume(toy_cache, tmp_path, [*BASE, f"trainer.max_steps={steps}"], [1, 2, 3])
    whole = results["whole"]
    assert all(float(whole[s]["rollout/staleness_max"]) == 1.0 for s in whole if s != "0")  # k = 1: one round behind
    check_equal(results, steps)


@pytest.mark.slow
def test_partial_rollouts_preempted_and_resumed_carry_their_episodes_exactly(toy_cache, tmp_path) -> None:
    steps = 5
    args = [*BASE, "experiment=toy_deep", "rollout.partial_rollouts=true", f"trainer.max_steps={steps}"]
    results = preempt_and_resume(toy_cache, tmp_path, args, [2, 3])
    carried = [float(row.get("rollout/carried_groups", 0)) for row in results["whole"].values()]
    finished_later = [float(row.get("rollout/partial_share", 0)) for row in results["whole"].values()]
    assert max(carried) > 0 and max(finished_later) > 0  # episodes were carried across a boundary, and finished
    check_equal(results, steps)
