"""Answer extraction and the subEM reward (Eq. 4)."""

from __future__ import annotations

from dspo.env.rewards import extract_answer, subem_reward
from dspo.eval.pipeline import Prediction
from dspo.types import QAItem, RolloutGroup, Trajectory


def test_extract_last_answer():
    assert extract_answer("<answer> a </answer> then <answer>\nThe Beatles\n</answer>") == "The Beatles"
    assert extract_answer("no answer here") is None
    assert extract_answer("<answer> unterminated") is None
    assert extract_answer("<answer></answer>") == ""


def test_an_unclosed_answer_does_not_extend_the_final_one():
    """An `<answer>` left open in an early turn, then a search and a final answer (the model's turns joined): only the
    final answer counts, so naming the intermediate entity on the way earns nothing."""
    turns = "<answer>Lipinton.</think>\n<search> Lipinton </search><think>Lipinton is in Fouloia.</think>\n"
    assert extract_answer(turns + "<answer>Fouloia</answer>") == "Fouloia"
    assert _reward(turns + "<answer>Fouloia</answer>", ["Lipinton"]) == 0.0
    assert extract_answer("<answer>a <answer> b </answer> <answer>c</answer> <answer>d") == "c"


def _reward(text: str, golds, max_answer_words=None) -> float:
    return subem_reward(extract_answer(text), golds, max_answer_words)


def test_subem_normalizes_and_matches_substring():
    assert _reward("<think>x</think><answer> the Beatles! </answer>", ["beatles"]) == 1.0
    assert _reward("<answer>It was Paris, France</answer>", ["Paris"]) == 1.0
    assert _reward("<answer>Lyon</answer>", ["Paris", "City of Light"]) == 0.0
    assert subem_reward("Paris", "Paris") == 1.0
    assert subem_reward(None, ["Paris"]) == 0.0
    assert _reward("<answer>Paris", ["Paris"]) == 0.0  # tag but no complete answer


def test_reward_and_evaluation_score_the_same_extracted_answer():
    """Issue 20 (3): one extractor, scored as is by reward and evaluation."""
    text = "<answer>Lyon <answer>Paris</answer>"
    answer = extract_answer(text)
    assert answer == "Paris"
    trajectory = Trajectory([1], [2], [1], [0.0], reward=subem_reward(answer, ["Paris"]), answer=answer)
    item = QAItem(id="0", question="capital of France?", golden_answers=["Paris"])
    prediction = Prediction.from_group(RolloutGroup(item=item, trajectories=[trajectory]))
    assert trajectory.reward == prediction.correct == 1.0
    wrong = Trajectory([1], [2], [1], [0.0], answer="Lyon <answer>")
    assert subem_reward(wrong.answer, ["Paris"]) == 0.0
    assert Prediction.from_group(RolloutGroup(item=item, trajectories=[wrong])).correct == 0.0


def test_max_answer_words_guard():
    listing = "<answer>Paris, Lyon, Marseille, Nice, Lille</answer>"
    assert _reward(listing, ["Paris"]) == 1.0  # paper-faithful default
    assert _reward(listing, ["Paris"], max_answer_words=3) == 0.0
    assert _reward("<answer>Paris France</answer>", ["Paris"], max_answer_words=3) == 1.0


def test_reward_and_evaluation_agree_on_blank_answers_and_golds():
    """Issue 29 (9): evaluation scored a missing answer as "" and found the gold `*` (normalized "") in it; the reward
    gave 0. One rule now: no answer is wrong, a blank gold never matches."""
    item = QAItem(id="0", question="what symbol?", golden_answers=["*"])
    for answer in (None, "", "a saltire"):
        trajectory = Trajectory([1], [2], [1], [0.0], reward=subem_reward(answer, item.golden_answers), answer=answer)
        prediction = Prediction.from_group(RolloutGroup(item=item, trajectories=[trajectory]))
        assert trajectory.reward == prediction.correct == prediction.em == prediction.f1 == 0.0, answer
