"""In-flight rounds in checkpoints (issue 74): their plain encoding, the refusals and fallbacks of a resume, and a
producer at k = 1 saved at a round boundary and restored that trains the same rounds as one never stopped.
The end-to-end runs (Lightning, the transformers engine, SIGUSR1) are tests/test_resume_in_flight.py."""

from __future__ import annotations

import io
import logging
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch import nn

from dspo.agent.episode import Episode
from dspo.agent.parsing import ParsedCall
from dspo.agent.partial import CarriedGroup
from dspo.algorithms.config import AlgorithmConfig
from dspo.env.rewards import TurnRecord
from dspo.env.tools import ToolResult
from dspo.models import ModelConfig
from dspo.models.weights import policy_weights
from dspo.rollout.in_flight import DISCARD, pack, unpack
from dspo.rollout.link import TrainerLink
from dspo.rollout.messages import SampledRound
from dspo.rollout.plain import decode, encode
from dspo.rollout.producer import RoundProducer
from dspo.rollout.spec import WorkerSpec
from dspo.types import Passage, QAItem, RolloutGroup, Segment, Trajectory


def _trajectory(version: int, n: int = 40) -> Trajectory:
    logprobs = [-0.1 * i if i % 3 else 0.0 for i in range(n)]  # float64 values float32 cannot hold exactly
    return Trajectory(
        prompt_ids=list(range(5, 25)),
        response_ids=[70_000 + i for i in range(n)],
        response_mask=[int(i % 3 != 0) for i in range(n)],
        engine_logprobs=logprobs,
        reward=1.0,
        turn_spans=[(0, 10), (12, n)],
        reward_components={"subem": 1.0},
        tool_calls={"search": 2},
        policy_version=version,
        segments=[Segment([1, 2], [3, 4], [1, 0], [-0.5, 0.0])],
        token_versions=[version] * (n // 2) + [version + 1] * (n - n // 2),
    )


def _group(version: int) -> RolloutGroup:
    item = QAItem("q1", "who?", ["x", "y"], metadata={"hops": 2, "path": ["a", "b"]})
    return RolloutGroup(item, [_trajectory(version), _trajectory(version)], prompt_index=7, role="solver")


def _carried(version: int) -> CarriedGroup:
    result = ToolResult("found", [Passage("p1", "T", "text", 1.5)], metrics={"noise": 0.25})
    episode = Episode(
        item=QAItem("q2", "where?", ["z"]),
        prompt_ids=list(range(12)),
        version=version,
        response_ids=list(range(100, 130)),
        mask=[1] * 30,
        logprobs=[float(torch.tensor(-0.37 * i, dtype=torch.float32)) for i in range(30)],
        versions=[version] * 30,
        turns=[TurnRecord("<search>a</search>", ("search", {"query": "a"}), None, result)],
        turn_spans=[(0, 30)],
        tool_calls=Counter({"search": 1}),
        invalid=Counter({("search", "missing_open_tag"): 2}),
        pending=ParsedCall("search", {"query": "b"}),
    )
    return CarriedGroup(episode.item, 3, [episode], started=version, counted=11)


def _round(index: int, weights_round: int, carried: list | None = None) -> SampledRound:
    rng = {"torch": torch.get_rng_state(), "python": (3, tuple(range(625)), None)}
    resume = {"carried": carried, "rng": rng, "retrieval_cache": [(("capit", "franc"), 1, "digest")]}
    return SampledRound(
        index,
        [_group(weights_round)],
        {"rollout/keep_rate": 0.5, "rollout/invalid/search/x": 1.0},
        weights_round,
        sampler_state={"epoch": 0, "position": 4 * (index + 1), "seed": 0},
        keep_rate=0.5 + index / 100,
        generation=(1.0, 2.0),
        resume=resume,
    )


def _through_a_checkpoint(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # the safe loader: no pickled object could come back


def test_rounds_and_carried_episodes_come_back_equal_through_the_safe_loader():
    group, carried = _group(3), _carried(4)
    stored = _through_a_checkpoint({"group": encode(group), "carried": encode([carried])})
    assert decode(stored["group"]) == group
    assert decode(stored["carried"]) == [carried]
    restored = decode(stored["carried"])[0].episodes[0]
    assert restored.invalid[("search", "missing_open_tag")] == 2 and restored.turn_spans == [(0, 30)]
    assert restored.turns[0].call == ("search", {"query": "a"})
    packed = encode(group)["f"]["trajectories"][0]["f"]
    assert packed["response_ids"].dtype == torch.int32  # token ids: one int32 tensor
    assert packed["response_mask"].dtype == packed["token_versions"].dtype == torch.uint8  # a byte a token
    assert packed["engine_logprobs"].dtype == torch.float64  # float32 would change these values
    episode = encode(carried)["f"]["episodes"][0]["f"]
    assert episode["logprobs"].dtype == torch.float32  # these it holds exactly (what engines return)


def test_only_known_records_are_stored_and_built():
    with pytest.raises(TypeError, match="set"):
        encode({"a": {1, 2}})
    with pytest.raises(ValueError, match="'os._wrap_close'"):
        decode({"__dc__": "os._wrap_close", "f": {}})
    with pytest.raises(ValueError, match="fields this dspo does not know"):
        decode({"__dc__": "QAItem", "f": {"id": "a", "question": "b", "golden_answers": [], "shell": "x"}})


def _settings(**changes) -> dict:
    base = {
        "rollout.max_staleness": 2,
        "rollout.max_token_age": 3,
        "rollout.engine": "HFEngine",
        "model.path": "/m",
        "tokenizer": "abc",
    }
    return {**base, **changes}


def _saved(carried: bool = True) -> dict:
    rounds = [_round(5, 4), _round(6, 4, [_carried(4)] if carried else None)]
    return _through_a_checkpoint(pack(rounds, _settings()))


def test_a_resume_with_the_same_settings_gets_every_round_and_the_engine_state():
    restored = unpack(_saved(), _settings(), completed=5, world_size=1)
    assert [r.index for r in restored.rounds] == [5, 6] and restored.next_round == 7
    assert restored.rounds[0].groups == [_group(4)] and restored.rounds[0].resume is None
    assert restored.carried == [_carried(4)] and restored.keep_rate == 0.56
    assert restored.sampler_state == {"epoch": 0, "position": 28, "seed": 0}
    assert torch.equal(restored.engine_rng["torch"], torch.get_rng_state())
    assert restored.engine_resume()["retrieval_cache"] == [(("capit", "franc"), 1, "digest")]


def test_another_tokenizer_or_format_is_refused_naming_the_key_and_the_way_out():
    with pytest.raises(ValueError, match=f"model.path=/other.*{DISCARD}"):
        unpack(_saved(), _settings(tokenizer="zzz", **{"model.path": "/other"}), completed=5, world_size=1)
    with pytest.raises(ValueError, match=DISCARD):
        unpack({**_saved(), "format": 99}, _settings(), completed=5, world_size=1)


def test_a_smaller_bound_keeps_the_rounds_it_admits_and_drops_the_carried_state(caplog):
    with caplog.at_level(logging.WARNING):
        restored = unpack(_saved(), _settings(**{"rollout.max_staleness": 1}), completed=5, world_size=1)
    assert [r.index for r in restored.rounds] == [5]  # round 6 (staleness 2) is regenerated from round 5's end
    assert restored.carried is None and restored.engine_rng is None and restored.retrieval_cache is None
    assert restored.next_round == 6
    assert "rollout.max_staleness=1" in caplog.text
    assert unpack(_saved(), _settings(**{"rollout.max_staleness": 0}), completed=5, world_size=1) is None


def test_another_engine_trains_them_with_a_warning_and_other_cases_regenerate(caplog):
    with caplog.at_level(logging.WARNING):
        restored = unpack(_saved(), _settings(**{"rollout.engine": "VLLMEngine"}), completed=5, world_size=1)
    assert len(restored.rounds) == 2 and "rollout.engine" in caplog.text
    assert unpack(_saved(), _settings(), completed=5, world_size=2) is None  # a checkpoint holds rank 0's only
    assert unpack(_saved(), _settings(), completed=4, world_size=1) is None  # not the rounds after this checkpoint
    restored = unpack(_saved(), _settings(**{"rollout.max_token_age": None}), completed=5, world_size=1)
    assert restored is None or restored.carried is None  # partial rollouts off: nothing carries the episodes


class _Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.policy, self.weights_version = nn.Linear(2, 2), 0


def _k1_producer(root: _Root, state: dict | None, **changes) -> RoundProducer:
    from dspo.data.rounds import PromptSampler
    from dspo.testing import StandInTokenizer, recording_engine, scripted_agent, toy_items

    algorithm = AlgorithmConfig(group_size=4, batch_groups=2, micro_batch_size=4, num_minibatches=1)
    spec = WorkerSpec(recording_engine, scripted_agent, None, algorithm, ModelConfig(path="unused"), 0, 1)
    producer = RoundProducer(replace(spec, tokenizer=StandInTokenizer(), **changes))
    producer.tokenizer = StandInTokenizer()
    sampler = PromptSampler(toy_items(), seed=0)
    link = TrainerLink(weights=lambda: policy_weights(root), weights_version=lambda: root.weights_version)
    producer.setup(link, sampler)
    if state is not None:
        sampler.load_state_dict(state["sampler"])  # what the data module restores
        producer.load_state_dict(state["producer"])
    return producer


def _train_rounds(producer: RoundProducer, root: _Root, n: int) -> list:
    from dspo.data.rounds import RoundSlot

    rounds = []
    for _ in range(n):
        stats = producer.fill(RoundSlot(index=root.weights_version))
        groups = producer.state.current.groups
        with torch.no_grad():
            root.policy.weight.add_(0.5)
        root.weights_version += 1
        producer.step_done()
        rounds.append(({k: v for k, v in stats.items() if not k.endswith("_s")}, groups))
    return rounds


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_k1_producer_restored_at_a_round_boundary_trains_the_rounds_of_one_never_stopped(in_flight, caplog):
    torch.manual_seed(0)
    whole_root = _Root()
    start = {k: v.clone() for k, v in whole_root.state_dict().items()}
    producer = _k1_producer(whole_root, None, in_flight=in_flight)
    try:
        whole = _train_rounds(producer, whole_root, 4)
    finally:
        producer.close()
    root = _Root()
    root.load_state_dict(start)
    producer = _k1_producer(root, None, in_flight=in_flight)
    try:
        cut = _train_rounds(producer, root, 2)
        state = {"producer": producer.state_dict(), "sampler": producer.sampler.state_dict()}
    finally:
        producer.close()
    assert ("in_flight" in state["producer"]) == in_flight
    state = _through_a_checkpoint(state)
    with caplog.at_level(logging.WARNING):
        resumed = _k1_producer(root, state, in_flight=in_flight)
    assert ("round 2 is regenerated at the restored weights" in caplog.text) != in_flight  # an old checkpoint's way
    try:
        cut += _train_rounds(resumed, root, 2)
    finally:
        resumed.close()
    if in_flight:
        assert cut == whole  # every round's groups (token ids, logprobs, versions) and statistics
    else:  # regenerated at the restored weights: round 2 has staleness 0, not the uninterrupted run's 1
        assert cut[:2] == whole[:2] and cut[2][0]["rollout/staleness_max"] == 0.0
        assert whole[2][0]["rollout/staleness_max"] == 1.0


def test_k0_checkpoints_hold_what_they_always_held():
    from dspo.testing import StandInTokenizer

    algorithm = AlgorithmConfig(group_size=4, batch_groups=2, micro_batch_size=4, num_minibatches=1)
    spec = WorkerSpec(None, None, None, algorithm, ModelConfig(path="unused"), 0, 0)
    producer = RoundProducer(replace(spec, tokenizer=StandInTokenizer()))
    keys = {"rounds_completed", "generated_tokens_total", "cursor", "torch_rng", "python_rng", "keep_rate_estimate"}
    assert set(producer.state_dict()) == keys
