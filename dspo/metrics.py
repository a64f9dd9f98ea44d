"""Answer metrics: FlashRAG / Search-R1 normalization and the per-answer scores (subEM, EM, token F1).

Plain Python, no torch: the reward, the toy world and the retrieval commands import this module, and `dspo-serve` /
`dspo-index` start seconds sooner without torch and torchmetrics (measured: importing torchmetrics took 2.7 s, as its
text metrics import transformers). The torchmetrics classes over these scores (`SubEM`, `ExactMatch`, `TokenF1`,
`answer_metrics`, `benchmark_metrics`) live in `dspo.eval.answer_metrics`, one layer up: it imports this module.

One rule for blank answers, shared by the reward (`dspo.env.rewards`), evaluation (`dspo.eval.pipeline`) and these
metrics: a missing answer (None) is wrong, and a gold answer that normalizes to the empty string (NQ has `*`, `---`,
`)`) never matches. Departure from FlashRAG / Search-R1, whose scorers count such a gold as found in any prediction
(`"" in pred`), so a question whose only gold is `*` is "answered" by anything, even by no answer. `dspo.data.qa`
drops such golds at load and skips the questions left without one, with a count in the log.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

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


def phrase_in(phrase: str, text: str) -> bool:
    """True when the normalized `phrase` occurs in the normalized `text` as a run of whole tokens: "new york" is in
    "I live in New York.", "1" is not in "1991" (a blank phrase is in nothing). Not subEM, which is a substring test
    by the paper's definition: this is the environments' test of whether a text states an answer, a title or a
    topic (env=goal_reflect, self-play's proposals and check), where a substring would count "1" as "1991"."""
    wanted = normalize_answer(phrase)
    # normalized text has single spaces and none at the ends, so padding both makes `in` match whole tokens only
    return bool(wanted) and f" {wanted} " in f" {normalize_answer(text)} "


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
