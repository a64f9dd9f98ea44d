"""Outcome reward: subEM of the model's final answer (DSPO Eq. 4).

`R = 1` if some gold answer, normalized (FlashRAG / Search-R1 `normalize_answer`), is a substring of the normalized
content of the LAST `<answer>…</answer>` in the model's own text; no answer → 0. Extraction must run on model-generated
text only (the agent does this), so that a retrieved document containing `<answer>` can never score.

`extract_answer` is the only answer extractor: the agent calls it once and stores `Trajectory.answer`, which both the
training reward (`subem_reward`) and evaluation (`dspo.eval.pipeline`) score as is, so the two can never disagree.

`max_answer_words` is an optional guard (off by default = paper-faithful): subEM rewards an answer that lists many
candidates, which RL can learn to exploit; with the guard, answers longer than that many words score 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dspo.metrics import normalize_answer, sub_exact_match

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """Stripped content of the last complete `<answer>…</answer>` in `text`, or None if there is none."""
    matches = _ANSWER.findall(text)
    if not matches:
        return None
    return matches[-1].strip()


def subem_reward(answer: str | None, golden_answers: str | Sequence[str], max_answer_words: int | None = None) -> float:
    """subEM reward (Eq. 4) in {0.0, 1.0} of an answer already extracted by `extract_answer` (None → 0.0).

    The answer is scored as is, never extracted a second time: Search-R1's extraction of
    `<answer>I think <answer>Paris</answer>` is `I think <answer>Paris`, which contains Paris (reward 1, as evaluation).
    """
    if answer is None:
        return 0.0
    if max_answer_words is not None and len(normalize_answer(answer).split()) > max_answer_words:
        return 0.0
    return sub_exact_match(answer, golden_answers)
