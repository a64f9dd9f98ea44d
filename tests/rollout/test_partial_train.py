"""`dspo-train experiment=toy_deep rollout.max_staleness=1 rollout.partial_rollouts=true` end to end (issue 43 point
3): rounds stop on enough finished groups, the unfinished ones are carried and finished on newer weights, their tokens'
staleness stays within the bound, and the counters reach TensorBoard."""

from __future__ import annotations

import pytest
import torch

from dspo.sweeps.analysis import find_runs, load_scalars

PARTIAL = ["experiment=toy_deep", "rollout.max_staleness=1", "rollout.partial_rollouts=true"]


@pytest.mark.slow
def test_toy_deep_trains_with_partial_rollouts(run_train, short_default, tmp_path):
    outputs = tmp_path / "outputs"
    args = [*short_default, *PARTIAL, "trainer.max_steps=6", "trainer.val_check_interval=1000", "run_name=partial"]
    run_train([*args, "run_test=false", "data.val_limit=4"], outputs)
    (run,) = find_runs(outputs)
    scalars = load_scalars(run.dir)
    value = scalars.set_index("tag").value
    tags = ("rollout/partial_share", "rollout/carried_groups", "rollout/token_staleness/2", "rollout/kept_len_mean")
    for tag in tags:
        assert tag in value.index, f"{tag} missing; logged: {sorted(set(scalars.tag))}"
    assert value["rollout/carried_groups"].max() > 0  # deep episodes: some groups outlast the round's generation
    assert value["rollout/partial_share"].max() > 0  # and finish on newer weights in a later round
    assert value["rollout/token_staleness_max"].max() == 2.0  # max_token_age defaults to max_staleness + 1
    assert value["rollout/staleness_max"].max() <= 2.0
    assert torch.isfinite(torch.tensor(value["mismatch/weight_mean"].to_numpy())).all()
    assert (scalars[scalars.tag == "train/grad_norm"].value > 0).any()
    assert torch.load(run.dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
