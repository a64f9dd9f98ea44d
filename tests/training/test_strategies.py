"""FSDP2 (`trainer=fsdp`) on the CPU with 2 gloo processes.

1. The loss path (`shard_for_logprobs` + `masked_token_logprobs` + `policy_loss` + `clip_grad_norm` + AdamW) on
   2 ranks, each with half the data, against a single-process step on all of it: tied embeddings with the DSPO
   (sequence-mean) objective; untied, activation checkpointing and the DAPO (token-mean) objective.
2. `DSPOModule` under `FSDP2Strategy` (scripted rollouts, sharded reference model): weight pushes, distributed
   checkpoint, resume, export.
3. `dspo-train trainer=fsdp trainer.accelerator=cpu trainer.devices=2` end to end: sharded checkpoint folders,
   export, `ckpt_path=last` resume.
"""

from __future__ import annotations

import copy
import os
import socket
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from dspo.algorithms.losses import OBJECTIVES, loss_normalizer, policy_loss
from dspo.models.fsdp import clip_grad_norm, shard_for_logprobs
from dspo.models.logprobs import masked_token_logprobs
from dspo.models.weights import policy_weights

LAYERS = ["transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer"]
WORLD = 2
N, L, VOCAB = 8, 12, 128
# float32 on both sides; the sharded step sums gradients in another order (reduce-scatter of per-rank halves) and
# all-gathers weights exactly, so differences are float32 rounding (~1e-7 relative), well inside 1e-4 / 1e-5.
# AdamW's first step moves each weight by about lr * sign(g) = 1e-2 whatever g's scale: the updated weights catch a
# wrong gradient direction (e.g. one rank's half of the data missing), the compared loss and norm a wrong scale.
ATOL, RTOL = 1e-5, 1e-4


class Holder(torch.nn.Module):
    """Stands for DSPOModule: the policy registered as `policy`, the logprob wrapper outside the module tree."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy


def _tiny(tie: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(config).to(torch.float32)


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (N, L), generator=gen)
    attention = torch.ones_like(ids)
    mask = torch.zeros(N, L)
    for i in range(N):  # prompts of 2-5 tokens, responses of varying length, right padding
        start, end = 2 + i % 4, L - i % 3
        mask[i, start:end] = 1
        attention[i, end:] = 0
    advantages = torch.randn(N, generator=gen)
    old_shift = 0.05 * torch.randn(N, L, generator=gen) * mask  # ratios away from 1, some clipped
    return {"ids": ids, "attention": attention, "mask": mask, "advantages": advantages, "old_shift": old_shift}


def _step(lm, runner, data, rows: slice, world: int, objective: str, max_norm: float):
    """One optimizer step on `rows` of the data: (loss of the whole mini-batch, gradient norm)."""
    optimizer = torch.optim.AdamW([p for p in lm.parameters()], lr=1e-2, weight_decay=0.01)
    ids, attention, mask = data["ids"][rows], data["attention"][rows], data["mask"][rows]
    tokens = mask.sum()
    if world > 1:
        dist.all_reduce(tokens)
    normalizer = loss_normalizer(OBJECTIVES[objective].normalizer_unit, ids.shape[0], float(tokens), world)
    logprobs, _ = runner(ids, attention, mask, temperature=0.9, chunk_size=5)
    old = logprobs.detach() + data["old_shift"][rows]
    loss, _ = policy_loss(
        objective,
        logprobs,
        old,
        data["advantages"][rows],
        mask,
        {"clip_low": 0.2, "clip_high": 0.28},
        normalizer=normalizer,
    )
    loss.backward()
    norm = clip_grad_norm([p for p in lm.parameters() if p.grad is not None], max_norm)
    optimizer.step()
    loss = loss.detach()
    if world > 1:  # gradients are averaged over ranks: the mini-batch loss is the rank mean
        dist.all_reduce(loss)
        loss /= world
    return loss, norm


def _worker(rank: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",))["data_parallel"]
        data = _batch()
        for tie, objective in ((True, "dspo"), (False, "dapo")):
            single = _tiny(tie)
            sharded = copy.deepcopy(single)
            if not tie:  # as DSPOModule.configure_model does with model.gradient_checkpointing (before sharding)
                sharded.gradient_checkpointing_enable()
            start = {k: v.clone() for k, v in single.state_dict().items()}
            runner = shard_for_logprobs(sharded, mesh, LAYERS)
            holder = Holder(sharded)
            names = [n for n, _ in holder.named_parameters()]
            assert all(n.startswith("policy.") for n in names) and len(names) == len(set(names))
            # each rank holds half of every weight (dim 0), tied weights stay one parameter
            up = sharded.model.layers[0].mlp.up_proj.weight
            embed = sharded.model.embed_tokens.weight
            assert isinstance(up, DTensor) and up.to_local().shape[0] == up.shape[0] // WORLD
            assert embed.to_local().shape == (VOCAB // WORLD, 32)
            assert (sharded.lm_head.weight is embed) == tie
            # the gathered full state equals the unsharded weights, with Hugging Face names
            gathered = dict(policy_weights(holder))
            assert set(gathered) == set(start)
            for name, tensor in start.items():
                torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=0)
            # one step on this rank's half == one single-process step on all rows
            half = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
            loss, norm = _step(sharded, runner, data, half, WORLD, objective, max_norm=0.5)
            unsharded = partial(masked_token_logprobs, single)
            ref_loss, ref_norm = _step(single, unsharded, data, slice(None), 1, objective, max_norm=0.5)
            assert ref_norm > 0.5, "the test must exercise clipping"
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=1e-6)
            torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=1e-6)
            after = dict(policy_weights(holder))
            moved = 0
            for name, tensor in single.state_dict().items():
                torch.testing.assert_close(after[name], tensor, rtol=RTOL, atol=ATOL, msg=name)
                moved += not torch.equal(tensor, start[name])
            assert moved == len(start)
            # the root unit reshards after backward: parameters are shards again, a second forward still works
            assert isinstance(sharded.model.norm.weight, DTensor)
            again, _ = runner(data["ids"][half], data["attention"][half], data["mask"][half])
            expected, _ = masked_token_logprobs(single, data["ids"][half], data["attention"][half], data["mask"][half])
            torch.testing.assert_close(again, expected, rtol=RTOL, atol=ATOL)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_step_on_two_ranks_equals_single_process_step(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "pg_init"),), nprocs=WORLD, join=True)


def _lightning_worker(rank: int, port: int, lm_dir: str, root: str) -> None:
    """DSPOModule under FSDP2Strategy with scripted rollouts: 2 steps with a sharded reference model (β > 0), a
    distributed checkpoint, then a fresh trainer resumed from it to step 4. Writes what the parent checks."""
    import lightning.pytorch as pl

    from dspo.rollout.sampler import RoundSampler
    from dspo.testing import toy_run
    from dspo.training.strategies import FSDP2Strategy

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    os.environ.update({**env, "LOCAL_RANK": str(rank), "RANK": str(rank)})  # Lightning: processes already exist
    out = Path(root)
    report = {}
    for phase, max_steps, ckpt in (("first", 2, None), ("resumed", 4, str(out / "ck.ckpt"))):
        run = toy_run(lm_dir, str(out / phase), max_steps, kl_coef=0.1, micro_batch_size=2)
        run.callback.producer.side.round_sampler = RoundSampler(run.agent, run.callback.algo, rank, WORLD)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=FSDP2Strategy(),
            max_steps=max_steps,
            callbacks=[run.callback],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=str(out / phase),
        )
        trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt)
        module = run.module
        report[phase] = {
            "step": trainer.global_step,
            "pushes": run.engine.pushes,
            "final": dict(policy_weights(module)),
            "local": {n: p.to_local().clone() for n, p in module.policy.named_parameters()},
            "ref_local": {n: p.to_local().clone() for n, p in module.reference.named_parameters()},
            "grad_norm": float(trainer.callback_metrics["train/grad_norm"]),
            "adam_steps": {int(s["step"]) for s in trainer.optimizers[0].state.values()},
        }
        if phase == "first":
            trainer.save_checkpoint(str(out / "ck.ckpt"))
    torch.save(report, out / f"rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_dspo_module_under_fsdp2_strategy_pushes_checkpoints_and_resumes(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from dspo.runs.checkpoint_files import checkpoint_problem
    from dspo.testing import build_toy_lm

    lm_dir = build_toy_lm(str(tmp_path / "lm"))
    mp.spawn(_lightning_worker, args=(_free_port(), lm_dir, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for phase, steps in (("first", 2), ("resumed", 4)):
        assert [r[phase]["step"] for r in ranks] == [steps, steps]
        # every rank pushed the same full weights into its own engine, and ends with the same weights
        assert [v for v, _ in ranks[0][phase]["pushes"]] == [v for v, _ in ranks[1][phase]["pushes"]]
        for (_, a), (_, b) in zip(ranks[0][phase]["pushes"], ranks[1][phase]["pushes"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert ranks[0][phase]["grad_norm"] == ranks[1][phase]["grad_norm"] > 0
        # ... and each rank holds only its half (dim 0) of them, policy and reference alike
        final = ranks[0][phase]["final"]
        for name, full in final.items():
            halves = torch.cat([r[phase]["local"][name] for r in ranks])
            torch.testing.assert_close(halves, full, rtol=0, atol=0)
        for name, shard in ranks[0][phase]["ref_local"].items():
            assert shard.shape[0] == final[name].shape[0] // WORLD, name
    # the distributed checkpoint: a folder of per-rank shards without the frozen reference model
    folder = tmp_path / "ck.ckpt"
    assert folder.is_dir() and len(list(folder.glob("*.distcp"))) == WORLD and checkpoint_problem(folder) is None
    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata.keys()
    assert any(k.startswith("state_dict.policy.") for k in keys)
    assert not any(k.startswith("state_dict.reference.") for k in keys)
    assert not list(tmp_path.glob(".ck.ckpt*")), "temporary folders of the atomic save are gone"
    # resume: the first push after it holds exactly the weights the first run ended with (version 2), then steps on
    first_final, resumed = ranks[0]["first"]["final"], ranks[0]["resumed"]["pushes"]
    assert [v for v, _ in resumed] == [2, 3]
    assert ranks[0]["resumed"]["adam_steps"] == ranks[1]["resumed"]["adam_steps"] == {4}  # AdamW state restored
    assert all(torch.equal(resumed[0][1][k], first_final[k]) for k in first_final)
    assert any(not torch.equal(resumed[1][1][k], first_final[k]) for k in first_final)
    # dspo-eval's export reads the folder in one process: the policy of the first run's end, Hugging Face names
    from dspo.eval.cli import export_checkpoint

    out, step = export_checkpoint(str(folder), str(tmp_path / "exported"))
    assert step == 2
    from_folder = load_file(str(Path(out) / "model.safetensors"))
    assert from_folder.keys() == first_final.keys()
    assert all(torch.equal(from_folder[k], first_final[k]) for k in first_final)
    # the export at the end of training (rank 0, save_pretrained) holds the gathered final weights
    exported = load_file(str(tmp_path / "resumed" / "model" / "model.safetensors"))
    for name, tensor in ranks[0]["resumed"]["final"].items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)


def test_single_process_path_is_unchanged_without_fsdp():
    """No device mesh: DSPOModule calls masked_token_logprobs on the HF model itself; the wrapper computes the same."""
    from dspo.models.logprobs import MaskedLogprobs

    model, data = _tiny(True), _batch()
    direct, _ = masked_token_logprobs(model, data["ids"], data["attention"], data["mask"], 0.9, 5)
    wrapped, _ = MaskedLogprobs(model)(data["ids"], data["attention"], data["mask"], 0.9, 5)
    assert torch.equal(direct, wrapped)


@pytest.mark.slow
def test_dspo_train_fsdp_on_two_cpu_processes_checkpoints_exports_and_resumes(
    toy_cache, run_train, short_default, tmp_path
):
    """The issue's command with the shortened test overrides (one round), then `ckpt_path=last` to a later step."""
    from dspo.sweeps.analysis import find_runs, load_scalars

    outputs = tmp_path / "outputs"
    command = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=2"]
    # keep_last=1: the step-2 folder is pruned when the resumed run saves step 4
    common = [*short_default, "run_name=fsdp", "run_test=false", "callbacks.checkpoint.keep_last=1"]
    run_train([*command, *common], outputs)
    (run,) = find_runs(outputs / "train")
    checkpoints = run.dir / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == WORLD
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 2
    start = load_file(str(toy_cache / "toyworld" / "default" / "model" / "model.safetensors"))
    exported = load_file(str(run.dir / "model" / "model.safetensors"))
    assert start.keys() == exported.keys() and any(not torch.equal(start[k], exported[k]) for k in start)
    run_train([*command[:-1], "trainer.max_steps=4", *common, "ckpt_path=last"], outputs)
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 4
    assert sorted(p.name for p in checkpoints.glob("step*.ckpt")) == ["step00004.ckpt"]
    assert not list(checkpoints.glob(".*")), "no temporary folder left behind"
    end = load_file(str(run.dir / "model" / "model.safetensors"))
    assert any(not torch.equal(exported[k], end[k]) for k in start)  # the resumed run trained on and exported again
    # rank 0's engine, loaded with the gathered weights every round (and after the resume), scores the sampled
    # tokens as the sharded trainer does: both fp32 on CPU, so only float noise remains
    scalars = load_scalars(run.dir)
    diff = scalars[scalars.tag == "mismatch/logprob_diff_abs_mean"].sort_values("step")
    assert diff.step.tolist() == [0, 1, 2, 3] and (diff.value < 1e-3).all()
