"""`model.lora` under DDP and FSDP2 with two gloo processes (issue 44): both ranks push the same merged weights, train
only the adapters, end identical, and a run resumed from the adapters-only checkpoint (a file under DDP, a folder of
shards under FSDP2) ends where the uninterrupted run does. β > 0: the reference is the base, on every rank. The FSDP2
case runs with gradient checkpointing (`model.gradient_checkpointing`)."""

from __future__ import annotations

import os
import socket
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dspo.training.module import DSPOModule

WORLD = 2
LORA = {"r": 4, "alpha": 8}


class Logged(DSPOModule):
    """Keeps every step's logged scalars."""

    def log_dict(self, dictionary, *args, **kwargs):
        if "train/loss" in dictionary:
            self.logged = [*getattr(self, "logged", []), dict(dictionary)]
        return super().log_dict(dictionary, *args, **kwargs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(strategy: str, rank: int, port: int, lm_dir: str, root: str) -> None:
    """Three fits on this rank: 4 steps in one go; 2 steps and a checkpoint; a fresh trainer resumed from it to 4."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from dspo.callbacks.rollout_callback import module_root
    from dspo.models.weights import policy_weights
    from dspo.rollout.sampler import RoundSampler
    from dspo.testing import toy_run
    from dspo.training.strategies import FSDP2Strategy

    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    os.environ.update({**env, "LOCAL_RANK": str(rank), "RANK": str(rank)})  # Lightning: processes already exist
    out, report = Path(root), {}
    for phase, max_steps, ckpt in (("whole", 4, None), ("first", 2, None), ("resumed", 4, str(Path(root) / "ck"))):
        run = toy_run(lm_dir, str(out / phase), max_steps, module_cls=Logged, lora=LORA, kl_coef=0.1)
        run.callback.producer.side.round_sampler = RoundSampler(run.agent, run.callback.algo, rank, WORLD)
        run.module.model_cfg.gradient_checkpointing = strategy == "fsdp2"  # LoRA + activation checkpointing + FSDP2
        trainer = pl.Trainer(
            accelerator="cpu", devices=WORLD, max_steps=max_steps, callbacks=[run.callback], logger=False,
            strategy=FSDP2Strategy() if strategy == "fsdp2" else DDPStrategy(process_group_backend="gloo"),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            num_sanity_val_steps=0, default_root_dir=str(out / phase),
        )  # fmt: skip
        torch.manual_seed(0)  # the adapters' random A: the same in every run and on every rank, as dspo-train seeds
        trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt)
        module = run.module
        trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
        report[phase] = {
            "step": trainer.global_step,
            "logged": module.logged,
            "pushes": run.engine.pushes,
            "final": dict(policy_weights(module_root(trainer, module))),  # merged, gathered (every rank calls it)
            "trainable": trainable,
            "checkpointing": module.policy.is_gradient_checkpointing,
            "reference": module.reference,
            "adam_steps": {int(s["step"]) for s in trainer.optimizers[0].state.values()},
            "adam_params": len(trainer.optimizers[0].state),
        }
        if phase == "first":
            trainer.save_checkpoint(str(out / "ck"))
    torch.save(report, out / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lora_under_ddp_and_fsdp2_pushes_merged_weights_and_resumes_exactly(tmp_path, strategy):
    from dspo.testing import build_toy_lm

    lm_dir = build_toy_lm(str(tmp_path / "lm"))
    mp.spawn(partial(_worker, strategy), args=(_free_port(), lm_dir, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    from dspo.models import ModelConfig, load_causal_lm

    base = load_causal_lm(ModelConfig(path=lm_dir)).state_dict()
    for phase, steps in (("whole", 4), ("first", 2), ("resumed", 4)):
        assert [r[phase]["step"] for r in ranks] == [steps, steps]
        assert [r[phase]["reference"] for r in ranks] == [None, None]  # β > 0, no second model
        assert [r[phase]["checkpointing"] for r in ranks] == [strategy == "fsdp2"] * WORLD
        trainable = ranks[0][phase]["trainable"]
        assert trainable and all(".lora_" in n for n in trainable)
        assert ranks[0][phase]["adam_params"] == len(trainable)  # AdamW state for the adapters only
        for (va, a), (vb, b) in zip(ranks[0][phase]["pushes"], ranks[1][phase]["pushes"]):
            assert va == vb and a.keys() == b.keys() == base.keys()  # merged: the base model's names
            assert all(torch.equal(a[k], b[k]) for k in a)
        for name, tensor in ranks[0][phase]["final"].items():
            assert torch.equal(tensor, ranks[1][phase]["final"][name]), name
    whole, resumed = ranks[0]["whole"], ranks[0]["resumed"]
    # the engines start with the base (version 0): pushed after each applied step, the resumed run's from step 2
    assert [v for v, _ in whole["pushes"]] == [1, 2, 3] and [v for v, _ in resumed["pushes"]] == [2, 3]
    assert resumed["adam_steps"] == {4}
    # the resumed run's first push is the first run's end; its steps 3-4 log what the uninterrupted run logged
    first_end = ranks[0]["first"]["final"]
    assert all(torch.equal(resumed["pushes"][0][1][k], first_end[k]) for k in first_end)
    for want, got in zip(whole["logged"][2:], resumed["logged"]):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
    for name, tensor in whole["final"].items():
        torch.testing.assert_close(resumed["final"][name], tensor, rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(whole["final"][k], base[k]) for k in base)  # training moved the merged weights
    if strategy == "fsdp2":  # the distributed checkpoint: shards of the adapters, no frozen base
        from torch.distributed.checkpoint import FileSystemReader

        keys = [
            k for k in FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata if "state_dict." in k
        ]
        assert keys and all(k.startswith("state_dict.policy.") and ".lora_" in k for k in keys)
    else:
        keys = torch.load(tmp_path / "ck", weights_only=True)["state_dict"].keys()
        assert keys and all(k.startswith("policy.") and ".lora_" in k for k in keys)


def _bf16_worker(rank: int, port: int, lm_dir: str, root: str) -> None:
    """Two FSDP2 steps with a bfloat16 base (`model.dtype=bfloat16`): what this rank's policy and pushes hold."""
    import lightning.pytorch as pl

    from dspo.callbacks.rollout_callback import module_root
    from dspo.models.weights import policy_weights
    from dspo.rollout.sampler import RoundSampler
    from dspo.testing import toy_run
    from dspo.training.strategies import FSDP2Strategy

    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    os.environ.update({**env, "LOCAL_RANK": str(rank), "RANK": str(rank)})
    run = toy_run(lm_dir, root, 2, lora=LORA, kl_coef=0.1)
    run.callback.producer.side.round_sampler = RoundSampler(run.agent, run.callback.algo, rank, WORLD)
    run.module.model_cfg.dtype = "bfloat16"
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=2, callbacks=[run.callback], logger=False,
        strategy=FSDP2Strategy(), enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(run.module, datamodule=run.datamodule)
    params = dict(run.module.policy.named_parameters())
    report = {
        "step": trainer.global_step,
        "dtypes": {(".lora_" in n, p.dtype, p.requires_grad) for n, p in params.items()},
        "pushes": run.engine.pushes,
        "final": dict(policy_weights(module_root(trainer, run.module))),
        "adam_params": len(trainer.optimizers[0].state),
        "trainable": sum(p.requires_grad for p in params.values()),
    }
    torch.save(report, Path(root) / f"bf16_rank{rank}.pt")


@pytest.mark.slow
def test_fsdp2_trains_fp32_adapters_on_a_bf16_base(tmp_path):
    """The single-GPU memory plan (docs/scaling.md) sharded: a frozen bf16 base, fp32 adapters that AdamW updates
    without rounding them away, merged pushes in the base's dtype and names, the same on both ranks."""
    from dspo.testing import build_toy_lm

    lm_dir = build_toy_lm(str(tmp_path / "lm"))
    mp.spawn(_bf16_worker, args=(_free_port(), lm_dir, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"bf16_rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for report in ranks:
        assert report["step"] == 2
        assert report["dtypes"] == {(False, torch.bfloat16, False), (True, torch.float32, True)}
        assert report["adam_params"] == report["trainable"] > 0
    pushes = [r["pushes"] for r in ranks]
    assert [v for v, _ in pushes[0]] == [1]  # after step 1, before step 2's round
    for (_, a), (_, b) in zip(*pushes):
        assert all(t.dtype == torch.bfloat16 for t in a.values()) and all(torch.equal(a[k], b[k]) for k in a)
    from dspo.models import ModelConfig, load_causal_lm

    base = load_causal_lm(ModelConfig(path=lm_dir, dtype="bfloat16")).state_dict()
    pushed = pushes[0][0][1]
    assert pushed.keys() == base.keys()
    assert any(not torch.equal(pushed[k], base[k]) for k in base)  # one step of fp32 adapters moved bf16 weights
    for name, tensor in ranks[0]["final"].items():
        assert torch.equal(tensor, ranks[1]["final"][name]), name
