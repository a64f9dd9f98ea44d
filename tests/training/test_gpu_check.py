"""`python -m dspo.gpu_check --cpu`: the GPU check's code, run on the CPU with small shapes so that it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dspo.train import CONF_DIR
from dspo.training import gpu_check

REPO = Path(__file__).resolve().parents[2]


def test_head_check_passes_and_catches_a_wrong_backward(monkeypatch):
    results = gpu_check.check_head(torch.device("cpu"), gpu_check.CPU)
    assert results["passed"] and set(results) == {"fp32", "bf16-autocast", "passed"}
    assert max(results["fp32"]["relative_error"].values()) < 1e-5
    from dspo.models.logprobs import HeadLogprobs

    backward = HeadLogprobs.backward

    def off_by_a_percent(ctx, *grads):
        return tuple(g * 1.01 if isinstance(g, torch.Tensor) else g for g in backward(ctx, *grads))

    monkeypatch.setattr(HeadLogprobs, "backward", staticmethod(off_by_a_percent))
    wrong = gpu_check.check_head(torch.device("cpu"), gpu_check.CPU)
    assert not wrong["fp32"]["passed"] and not wrong["passed"]
    assert wrong["fp32"]["relative_error"]["logprobs"] == 0.0  # only the gradients differ


def test_cpu_mode_runs_the_fsdp2_bf16_step_and_writes_json(tmp_path):
    """The same code as on CUDA: a one-process FSDP2 group (gloo here, nccl there), bf16 autocast, fused AdamW."""
    output = tmp_path / "cpu.json"
    command = [
        sys.executable,
        "-m",
        "dspo.training.gpu_check",
        "--cpu",
        "--parts",
        "head,fsdp",
        "--output",
        str(output),
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "FSDP2 step:" in result.stdout and str(output) in result.stdout
    results = json.loads(output.read_text())
    assert results["mode"] == "cpu" and results["passed"] and "train" not in results
    step = results["fsdp_step"]
    assert step["sharded_fsdp2"] and step["loss_finite"] and step["parameters"] > 0
    assert step["step_flops"] > 0 and step["bf16_matmul_flops_per_s"] > 0 and step["fraction_of_matmul_rate"] > 0
    assert len(step["step_seconds"]) == 2 and results["environment"]["torch"] == torch.__version__


def test_cuda_mode_trains_ten_steps_of_the_toy_default_on_the_gpu_and_its_command_composes(tmp_path):
    command = gpu_check.train_command(cuda=True, steps=10)
    assert command[:3] == [sys.executable, "-m", "dspo.train"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*command[3:], f"output_dir={tmp_path}"])
    assert cfg.rollout.engine._target_.endswith("HFEngine") and cfg.rollout.engine.device == "cuda"
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed" and cfg.trainer.max_steps == 10
    assert gpu_check.CUDA.vocab == 151_936 and gpu_check.CUDA.train_steps == 10


def test_an_unknown_part_is_refused():
    result = subprocess.run(
        [sys.executable, "-m", "dspo.training.gpu_check", "--cpu", "--parts", "head,gpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "unknown ['gpu']" in result.stderr


@pytest.mark.slow
def test_cpu_mode_trains_with_the_hf_engine_and_without_vllm(toy_cache, tmp_path):
    blocker = tmp_path / "no_vllm" / "vllm"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("vllm is not installed on this (simulated) GPU box")\n')
    env = {
        **os.environ,
        "DSPO_CACHE": str(toy_cache),
        "PYTHONPATH": os.pathsep.join([str(blocker.parent), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    output = tmp_path / "cpu.json"
    results = gpu_check.run(cpu=True, parts=["train"], output=output, env=env)
    train = results["train"]
    assert train["passed"], train["log_tail"]
    assert train["global_step"] == 2 and "test/subem_mean" in train["metrics"]
    assert "rollout=hf" in train["command"] and json.loads(output.read_text())["passed"]
