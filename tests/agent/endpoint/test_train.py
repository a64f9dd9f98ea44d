"""`dspo-train env=agent` end to end on the toy default, as docs/agents.md starts it: the example agent of
docs/examples trains through the endpoint, the endpoint's counters reach TensorBoard, the engine's logprobs agree with
the trainer's, a checkpoint is written, and the model it exports evaluates with the same agent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dspo.sweeps.analysis import find_runs, load_scalars

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"


@pytest.mark.slow
def test_train_env_agent_logs_the_endpoint_and_checkpoints(run_train, short_default, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")])))
    outputs = tmp_path / "outputs"
    run_train([*short_default, "env=agent", "trainer.max_steps=4", "run_name=agent", "run_test=false"], outputs)
    (run,) = find_runs(outputs)
    scalars = load_scalars(run.dir)
    tags = set(scalars.tag)
    for tag in ("rollout/prefix_breaks", "rollout/agent_errors", "rollout/samples_per_episode", "val/toy_2hop/subem"):
        assert tag in tags, f"{tag} missing; logged: {sorted(tags)}"
    value = scalars.set_index("tag").value
    assert (value["rollout/agent_errors"] == 0).all() and (value["rollout/prefix_breaks"] == 0).all()
    assert (value["rollout/tool_calls_mean"] > 0).all()  # the warm start searches through the example agent
    diff = scalars[scalars.tag == "mismatch/logprob_diff_abs_mean"].value
    assert len(diff) == 4 and (diff < 1e-3).all()  # the recorded engine logprobs are the trainer's, token for token
    assert (scalars[scalars.tag == "train/grad_norm"].value > 0).any()
    last = run.dir / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False, map_location="cpu")["global_step"] == 4
    assert '"agent": "openai_agent.agent"' in (run.dir / "model" / "dspo_run.json").read_text()
