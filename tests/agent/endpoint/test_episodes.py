"""An episode's calls -> training samples: extension (one sequence), breaks (a new sample, counted), branches (n > 1),
worked out by hand on small ids."""

from __future__ import annotations

from dspo.agent.endpoint.episodes import CallRecord, build_samples
from dspo.types import Generation


def gen(ids: list[int], lp: float = -0.5) -> Generation:
    return Generation(token_ids=ids, logprobs=[lp] * len(ids), finish_reason="stop")


def test_calls_that_extend_the_history_are_one_sequence():
    calls = [
        CallRecord([1, 2, 3], [gen([10, 11])]),
        CallRecord([1, 2, 3, 10, 11, 20, 21], [gen([12], -0.25)]),  # + tool turn 20 21 (template tokens)
    ]
    (sample,), breaks = build_samples(calls)
    assert breaks == 0
    assert sample.prompt_ids == [1, 2, 3]
    assert sample.response_ids == [10, 11, 20, 21, 12]
    assert sample.mask == [1, 1, 0, 0, 1]
    assert sample.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.25]
    assert sample.spans == [(0, 2), (4, 5)]


def test_a_rewritten_history_starts_a_new_sample_and_is_counted():
    calls = [
        CallRecord([1, 2, 3], [gen([10, 11])]),
        CallRecord([1, 2, 9, 10, 11, 20], [gen([13])]),  # the agent changed token 3: no sample is its prefix
        CallRecord([1, 2, 9, 10, 11, 20, 13, 30], [gen([14])]),  # extends the second sample
    ]
    samples, breaks = build_samples(calls)
    assert breaks == 1
    assert [(s.prompt_ids, s.response_ids, s.mask) for s in samples] == [
        ([1, 2, 3], [10, 11], [1, 1]),
        ([1, 2, 9, 10, 11, 20], [13, 30, 14], [1, 0, 1]),
    ]
    trained = [t for s in samples for t, m in zip(s.response_ids, s.mask) if m]
    assert trained == [10, 11, 13, 14]  # every generated token once, none of the template's


def test_n_completions_branch_without_training_a_token_twice():
    calls = [
        CallRecord([1, 2], [gen([10]), gen([11]), gen([12])]),
        CallRecord([1, 2, 10, 20], [gen([13])]),  # the agent went on with the first choice
    ]
    samples, breaks = build_samples(calls)
    assert breaks == 0  # branches are not breaks
    assert [(s.prompt_ids, s.response_ids, s.mask) for s in samples] == [
        ([1, 2], [10, 20, 13], [1, 0, 1]),
        ([1, 2], [11], [1]),
        ([1, 2], [12], [1]),
    ]


def test_the_longest_matching_sample_is_extended():
    calls = [
        CallRecord([1], [gen([2])]),
        CallRecord([5], [gen([6])]),  # a second conversation (a sub-agent): a break
        CallRecord([1, 2, 3], [gen([4])]),  # back to the first one
        CallRecord([5, 6, 7], [gen([8])]),
    ]
    samples, breaks = build_samples(calls)
    assert breaks == 1
    assert [s.ids for s in samples] == [[1, 2, 3, 4], [5, 6, 7, 8]]
