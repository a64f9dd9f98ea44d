"""The trainer and its engine process exchange frozen dataclasses (issue 41), which survive the queue's pickling."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from dspo.rollout import messages
from dspo.rollout.messages import (
    Failed,
    Loaded,
    LoadWeights,
    Predict,
    Predictions,
    Ready,
    RoundDone,
    SampledRound,
    Stop,
)

EXAMPLES = [
    LoadWeights(3, (12, 100)),
    Predict(1, ["item"], 4),
    Stop(),
    Ready(1234, "turn"),
    RoundDone(SampledRound(2, [], {"rollout/keep_rate": 0.5}, 1)),
    SampledRound(3, [], {}, 2, sampler_state={"epoch": 0, "position": 8, "seed": 0}, keep_rate=0.25),
    Predictions(1, ["answer"]),
    Failed("Traceback ..."),
    Loaded(3),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_is_frozen_and_travels_through_pickle(message):
    assert pickle.loads(pickle.dumps(message)) == message
    fields = dataclasses.fields(message)
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(message, fields[0].name, None)


def test_the_examples_cover_every_command_and_reply():
    named = {cls for cls in vars(messages).values() if dataclasses.is_dataclass(cls) and isinstance(cls, type)}
    assert named == {type(message) for message in EXAMPLES}
