"""Answer metrics: FlashRAG/Search-R1 normalization, subEM/EM/F1 by hand, the shared benchmarks, distributed sync."""

import json

import pytest
import torch

from dspo.eval.answer_metrics import ExactMatch, SubEM, TokenF1, answer_metrics, benchmark_metrics
from dspo.metrics import exact_match, normalize_answer, sub_exact_match, token_f1
from dspo.process.resources import data_dir

BENCHMARKS = data_dir() / "benchmarks"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  A   an THE  ", ""),  # only articles
        ("theater and anthem", "theater and anthem"),  # articles only as whole words
        ("U.S.A.", "usa"),  # punctuation is deleted, not replaced by a space
        ("Apple,Inc.", "appleinc"),
        ("the-end", "theend"),  # punctuation goes first, so "the-" is no longer a whole word
        ("a\tb\nc", "b c"),  # any white space collapses
        ("Estádio do Maracanã", "estádio do maracanã"),  # non-ASCII letters stay
        ("‘quoted’ «text»", "‘quoted’ «text»"),  # only ASCII punctuation (string.punctuation) is removed
        ("3 November 1929", "3 november 1929"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_sub_exact_match() -> None:
    assert sub_exact_match("It was the Eiffel Tower, in Paris.", ["eiffel tower"]) == 1.0
    assert sub_exact_match("Paris", ["London", "paris"]) == 1.0  # any gold
    assert sub_exact_match("Paris", "Paris") == 1.0  # a single gold string
    assert sub_exact_match("Par", ["Paris"]) == 0.0
    assert sub_exact_match("", ["Paris"]) == 0.0
    # Unlike FlashRAG, a gold that normalizes to "" (nq.jsonl has "*", "---", ")") never matches (dspo.metrics)
    assert sub_exact_match("no idea", ["*"]) == 0.0


def test_exact_match() -> None:
    assert exact_match("The Eiffel-Tower.", ["eiffel tower"]) == 0.0  # "eiffeltower" != "eiffel tower"
    assert exact_match("the  Eiffel tower.", ["Eiffel Tower"]) == 1.0
    assert exact_match("It is Paris", ["Paris"]) == 0.0
    assert exact_match("paris", ["London", "Paris"]) == 1.0


def test_token_f1_hand_values() -> None:
    # "cat sat on mat" vs "cat on mat": 3 common tokens, P = 3/4, R = 3/3 → F1 = 2·0.75·1/1.75 = 0.8571429
    assert token_f1("The cat sat on the mat", ["a cat on the mat"]) == pytest.approx(0.8571428571)
    # max over golds: "paris" vs "paris france" → P = 1, R = 1/2 → 0.6667; vs "paris" → 1
    assert token_f1("Paris", ["Paris France", "paris"]) == 1.0
    assert token_f1("Paris", ["Paris France"]) == pytest.approx(2 / 3)
    # repeated tokens count with multiplicity: "a a b" → "b"; "b b" vs "b": common 1, P = 1/2, R = 1 → 2/3
    assert token_f1("b b", ["b"]) == pytest.approx(2 / 3)
    assert token_f1("", ["paris"]) == 0.0
    assert token_f1("london", ["paris"]) == 0.0


def test_token_f1_yes_no_noanswer_must_match_exactly() -> None:
    # FlashRAG's F1: if either side normalizes to yes / no / noanswer, the two must be equal, else that gold scores 0
    assert token_f1("Yes.", ["yes"]) == 1.0
    assert token_f1("yes", ["yes indeed"]) == 0.0  # would be 2/3 by token overlap
    assert token_f1("no way", ["no"]) == 0.0  # would be 2/3 by token overlap
    assert token_f1("noanswer", ["noanswer"]) == 1.0
    assert token_f1("yes", ["no", "yes"]) == 1.0  # the special case skips one gold, not the whole list
    assert token_f1("the answer is yes", ["yes"]) == 0.0


def _benchmark_golds() -> list[str]:
    files = sorted(BENCHMARKS.glob("*.jsonl"))
    assert files, f"no benchmark files under {BENCHMARKS}; the repository carries them in data/benchmarks"
    golds = []
    for path in files:
        with path.open(encoding="utf-8") as f:
            golds.extend(g for line in f for g in json.loads(line)["golden_answers"])
    return golds


def test_every_benchmark_gold_matches_itself_and_its_variants() -> None:
    golds = [g for g in _benchmark_golds() if normalize_answer(g)]  # the others never match (next test)
    assert len(golds) > 1000
    for gold in golds:
        variants = [
            gold,
            f"The {gold}.",
            f"  {gold} !",
            f"I think it is {gold}, definitely",
            f"answer: a {gold}?",
        ]
        if gold.upper().lower() == gold.lower():  # skip golds like "ß" whose upper case does not round-trip
            variants += [gold.upper(), gold.lower(), f"THE {gold.upper()}"]
        for variant in variants:
            assert sub_exact_match(variant, [gold]) == 1.0, (gold, variant)
        assert exact_match(gold, [gold]) == 1.0, gold
        assert exact_match(f"The {gold}!", [gold]) == 1.0, gold
        if normalize_answer(gold):  # an empty normalized gold has no token to overlap
            assert token_f1(gold, [gold]) == 1.0, gold


def test_benchmark_gold_does_not_match_an_unrelated_answer() -> None:
    golds = _benchmark_golds()
    assert sum(sub_exact_match("", [g]) for g in golds) == 0.0


@pytest.mark.parametrize("score", [sub_exact_match, exact_match, token_f1])
def test_blank_golds_never_match_and_a_missing_answer_is_wrong(score) -> None:
    """Issue 29 (9): NQ golds such as `*` normalize to "", which FlashRAG's scorers find in every prediction."""
    for prediction in ("", "anything at all", "*", None):
        assert score(prediction, ["*"]) == 0.0 and score(prediction, ["---", ")"]) == 0.0
    assert score(None, ["Paris"]) == 0.0
    assert score("Paris", ["*", "Paris"]) == 1.0  # the real gold beside it still counts


# ---------------------------------------------------------------- torchmetrics classes
PREDS = ["Paris", "It is the Big Apple.", None, "Berlin", "yes"]
GOLDS = [["paris"], ["big apple", "NYC"], ["Rome"], ["Rome"], ["no"]]
# subEM: 1, 1, 0, 0, 0 → 0.4 ; EM: 1, 0, 0, 0, 0 → 0.2
# F1: 1; "it is big apple" vs "big apple": P = 2/4, R = 1 → 2/3; then 0, 0, 0 ("yes" vs "no") → 1.6667/5
HAND = {SubEM: 0.4, ExactMatch: 0.2, TokenF1: (1 + 2 / 3) / 5}


@pytest.mark.parametrize("cls", [SubEM, ExactMatch, TokenF1])
def test_metric_hand_values_and_accumulation(cls: type) -> None:
    metric = cls()
    metric.update(PREDS, GOLDS)
    assert metric.compute().item() == pytest.approx(HAND[cls], abs=1e-6)
    metric.reset()
    metric.update(PREDS[:2], GOLDS[:2])
    metric.update(PREDS[2:], GOLDS[2:])
    assert metric.compute().item() == pytest.approx(HAND[cls], abs=1e-6)


def test_update_length_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="2 predictions but 1 gold"):
        SubEM().update(["a", "b"], [["a"]])


@pytest.mark.parametrize("cls", [SubEM, ExactMatch, TokenF1])
def test_merge_state_equals_one_instance(cls: type) -> None:
    # unequal shards (1 vs 4 examples): summed states give the global mean, not the mean of the two means
    whole, left, right = cls(), cls(), cls()
    whole.update(PREDS, GOLDS)
    left.update(PREDS[:1], GOLDS[:1])
    right.update(PREDS[1:], GOLDS[1:])
    left.merge_state(right)
    assert left.compute().item() == pytest.approx(whole.compute().item(), abs=1e-9)
    assert int(left.count) == 5


@pytest.mark.parametrize("cls", [SubEM, ExactMatch, TokenF1])
def test_distributed_sync_sums_states(cls: type) -> None:
    # emulate a 2-process all-gather: "rank 1" saw PREDS[1:]; compute() on "rank 0" must sync, reduce, then unsync
    rank1 = cls()
    rank1.update(PREDS[1:], GOLDS[1:])
    rank1_states = iter(list(rank1.metric_state.values()))

    def all_gather(tensor: torch.Tensor, group: object = None) -> list[torch.Tensor]:
        return [tensor, next(rank1_states)]

    rank0 = cls(dist_sync_fn=all_gather, distributed_available_fn=lambda: True)
    rank0.update(PREDS[:1], GOLDS[:1])
    assert rank0.compute().item() == pytest.approx(HAND[cls], abs=1e-6)
    assert int(rank0.count) == 1  # local state restored after compute


def test_collection_keeps_metrics_apart() -> None:
    # Regression: with torchmetrics' default compute groups, a first batch where subEM == EM merged the three metrics
    # (same state names) and later batches only updated one of them.
    collection = answer_metrics()
    collection.update(["Paris"], [["paris"]])  # subEM = EM = F1 = 1
    collection.update(["It is Paris"], [["paris"]])  # subEM 1, EM 0, F1 = 2·(1/3)·1/(4/3) = 0.5
    values = {k: v.item() for k, v in collection.compute().items()}
    assert values == pytest.approx({"subem": 1.0, "em": 0.5, "f1": 0.75})


def test_benchmark_metrics_names_and_independence() -> None:
    collections = benchmark_metrics(["nq", "hotpotqa"])
    collections["nq"].update(PREDS, GOLDS)
    collections["hotpotqa"].update(["x"], [["x"]])
    nq = {k: v.item() for k, v in collections["nq"].compute().items()}
    assert nq == pytest.approx({"val/nq/subem": 0.4, "val/nq/em": 0.2, "val/nq/f1": (1 + 2 / 3) / 5})
    hotpot = {k: v.item() for k, v in collections["hotpotqa"].compute().items()}
    assert hotpot == {"val/hotpotqa/subem": 1.0, "val/hotpotqa/em": 1.0, "val/hotpotqa/f1": 1.0}
    assert set(benchmark_metrics(["popqa"], stage="test")["popqa"].keys(keep_base=False)) == {
        "test/popqa/subem",
        "test/popqa/em",
        "test/popqa/f1",
    }
