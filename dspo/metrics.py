"""Answer metrics: FlashRAG / Search-R1 normalization, and torchmetrics SubEM, ExactMatch, TokenF1.

Each metric keeps (sum, count) states reduced by summation, so values are exact across processes (DDP/FSDP) and
across `update` calls. `benchmark_metrics` builds one collection per benchmark, logged as `<stage>/<benchmark>/<name>`.

One rule for blank answers, shared by the reward (`dspo.rewards`), evaluation (`dspo.eval.pipeline`) and these
metrics: a missing answer (None) is wrong, and a gold answer that normalizes to the empty string (NQ has `*`, `---`,
`)`) never matches. Departure from FlashRAG / Search-R1, whose scorers count such a gold as found in any prediction
(`"" in pred`), so a question whose only gold is `*` is "answered" by anything, even by no answer. `dspo.data.qa`
drops such golds at load and skips the questions left without one, with a count in the log.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torchmetrics import Metric, MetricCollection

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop the articles a/an/the as whole words, collapse white space.

    Identical, step for step, to `normalize_answer` in FlashRAG and Search-R1 (itself from the SQuAD script).
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalized_golds(golds: str | Sequence[str]) -> list[str]:
    """The gold answers, normalized, without those that normalize to the empty string (they never match)."""
    golds = [golds] if isinstance(golds, str) else list(golds)
    return [gold for gold in (normalize_answer(g) for g in golds) if gold]


def sub_exact_match(prediction: str | None, golds: str | Sequence[str]) -> float:
    """1.0 if some normalized gold answer is a substring of the normalized prediction (DSPO Eq. 4), else 0.0
    (always 0.0 for a missing prediction, None)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(gold in pred for gold in normalized_golds(golds)))


def exact_match(prediction: str | None, golds: str | Sequence[str]) -> float:
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(gold == pred for gold in normalized_golds(golds)))


def token_f1(prediction: str | None, golds: str | Sequence[str]) -> float:
    """Max over golds of token-level F1 (FlashRAG's F1: yes/no/noanswer must match exactly)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    best = 0.0
    for gold in normalized_golds(golds):
        if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
            continue
        pred_tokens, gold_tokens = pred.split(), gold.split()
        common = Counter(pred_tokens) & Counter(gold_tokens)
        same = sum(common.values())
        if same == 0:
            continue
        precision, recall = same / len(pred_tokens), same / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


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
