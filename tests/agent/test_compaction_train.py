"""`dspo-train experiment=toy_deep` end to end at a tight context budget with `rollout.agent.overflow=compact`: the deep
miniature trains, compacted episodes become several samples whose engine logprobs agree with the trainer's (each
token scored in the context it was sampled from), and the counters reach TensorBoard."""

from __future__ import annotations

import pytest
import torch

from dspo.sweeps.analysis import find_runs, load_scalars

# a 2-hop episode with its prompt takes ~344 tokens on the toy: with two searches the second response only fits
# after the first is compacted
TIGHT = ["experiment=toy_deep", "rollout.agent.max_total_tokens=330", "rollout.agent.overflow=compact"]


@pytest.mark.slow
def test_toy_deep_trains_with_compacted_contexts(run_train, short_default, tmp_path):
    outputs = tmp_path / "outputs"
    args = [*short_default, *TIGHT, "algorithm.batch_groups=4", "trainer.max_steps=4", "run_name=compact"]
    run_train([*args, "run_test=false", "data.val_limit=8"], outputs)
    (run,) = find_runs(outputs)
    scalars = load_scalars(run.dir)
    value = scalars.set_index("tag").value
    for tag in ("rollout/compactions", "rollout/samples_per_episode", "val/toy_3hop/subem", "val/toy_4hop/subem"):
        assert tag in value.index, f"{tag} missing; logged: {sorted(set(scalars.tag))}"
    assert value["rollout/compactions"].sum() > 0  # the warm start searches twice on some 2-hop questions
    assert (value["rollout/samples_per_episode"] >= 1).all() and value["rollout/samples_per_episode"].max() > 1
    diff = scalars[scalars.tag == "mismatch/logprob_diff_abs_mean"].value
    assert len(diff) == 4 and (diff < 1e-3).all()  # segments carry the engine logprobs of their own context
    assert (scalars[scalars.tag == "train/grad_norm"].value > 0).any()
    assert torch.load(run.dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    assert '"overflow": "compact"' in (run.dir / "model" / "dspo_run.json").read_text()
