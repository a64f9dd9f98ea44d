"""`dspo-train model.lora.r=8` end to end on the toy default (issue 44), with vLLM: the engine, loaded with the merged
weights every round, scores the sampled tokens as the trainer does; the KL against the base starts at 0; the export is
a plain merged model with the adapter beside it; `last.ckpt` holds the adapters only and resumes."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from dspo.sweeps.analysis import find_runs, load_scalars

ALLOWED_NOTICES = ("NUMA binding: Using MEMBIND policy",)  # as tests/test_train.py


@pytest.mark.slow
def test_dspo_train_with_lora_from_the_readme(toy_cache, run_train, short_default, tmp_path):
    outputs = tmp_path / "outputs"
    args = ["model.lora.r=8", *short_default, "trainer.max_steps=4", "algorithm.kl_coef=0.01", "run_name=lora"]
    result = run_train(args, outputs)
    text = result.stdout + result.stderr
    lines = [line for line in text.splitlines() if re.search(r"warn", line, re.I)]
    warnings = [line for line in lines if not any(notice in line for notice in ALLOWED_NOTICES)]
    assert not warnings, warnings
    assert re.search(r"LoRA \(model.lora\): [\d,]+ trained parameters of [\d,]+", text)
    (run,) = find_runs(outputs / "train")
    scalars = load_scalars(run.dir)
    # vLLM (merged weights) and the trainer (base + adapters) both fp32 on CPU: logprobs agree to float noise
    diff = scalars[scalars.tag == "mismatch/logprob_diff_abs_mean"].sort_values("step").value
    assert len(diff) == 4 and (diff < 1e-3).all(), diff.tolist()
    kl = scalars[scalars.tag == "loss/kl"].sort_values("step").value.tolist()
    assert abs(kl[0]) < 1e-7 and max(kl[1:]) > 0  # B = 0 at the start: the policy is the reference, then moves
    start = load_file(str(toy_cache / "toyworld" / "default" / "model" / "model.safetensors"))
    end = load_file(str(run.dir / "model" / "model.safetensors"))
    assert start.keys() == end.keys() and any(not torch.equal(start[k], end[k]) for k in start)
    assert (run.dir / "model_adapter" / "adapter_model.safetensors").is_file()
    last = run.dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True, map_location="cpu")
    assert checkpoint["state_dict"] and all(".lora_" in k for k in checkpoint["state_dict"])
    resume = [
        "model.lora.r=8", *short_default, "rollout=hf", "trainer.max_steps=6", "algorithm.kl_coef=0.01",
        "run_name=lora", "ckpt_path=last", "run_test=false",
    ]  # fmt: skip
    run_train(resume, outputs)
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 6
