"""`DSPOModule` under DDP with two gloo processes: a non-finite loss on one rank only must be skipped on both.

Issue 29 (1): the finiteness check was per rank, so a rank whose loss was NaN skipped its backward while the other
entered the gradient all-reduce, and the run hung (or paired mismatched collectives and diverged). The processes run
under a deadline: a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dspo.training.module import DSPOModule

WORLD = 2
POISONED_RANK, POISONED_STEP = 1, 1


class RankPoison(DSPOModule):
    """Poisons the advantages of the second micro-batch on one rank at one step (the first micro-batch's backward has
    already run on both ranks, so the skip must be agreed on between two collectives)."""

    def training_step(self, slot, batch_idx):
        if self.global_rank == POISONED_RANK and batch_idx == POISONED_STEP:
            last = slot.micro_batches[-1]
            last.advantages = torch.full_like(last.advantages, float("nan"))
        return super().training_step(slot, batch_idx)

    def _on_non_finite(self, slot) -> None:
        self.skipped_at = [*getattr(self, "skipped_at", []), self.trainer.global_step]
        super()._on_non_finite(slot)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(worker, lm_dir: str, root: Path, hang: str) -> list[dict]:
    """`worker(rank, port, lm_dir, root)` on WORLD spawned processes under a 2-minute deadline (a run of 3 steps takes
    seconds; a hang never finishes); returns what each rank saved to `root/rank<r>.pt`."""
    context = mp.start_processes(
        worker, args=(_free_port(), lm_dir, str(root)), nprocs=WORLD, join=False, start_method="spawn"
    )
    try:
        finished = any(context.join(timeout=0.5) for _ in range(240))
        assert finished, f"the two ranks did not finish: {hang}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _ddp_worker(rank: int, port: int, lm_dir: str, root: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from dspo.rollout.sampler import RoundSampler
    from dspo.testing import toy_run

    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    os.environ.update({**env, "LOCAL_RANK": str(rank), "RANK": str(rank)})  # Lightning: processes already exist
    run = toy_run(lm_dir, f"{root}/rank{rank}", 3, module_cls=RankPoison, micro_batch_size=3)  # 4 sequences: 3 + 1
    run.callback.producer.side.round_sampler = RoundSampler(run.agent, run.callback.algo, rank, WORLD)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=3,
        callbacks=[run.callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=f"{root}/rank{rank}",
    )
    trainer.fit(run.module, datamodule=run.datamodule)
    report = {
        "global_step": trainer.global_step,
        "weights_version": run.module.weights_version,
        "skipped_at": getattr(run.module, "skipped_at", []),
        "weights": {k: v.detach().clone() for k, v in run.module.policy.state_dict().items()},
    }
    torch.save(report, f"{root}/rank{rank}.pt")


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_is_skipped_on_every_rank(tmp_path: Path) -> None:
    from dspo.testing import build_toy_lm

    lm_dir = build_toy_lm(str(tmp_path / "lm"))
    ranks = _run_ranks(_ddp_worker, lm_dir, tmp_path, "a collective is waiting for a rank that skipped it")
    # both ranks skipped the same step (the one only rank 1 saw as non-finite) and applied the others
    assert [r["skipped_at"] for r in ranks] == [[1], [1]]
    assert [r["weights_version"] for r in ranks] == [3, 3]  # 4 batches: one skipped, 3 applied
    assert [r["global_step"] for r in ranks] == [3, 3]
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), name


class CountingMicroBatches(DSPOModule):
    def training_step(self, slot, batch_idx):
        self.counts = [*getattr(self, "counts", []), len(slot.micro_batches)]
        self.shapes = [*getattr(self, "shapes", []), [tuple(b.input_ids.shape) for b in slot.micro_batches]]
        return super().training_step(slot, batch_idx)


def _token_budget_worker(rank: int, port: int, lm_dir: str, root: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from dspo.testing import ScriptedAgent, attach, toy_run

    class RankAgent(ScriptedAgent):  # each rank's own trajectories (lengths), as ranks sampling their own prompts get
        def _group(self, item, group_size, policy_version, seed):
            return super()._group(item, group_size, policy_version, (seed or 0) + 7919 * rank)

    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    os.environ.update({**env, "LOCAL_RANK": str(rank), "RANK": str(rank)})
    kwargs = {"micro_batch_tokens": 20, "batch_groups": 4}  # each rank: 2 groups of 4, packed by tokens
    run = toy_run(lm_dir, f"{root}/rank{rank}", 3, module_cls=CountingMicroBatches, **kwargs)
    attach(run.callback, RankAgent(), run.engine, WORLD)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=DDPStrategy(process_group_backend="gloo"), max_steps=3,
        callbacks=[run.callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=f"{root}/rank{rank}",
    )  # fmt: skip
    trainer.fit(run.module, datamodule=run.datamodule)
    weights = {k: v.detach().clone() for k, v in run.module.policy.state_dict().items()}
    torch.save({"counts": run.module.counts, "shapes": run.module.shapes, "weights": weights}, f"{root}/rank{rank}.pt")


@pytest.mark.slow
def test_token_budget_micro_batches_agree_in_number_across_ranks(tmp_path: Path) -> None:
    """Issue 31 (1): packed by tokens, the ranks' own packings differ in count; DDP's per-backward all-reduce needs the
    same number of backward passes on every rank, so they run the larger count (split micro-batches), and finish."""
    from dspo.testing import build_toy_lm

    lm_dir = build_toy_lm(str(tmp_path / "lm"))
    ranks = _run_ranks(_token_budget_worker, lm_dir, tmp_path, "one ran more backward passes than the other")
    assert ranks[0]["counts"] == ranks[1]["counts"] and len(ranks[0]["counts"]) == 3
    for shapes in ranks[0]["shapes"] + ranks[1]["shapes"]:
        assert all(n * width <= 20 or n == 1 for n, width in shapes)
    assert ranks[0]["shapes"] != ranks[1]["shapes"]  # different data, packed differently, the same number of passes
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), name


def _fit_on_two_ranks(strategy: str, run, root: str, callbacks: list | None = None):
    """`run` fitted for 3 steps under DDP or FSDP2 on this rank; returns the trainer and the full weights."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from dspo.models.weights import policy_weights
    from dspo.training.strategies import FSDP2Strategy

    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=3, callbacks=[run.callback, *(callbacks or [])], logger=False,
        strategy=DDPStrategy(process_group_backend="gloo") if strategy == "ddp" else FSDP2Strategy(),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(run.module, datamodule=run.datamodule)
    weights = {k: v.detach().clone() for k, v in policy_weights(trainer.strategy.model)}  # full tensors under FSDP
    return trainer, weights


def _async_worker(strategy: str, rank: int, port: int, lm_dir: str, root: str) -> None:
    import lightning.pytorch as pl

    from dspo.testing import toy_run

    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    os.environ.update({**env, "LOCAL_RANK": str(rank), "RANK": str(rank)})
    run = toy_run(lm_dir, f"{root}/rank{rank}", 3, max_staleness=1, batch_groups=4)  # each rank: 2 groups of 4
    if strategy == "fsdp2":  # FSDP gathers full parameters for the push; they travel over a gloo group of their own
        run.callback.producer.spec.weight_transfer = "gloo"
    versions: list[list[int]] = []

    class Versions(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            groups = run.callback.producer.state.current.groups
            versions.append(sorted({t.policy_version for g in groups for t in g.trajectories}))

    trainer, weights = _fit_on_two_ranks(strategy, run, f"{root}/rank{rank}", [Versions()])
    report = {
        "steps": trainer.global_step,
        "versions": versions,
        "weights": weights,
        "closed": run.callback.producer.side.worker,
    }
    torch.save(report, f"{root}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_one_round_ahead_under_ddp_and_fsdp_keeps_the_ranks_in_step(tmp_path: Path, strategy: str) -> None:
    """Issue 28 (4): with rollout.max_staleness = 1 each rank has its own engine process filling its share of B; the
    ranks take the same number of steps, see the same staleness, and end with identical weights. Under FSDP2 the
    push gathers full parameters from the shards and sends them over `rollout.weight_transfer=gloo`."""
    from functools import partial

    from dspo.testing import build_toy_lm

    lm_dir = build_toy_lm(str(tmp_path / "lm"))
    worker = partial(_async_worker, strategy)
    ranks = _run_ranks(worker, lm_dir, tmp_path, "a rank waited for a round or a collective forever")
    assert [r["steps"] for r in ranks] == [3, 3]
    assert [r["versions"] for r in ranks] == [[[0], [0], [1]]] * 2
    assert [r["closed"] for r in ranks] == [None, None]
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), name


def _failing_rank_worker(fault: str, rank: int, port: int, lm_dir: str, root: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from dspo.testing import toy_run
    from dspo.train import fit_or_checkpoint

    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    os.environ.update({**env, "LOCAL_RANK": str(rank), "RANK": str(rank), "DSPO_FAULT": fault})
    run = toy_run(lm_dir, f"{root}/rank{rank}", 6, max_staleness=1, batch_groups=4)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=6, callbacks=[run.callback], logger=False,
        strategy=DDPStrategy(process_group_backend="gloo"), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=f"{root}/rank{rank}",
    )  # fmt: skip
    error = None
    try:
        fit_or_checkpoint(trainer, run.module, run.datamodule, None)
    except Exception as failure:  # noqa: BLE001 - reported to the test
        error = f"{type(failure).__name__}: {failure}"
    report = {"error": error, "steps": trainer.global_step, "closed": run.callback.producer.side.worker}
    torch.save(report, f"{root}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "raised"),
    [
        ("trainer.push@1#3=raise", "FaultInjected: DSPO_FAULT: trainer.push on rank 1"),  # hung before issue 38
        ("engine.generating@1#3", "EngineProcessDied"),  # rank 1's engine process killed mid-generation
    ],
)
def test_a_push_or_take_failing_on_one_rank_ends_both_ranks_with_a_failure_checkpoint(tmp_path, fault, raised):
    """Issue 38 (4): rank 1's push fails (or its engine process dies) while rank 0's succeeds: both ranks raise at
    the same point, within the deadline, rank 0 naming the other rank, and the failure checkpoint is written (its
    save is a collective too)."""
    from functools import partial

    from dspo.testing import build_toy_lm

    lm_dir = build_toy_lm(str(tmp_path / "lm"))
    ranks = _run_ranks(partial(_failing_rank_worker, fault), lm_dir, tmp_path, "a rank waited for the failed one")
    assert raised in ranks[1]["error"]
    assert "another rank failed while taking round 2" in ranks[0]["error"]
    assert [r["steps"] for r in ranks] == [2, 2] and [r["closed"] for r in ranks] == [None, None]
    assert (tmp_path / "rank0" / "checkpoints" / "failure.ckpt").is_file()


class RecordingCounts(DSPOModule):
    """Records, per optimizer step, the micro-batches it ran, their rows, and the objective's normalizer."""

    def _counts(self, micro):
        counts = super()._counts(micro)
        self.steps = [*getattr(self, "steps", []), (len(micro), counts.sequences, counts.episodes, counts.objective)]
        return counts


def _split_worker(strategy: str, rank: int, port: int, lm_dir: str, root: str) -> None:

    from dspo.testing import ScriptedAgent, SplittingAgent, attach, toy_run

    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD), "NODE_RANK": "0"}
    os.environ.update({**env, "LOCAL_RANK": str(rank), "RANK": str(rank)})
    # each rank: 2 groups of 4 episodes per step, micro-batches of 2 rows; rank 1's episodes become 3 samples each
    run = toy_run(lm_dir, f"{root}/rank{rank}", 3, module_cls=RecordingCounts, micro_batch_size=2, batch_groups=4)
    attach(run.callback, SplittingAgent(pieces=3) if rank == 1 else ScriptedAgent(), run.engine, WORLD)
    trainer, weights = _fit_on_two_ranks(strategy, run, f"{root}/rank{rank}")
    report = {"steps": run.module.steps, "global_step": trainer.global_step, "weights": weights}
    torch.save(report, f"{root}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ranks_agree_on_micro_batches_when_one_ranks_episodes_split_into_more_samples(tmp_path, strategy):
    """Issue 52 (2): rank 1's episodes are trained as 3 samples each, rank 0's as one; with micro-batches of 2 rows
    rank 0 would run 4 micro-batches and rank 1 8 (one episode each: its samples share a micro-batch), and DDP's or
    FSDP's per-backward collectives then paired across steps (a hang). Both run 8, normalize by the same episode count
    (8 episodes per rank), take 3 steps and end with the same weights."""
    from functools import partial

    from dspo.testing import build_toy_lm

    lm_dir = build_toy_lm(str(tmp_path / "lm"))
    ranks = _run_ranks(partial(_split_worker, strategy), lm_dir, tmp_path, "one rank ran more backward passes")
    assert [r["global_step"] for r in ranks] == [3, 3]
    micro = [[step[0] for step in r["steps"]] for r in ranks]
    assert micro[0] == micro[1] and all(n == 8 for n in micro[0])
    rows = [[step[1] for step in r["steps"]] for r in ranks]
    assert all(n == 8 for n in rows[0]) and all(n > 8 for n in rows[1])  # rank 1 trains more rows ...
    assert [[step[2:] for step in r["steps"]] for r in ranks] == [[(8, 8.0)] * 3] * 2  # ... but as many episodes
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), name
