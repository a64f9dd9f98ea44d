"""Outcome reward: subEM of the model's final answer (DSPO Eq. 4).

`R = 1` if some gold answer, normalized (FlashRAG / Search-R1 `normalize_answer`), is a substring of the normalized
content of the LAST `<answer>…</answer>` in the model's own text; no answer → 0. Extraction must run on model-generated
text only (the agent does this), so that a retrieved document containing `<answer>` can never score.

`extract_answer` is the only answer extractor: the agent calls it once and stores `Trajectory.answer`, which both the
training reward (`subem_reward`) and evaluation (`dspo.eval.pipeline`) score as is, so the two can never disagree.

Departure from Search-R1's extraction (the last non-greedy `<answer>(.*?)</answer>` span): the answer is the content
after the LAST `<answer>` opening tag before the last `</answer>`. The agent extracts from the model's turns joined
without the observations, so with Search-R1's regex an `<answer>` left unclosed in an early turn ("<answer>Lipinton.
</think> <search> Lipinton </search>") opened a span that ran through every later turn to the final `</answer>`: the
answer scored was the union of the intermediate and the final names. RL on the toy default learned exactly that
(measured: after 100 steps, 1-hop "Who founded X?" rollouts that answered the founder, searched on, and answered the
founder's birthplace were rewarded, and test EM was 0.23 for a subEM of 0.94 on 2-hop questions).

`max_answer_words` is an optional guard (off by default = paper-faithful): subEM rewards an answer that lists many
candidates, which RL can learn to exploit; with the guard, answers longer than that many words score 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from dspo.metrics import normalize_answer, sub_exact_match

_ANSWER = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)  # a span holds no inner opening tag


def extract_answer(text: str) -> str | None:
    """Stripped content of the last complete `<answer>…</answer>` in `text` (the text after the last `<answer>` that
    is closed), or None if there is none."""
    matches = _ANSWER.findall(text)
    if not matches:
        return None
    return matches[-1].strip()


def subem_reward(answer: str | None, golden_answers: str | Sequence[str], max_answer_words: int | None = None) -> float:
    """subEM reward (Eq. 4) in {0.0, 1.0} of an answer already extracted by `extract_answer` (None → 0.0).

    The answer is scored as is, never extracted a second time, so reward and evaluation agree: the extraction of
    `<answer>Lyon <answer>Paris</answer>` is `Paris` (Search-R1's would be `Lyon <answer>Paris`, see the module).
    """
    if answer is None:
        return 0.0
    if max_answer_words is not None and len(normalize_answer(answer).split()) > max_answer_words:
        return 0.0
    return sub_exact_match(answer, golden_answers)
