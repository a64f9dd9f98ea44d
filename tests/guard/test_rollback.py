"""A rollback on a real Lightning trainer (issue 70, item 7: `dspo.guard.rollback` was reached only by the slow
end-to-end runs): `restore` puts a checkpoint's weights, AdamW state and schedule into the running trainer at the
scaled rate and moves `weights_version`; it refuses a checkpoint of another policy naming the file, reads no pickled
code, loads into CPU memory, takes LoRA checkpoints without their frozen base and folder checkpoints through the
strategy; and the guard does all of it in a toy run before the round's checkpoint is written. The toy runs
(`dspo.testing.toy_run`, a tiny causal LM on CPU) take about a second each."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

import dspo.guard.rollback as rollback
from dspo.callbacks.checkpoints import RoundCheckpoint
from dspo.guard.callback import Guard
from dspo.guard.rollback import restore, set_lr_scale
from dspo.testing import build_toy_lm, toy_run

LR, WARMUP = 1e-2, 4  # the toy schedule: LambdaLR, factor (step + 1) / (WARMUP + 1) up to 1


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    return build_toy_lm(str(tmp_path_factory.mktemp("toy_lm")))


class Snapshot(pl.Callback):
    """At step `at`: the checkpoint file, and copies of the weights, the AdamW state and the schedule it holds."""

    def __init__(self, path: Path, at: int = 1) -> None:
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.at:
            return
        trainer.save_checkpoint(str(self.path))
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items() if k.startswith("policy.")}
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.scheduler = copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict())


def trained(lm_dir: str, root: Path, steps: int = 3, **kwargs) -> tuple[SimpleNamespace, Snapshot]:
    """A toy run of `steps` steps with the step-1 checkpoint and what it holds."""
    snapshot = Snapshot(root / "step1.ckpt")
    run = toy_run(lm_dir, str(root), steps, lr=LR, warmup_steps=WARMUP, callbacks=(snapshot,), **kwargs)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return run, snapshot


def same_weights(module, weights: dict[str, torch.Tensor]) -> bool:
    state = module.state_dict()
    return all(torch.equal(state[k], v) for k, v in weights.items())


def same_adamw_state(optimizer: torch.optim.Optimizer, expected: dict) -> bool:
    state = optimizer.state_dict()["state"]
    return state.keys() == expected["state"].keys() and all(
        torch.equal(state[i][name], value) for i in state for name, value in expected["state"][i].items()
    )


def test_restore_loads_the_weights_adamw_state_and_schedule_at_the_scaled_rate(lm_dir, tmp_path):
    run, snapshot = trained(lm_dir, tmp_path)
    trainer, module = run.trainer, run.module
    assert not same_weights(module, snapshot.weights) and module.weights_version == 3  # two more steps trained
    restore(trainer, module, str(snapshot.path), 0.25)
    optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
    assert same_weights(module, snapshot.weights) and same_adamw_state(optimizer, snapshot.optimizer)
    assert scheduler.last_epoch == snapshot.scheduler["last_epoch"] == 1
    # the rate: optimizer.lr x 0.25, at step 1 of the warm-up: factor (1 + 1) / (4 + 1)
    assert scheduler.base_lrs == [pytest.approx(LR * 0.25)]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.25 * 2 / 5)
    assert module.weights_version == 4  # moved on: the engine gets the restored weights before its next round


def test_restore_reads_the_checkpoint_into_cpu_memory_whatever_device_wrote_it(lm_dir, tmp_path, monkeypatch):
    """A rollback must not place a second copy of the weights and the optimizer state on the accelerator (nor need
    the device that wrote the file): the file here says its tensors were on cuda:0, on a machine without CUDA."""
    import torch.serialization as serialization

    run, snapshot = trained(lm_dir, tmp_path)
    checkpoint = torch.load(snapshot.path, weights_only=True)
    on_cuda = tmp_path / "cuda.ckpt"
    with monkeypatch.context() as patched:
        patched.setattr(serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(checkpoint, on_cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    restore(run.trainer, run.module, str(on_cuda), 1.0)
    assert same_weights(run.module, snapshot.weights)


class Touch:
    """A pickled object whose unpickling creates a file (what a crafted checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_restore_reads_no_pickled_code_even_where_the_environment_allows_it(lm_dir, tmp_path, monkeypatch):
    """torch.load with weights_only=True, explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 turns only torch's default
    off."""
    run, snapshot = trained(lm_dir, tmp_path)
    checkpoint = torch.load(snapshot.path, weights_only=True)
    crafted, marker = tmp_path / "crafted.ckpt", tmp_path / "ran"
    torch.save({**checkpoint, "extra": Touch(marker)}, crafted)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError):
        restore(run.trainer, run.module, str(crafted), 0.5)
    assert not marker.exists()


def test_restore_refuses_a_checkpoint_of_another_policy_naming_the_file(lm_dir, tmp_path):
    run, snapshot = trained(lm_dir, tmp_path)
    checkpoint = torch.load(snapshot.path, weights_only=True)
    extra = tmp_path / "extra.ckpt"
    state = dict(checkpoint["state_dict"])
    state["policy.extra.weight"] = torch.zeros(1)
    torch.save({**checkpoint, "state_dict": state}, extra)
    with pytest.raises(RuntimeError) as error:
        restore(run.trainer, run.module, str(extra), 0.5)
    assert (
        str(error.value) == f"guard: {extra} does not match the policy (missing [], unexpected ['policy.extra.weight'])"
    )
    order = list(checkpoint["state_dict"])
    dropped = order[1:6]  # five trained weights missing: the message names the first three
    short = tmp_path / "short.ckpt"
    torch.save(
        {**checkpoint, "state_dict": {k: v for k, v in checkpoint["state_dict"].items() if k not in dropped}}, short
    )
    with pytest.raises(RuntimeError) as error:
        restore(run.trainer, run.module, str(short), 0.5)
    assert str(error.value) == f"guard: {short} does not match the policy (missing {dropped[:3]}, unexpected [])"


def test_restore_takes_a_lora_checkpoint_without_its_frozen_base(lm_dir, tmp_path):
    """LoRA checkpoints hold the adapters only (the base is reloaded from model.path): the frozen base weights are
    missing from the file and must not count as a mismatch."""
    run, snapshot = trained(lm_dir, tmp_path, lora={"r": 4})
    stored = torch.load(snapshot.path, weights_only=True)["state_dict"]
    assert stored and len(stored) < len(snapshot.weights)  # the base is not in the file
    adapters = {k: v for k, v in snapshot.weights.items() if k in stored}
    assert not same_weights(run.module, adapters)
    restore(run.trainer, run.module, str(snapshot.path), 0.5)
    assert same_weights(run.module, snapshot.weights)  # adapters restored, the base as it was
    assert same_adamw_state(run.trainer.optimizers[0], snapshot.optimizer)


def test_restore_of_a_folder_checkpoint_goes_through_the_strategy(lm_dir, tmp_path, monkeypatch):
    """trainer=fsdp writes a folder that each rank reads its shards of: the strategy loads it (weights only), the
    schedule comes from what it returns, and no file is read by torch.load."""
    run, snapshot = trained(lm_dir, tmp_path)
    folder = tmp_path / "sharded.ckpt"
    folder.mkdir()
    calls = []

    def load_checkpoint(path, **kwargs):
        calls.append((path, kwargs))
        return {"lr_schedulers": [snapshot.scheduler]}

    monkeypatch.setattr(run.trainer.strategy, "load_checkpoint", load_checkpoint)
    monkeypatch.setattr(rollback.torch, "load", lambda *args, **kwargs: pytest.fail("torch.load of a folder"))
    restore(run.trainer, run.module, str(folder), 0.5)
    assert calls == [(str(folder), {"weights_only": True})]
    scheduler = run.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 1 and scheduler.base_lrs == [pytest.approx(LR * 0.5)]
    assert run.module.weights_version == 4


def test_set_lr_scale_on_a_scheduler_without_factors_sets_every_group_to_the_scaled_rate():
    parameters = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.AdamW([{"params": [parameters[0]]}, {"params": [parameters[1]]}], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)  # no lr_lambdas
    module = SimpleNamespace(
        trainer=SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)]),
        optim_cfg=SimpleNamespace(lr=1e-3),
    )
    set_lr_scale(module, 0.25)
    assert scheduler.base_lrs == [pytest.approx(2.5e-4)] * 2
    assert [group["lr"] for group in optimizer.param_groups] == [pytest.approx(2.5e-4)] * 2


def test_a_guard_in_a_toy_run_restores_the_healthy_checkpoint_before_the_rounds_checkpoint_is_written(lm_dir, tmp_path):
    """entropy with a band of +-0.01 % around its 2-round warm-up level fires at round 2 (one step a round, k = 0):
    the step-1 checkpoint (sampled round 1, clean) is restored at half the rate, and the step-3 checkpoint, written
    after the guard, holds its weights and AdamW state; the guard's scores are logged every step."""
    checkpoint = RoundCheckpoint(str(tmp_path / "checkpoints"), keep_last=-1)
    guard = Guard(detectors={"entropy": {"warmup": 2, "low": 0.9999, "high": 1.0001}})
    run = toy_run(lm_dir, str(tmp_path), 4, lr=LR, callbacks=(guard, checkpoint))  # no warm-up: it moves
    run.trainer.fit(run.module, datamodule=run.datamodule)
    first = str(tmp_path / "checkpoints" / "step00001.ckpt")
    assert [(e.round_index, e.action, e.restored_from) for e in guard.events] == [(2, "rollback", first)]
    healthy = torch.load(first, weights_only=True)
    after = torch.load(tmp_path / "checkpoints" / "step00003.ckpt", weights_only=True)
    assert all(torch.equal(after["state_dict"][k], v) for k, v in healthy["state_dict"].items())
    state, expected = after["optimizer_states"][0]["state"], healthy["optimizer_states"][0]["state"]
    assert all(torch.equal(state[i]["exp_avg"], expected[i]["exp_avg"]) for i in expected)
    assert after["lr_schedulers"][0]["base_lrs"] == [pytest.approx(LR * 0.5)]
    assert after["dspo"]["weights_version"] == 4  # 3 steps, and the rollback's move
    metrics = run.trainer.callback_metrics  # the last step's (round 3): after the rollback
    assert float(metrics["guard/rollbacks"]) == 1.0 and float(metrics["guard/lr_scale"]) == 0.5
    assert "guard/entropy" in metrics
