"""Issue 20 (5): under data parallelism the dapo token-mean is over the whole mini-batch's tokens on all ranks.

Two gloo processes hold token-unequal halves of one mini-batch; each backpropagates its dapo loss with
`loss_normalizer(..., all-reduced token count, world_size)`, and the gradients are averaged as DDP does. The result
must equal the single-process gradient of the whole mini-batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspo.algorithms.blocks import loss_normalizer, token_normalizer
from dspo.algorithms.losses import policy_loss

D, L = 3, 6


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features [N, L, D], old logprobs [N, L], advantages [N], masks [N, L]: rank 0 gets rows 0-1, rank 1 rows 2-4."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(5, L, D, generator=generator)
    old = -torch.rand(5, L, generator=generator)
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3])
    lengths = torch.tensor([6, 5, 2, 1, 3])  # rank 0: 11 tokens in 2 rows, rank 1: 6 tokens in 3 rows
    mask = (torch.arange(L)[None] < lengths[:, None]).float()
    return features, old, advantages, mask


def _gradient(rows: slice, normalizer: float | None) -> torch.Tensor:
    features, old, advantages, mask = _data()
    theta = torch.linspace(-0.3, 0.4, D).requires_grad_(True)
    logprobs = -torch.nn.functional.softplus(features[rows] @ theta)  # [n, L], a log-probability-like function of θ
    loss, _ = policy_loss(
        "dapo",
        logprobs,
        old[rows],
        advantages[rows],
        mask[rows],
        {"clip_low": 0.2, "clip_high": 0.28},
        normalizer=normalizer,
    )
    loss.backward()
    return theta.grad


def _rank(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = slice(0, 2) if rank == 0 else slice(2, 5)
    tokens = _data()[3][rows].sum()
    dist.all_reduce(tokens, op=dist.ReduceOp.SUM)  # as `trainer.strategy.reduce(..., reduce_op="sum")`
    grads = {}
    for name, normalizer in (
        ("global", loss_normalizer("token", 2 if rank == 0 else 3, float(tokens), world)),
        ("per_rank", None),  # each rank's own token mean: the defect
    ):
        grad = _gradient(rows, normalizer)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        grads[name] = grad / world  # DDP averages gradients over ranks
    if rank == 0:
        torch.save(grads, out)
    dist.destroy_process_group()


def test_two_process_token_mean_equals_the_single_process_one(tmp_path):
    out = tmp_path / "grads.pt"
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, start_method="fork")
    grads = torch.load(out, weights_only=True)
    whole = _gradient(slice(0, 5), None)  # token mean over all 17 tokens
    torch.testing.assert_close(grads["global"], whole)
    assert not torch.allclose(grads["per_rank"], whole, atol=1e-3)


def test_token_normalizer_values():
    assert token_normalizer(17.0, 2) == 8.5 and token_normalizer(17.0) == 17.0
    assert loss_normalizer("token", 3, 17.0, world_size=2) == 8.5  # dapo's unit
    assert loss_normalizer("sequence", 3, 17.0, world_size=2) == 3.0  # sequence counts are per rank already
