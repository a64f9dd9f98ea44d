"""torchmetrics SubEM, ExactMatch and TokenF1 over the scores of `dspo.metrics`, and their collections.

Each metric keeps (sum, count) states reduced by summation, so values are exact across processes (DDP/FSDP) and
across `update` calls. `benchmark_metrics` builds one collection per benchmark, logged as `<stage>/<benchmark>/<name>`.
A module of its own so that what needs only the scores (the reward, `dspo-serve`) does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torchmetrics import Metric, MetricCollection

from dspo.metrics import exact_match, sub_exact_match, token_f1


class _MeanScore(Metric):
    """Mean of a per-example score over (prediction, gold list) pairs; states sum/count reduce by summation."""

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    @staticmethod
    def score(prediction: str | None, golds: Sequence[str]) -> float:
        raise NotImplementedError

    def update(self, preds: Sequence[str | None], golds: Sequence[Sequence[str]]) -> None:
        if len(preds) != len(golds):
            raise ValueError(f"{type(self).__name__}.update: {len(preds)} predictions but {len(golds)} gold lists")
        scores = [self.score(p, g) for p, g in zip(preds, golds)]  # None (no answer) scores 0
        self.total += torch.tensor(sum(scores), dtype=torch.float64, device=self.total.device)
        self.count += len(scores)

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp(min=1)).float()


class SubEM(_MeanScore):
    """Substring exact match (the paper's metric and reward, Eq. 4)."""

    score = staticmethod(sub_exact_match)


class ExactMatch(_MeanScore):
    score = staticmethod(exact_match)


class TokenF1(_MeanScore):
    score = staticmethod(token_f1)


def answer_metrics() -> MetricCollection:
    """SubEM, EM and F1 in one collection.

    compute_groups=False on purpose: the three metrics have identically named states (total, count), and torchmetrics'
    default compute groups merge metrics whose states are equal after the first update (e.g. a first batch where every
    prediction is an exact match), after which only one of them is updated and EM/F1 silently report SubEM's value.
    """
    return MetricCollection({"subem": SubEM(), "em": ExactMatch(), "f1": TokenF1()}, compute_groups=False)


def benchmark_metrics(benchmarks: Iterable[str], stage: str = "val") -> dict[str, MetricCollection]:
    """One collection per benchmark, keys prefixed so `collection.compute()` yields `val/<benchmark>/subem` etc."""
    return {name: answer_metrics().clone(prefix=f"{stage}/{name}/") for name in benchmarks}
