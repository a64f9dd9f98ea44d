"""`RoundProducer`: the one round/version state, its checkpoint, the in-process engine side's push and version guard,
what `setup` builds, and whole rounds driven with no Lightning object at all (a `TrainerLink` of plain callables; the
same producer runs through Lightning in tests/callbacks/test_rollout_callback.py)."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dspo.agent import AgentConfig
from dspo.algorithms.config import AlgorithmConfig
from dspo.models import ModelConfig
from dspo.models.weights import policy_weights
from dspo.rollout.link import TrainerLink
from dspo.rollout.producer import RoundProducer, RoundStart, RoundState
from dspo.rollout.sides import EngineProcessSide, InProcessSide, RoundPosition
from dspo.rollout.spec import WorkerSpec
from dspo.testing import RecordingEngine


def _producer(engine=None, max_staleness: int = 0, **algorithm) -> RoundProducer:
    spec = WorkerSpec(engine, None, None, AlgorithmConfig(**algorithm), ModelConfig(path="unused"), 0, max_staleness)
    return RoundProducer(spec)


class _Root(nn.Module):
    def __init__(self, weights_version: int) -> None:
        super().__init__()
        self.policy, self.weights_version = nn.Linear(2, 2), weights_version


def _link(root, **fields) -> TrainerLink:
    """A trainer as plain callables: `root`'s weights and version."""
    return TrainerLink(weights=lambda: policy_weights(root), weights_version=lambda: root.weights_version, **fields)


def test_the_version_guard_stops_a_round_sampled_from_stale_weights():
    producer = _producer()
    producer.attach(InProcessSide(RecordingEngine(version=5), None, None))
    producer.state.completed = 3
    producer.state.engine_version = 2  # the push below is skipped, as the bug the guard is for would skip it
    producer.link = _link(_Root(weights_version=2))
    with pytest.raises(RuntimeError) as stale:
        producer._start_round()
    assert str(stale.value) == (
        "engine holds weights after 5 optimizer steps, the policy after 2; round 3 is starting: the weight push "
        "was skipped (a bug in dspo; please report it)"
    )


def test_resume_mid_round_starts_a_fresh_round_restores_rng_and_forces_a_push():
    producer = _producer()
    producer.state.completed, producer.state.cursor = 4, 1
    state = producer.state_dict()
    expected = (torch.rand(3), random.random())
    fresh = _producer()
    fresh.load_state_dict(state)
    assert (fresh.state.completed, fresh.state.cursor, fresh.state.current) == (5, 0, None)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    engine = RecordingEngine(version=0)
    fresh.attach(InProcessSide(engine, None, None))
    root = _Root(weights_version=0)  # even at the engine's own version number: the engine holds the initial weights
    fresh.link = _link(root)
    fresh.push()
    assert [v for v, _ in engine.pushes] == [0] and fresh.state.engine_version == 0
    assert torch.equal(engine.pushes[0][1]["weight"], root.policy.weight)
    fresh.push()
    assert len(engine.pushes) == 1  # unchanged weights: no second push
    at_boundary = _producer()
    at_boundary.load_state_dict({**state, "cursor": 0})
    assert at_boundary.state.completed == 4


def test_counters_and_the_keep_rate_estimate_survive_a_checkpoint():
    producer = _producer()
    producer.state.completed, producer.state.generated_tokens_total = 3, 1234.0
    producer.attach(InProcessSide(None, None, SimpleNamespace(keep_rate_estimate=0.42)))
    state = producer.state_dict()
    assert (state["rounds_completed"], state["generated_tokens_total"], state["keep_rate_estimate"]) == (
        3,
        1234.0,
        0.42,
    )
    restored = _producer()
    restored.load_state_dict(state)
    assert (restored.state.completed, restored.state.generated_tokens_total) == (3, 1234.0)
    assert restored.state.engine_version == -1  # the engine must be sent the restored weights
    assert restored.keep_rate_estimate == 0.42  # kept, and handed to the filter when the next round starts
    restored.attach(InProcessSide(None, None, SimpleNamespace(keep_rate_estimate=0.9)))
    assert restored.keep_rate_estimate == 0.42  # the restored prior, not the filter's own
    early = _producer()
    early.attach(InProcessSide(None, None, SimpleNamespace(keep_rate_estimate=0.9)))
    early.load_state_dict(state)  # the side exists already (Lightning restores after setup)
    assert early.keep_rate_estimate == 0.42  # the round state's, handed to the filter when the next round starts


def test_the_round_state_owns_the_keep_rate_prior_and_the_filter_reads_and_updates_it():
    """Issue 52 (8), issue 71 (3): one owner of a round's state. The filter samples with the state's prior (restored
    or rewound); the side returns the filter's updated prior and the version it pushed, writing no state; the
    producer records both."""
    from dspo.testing import RecordingEngine

    class Filter(SimpleNamespace):
        def sample_round(self, sampler, policy_version, seed, all_done):
            self.seen, self.keep_rate_estimate = self.keep_rate_estimate, 0.7
            return [], {}

    side = InProcessSide(RecordingEngine(), None, Filter(keep_rate_estimate=0.9))
    state = RoundState(keep_rate_estimate=0.3, engine_version=-1)
    link = SimpleNamespace(weights_version=lambda: 2, weights=list, progress=lambda: (0, 1), all_true=bool)
    result = side.generate(link, state.position(), sampler=None, seed=0)
    assert side.round_sampler.seen == 0.3 and (result.keep_rate, result.engine_version) == (0.7, 2)
    assert result.sampler_state is None and (state.keep_rate_estimate, state.engine_version) == (0.3, -1)
    producer = _producer()
    producer.state = state
    producer._record(result, sampler=None)
    assert (state.keep_rate_estimate, state.engine_version) == (0.7, 2)
    assert side.push(link, RoundPosition(completed=0, engine_version=2)) == 2  # unchanged weights: nothing sent
    assert [version for version, _ in side.engine.pushes] == [2]


def test_an_old_checkpoint_without_the_newer_counters_and_the_initial_state():
    producer = _producer()
    assert producer.state == RoundState() and producer.keep_rate_estimate is None
    assert (producer.state.completed, producer.state.cursor, producer.state.engine_version) == (0, 0, 0)
    old = {"rounds_completed": 6, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
    producer.load_state_dict(old)  # written before generated_tokens_total, cursor and the keep-rate were stored
    assert producer.state.completed == 6 and producer.state.generated_tokens_total == 0.0
    assert producer.keep_rate_estimate is None


def test_step_done_closes_a_round_after_its_last_minibatch_and_hands_back_its_timeline():
    producer = _producer()
    producer.state.current = SimpleNamespace(minibatches=[["a"], ["b"]])
    producer.timeline = {"round": 0}
    assert producer.step_done() is None and producer.state.cursor == 1 and not producer.state.round_done
    assert producer.step_done() == {"round": 0}
    assert (producer.state.completed, producer.state.cursor, producer.state.current) == (1, 0, None)
    assert producer.state.round_done and producer.timeline is None


def test_setup_builds_engine_agent_and_environment_once_with_the_restored_keep_rate(lm_dir):
    """Outside the stand-ins: setup loads the tokenizer, builds the engine from its factory with the model path, the
    search agent around it and a rank's RoundSampler (B / W groups), applies a keep-rate estimate restored
    before setup, and builds nothing again on a second call; at k >= 1 it builds the engine-process side only (the
    process starts at the first push)."""
    from dspo.agent.tool_calling import ToolCallingAgent

    built = []

    def factory(model_path: str) -> RecordingEngine:
        built.append(model_path)
        return RecordingEngine()

    model = ModelConfig(path=lm_dir, tokenizer="data/tokenizers/qwen2.5")
    algo = AlgorithmConfig(group_size=2, batch_groups=4)
    producer = RoundProducer(WorkerSpec(factory, AgentConfig(), "retriever", algo, model, 0, 0))
    producer.state.keep_rate_estimate = 0.25  # as load_state_dict leaves it when it runs before setup
    producer.setup(_link(_Root(0), world_size=2, rank=1), sampler="sampler")
    side = producer.side
    assert built == [lm_dir] and isinstance(side, InProcessSide) and producer.sampler == "sampler"
    assert isinstance(side.agent, ToolCallingAgent) and side.agent.engine is side.engine
    assert side.agent.retriever == "retriever" and producer.tokenizer.pad_token_id is not None
    assert side.round_sampler.agent is side.agent and side.round_sampler.local_target == 2
    assert producer.keep_rate_estimate == 0.25  # the restored prior: the filter gets it when a round starts
    producer.setup(_link(_Root(0), world_size=2, rank=1), sampler=None)
    assert built == [lm_dir] and producer.side is side and producer.sampler == "sampler"
    ahead = RoundProducer(WorkerSpec(factory, AgentConfig(), "retriever", algo, model, 0, max_staleness=1))
    ahead.state.keep_rate_estimate = 0.5
    ahead.setup(_link(_Root(0)), sampler=None)
    assert isinstance(ahead.side, EngineProcessSide) and ahead.side.worker is None and built == [lm_dir]
    assert ahead.keep_rate_estimate == 0.5
    ahead.close()  # nothing started: nothing to stop
    assert ahead.state.engine_version == 0


def test_a_failure_rewinds_only_a_round_whose_optimizer_step_has_not_run():
    """Issue 38 (6): the sampler goes back to the round's start when nothing of the round was trained; once the
    optimizer stepped (global_step moved), a failure in a later hook of that step leaves it where it is."""
    from dspo.data.datamodule import PromptSampler
    from dspo.testing import toy_items

    producer = _producer()
    producer.attach(InProcessSide(None, None, SimpleNamespace(keep_rate_estimate=0.5)))
    sampler = PromptSampler(toy_items(), seed=0)
    start = sampler.state_dict()
    for global_step, rewound in ((4, True), (5, False)):
        sampler.load_state_dict(start)
        producer._round_start = RoundStart(4, sampler, sampler.state_dict(), 0.5)
        sampler.take(3)  # the round drew its prompts
        producer.rewind(global_step)
        assert (sampler.state_dict() == start) is rewound, global_step
        assert producer._round_start is None


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_rounds_driven_with_no_lightning_object(max_staleness):
    """Issue 41: the producer trains rounds from plain values alone, in this process (k = 0) or from an engine
    process (k = 1): a `TrainerLink` of callables stands for the trainer, a bare nn.Module for the policy whose version
    moves with each "optimizer step" here; rounds come in order, filled slots carry them, pushes carry new weights."""
    from dspo.data.rounds import PromptSampler, RoundSlot
    from dspo.rollout.sampler import RoundSampler
    from dspo.testing import ScriptedAgent, StandInTokenizer, recording_engine, scripted_agent, toy_items

    root, steps = _Root(weights_version=0), []
    link = _link(root, progress=lambda: (len(steps), 6))
    algorithm = AlgorithmConfig(group_size=4, batch_groups=2, micro_batch_size=3, num_minibatches=2)
    spec = WorkerSpec(recording_engine, scripted_agent, None, algorithm, ModelConfig(path="unused"), 0, max_staleness)
    producer = RoundProducer(replace(spec, tokenizer=StandInTokenizer()))
    producer.tokenizer = StandInTokenizer()
    engine = RecordingEngine()
    if not max_staleness:  # the built-in side, with the stand-ins instead of a model's engine
        agent = ScriptedAgent()
        producer.attach(InProcessSide(engine, agent, RoundSampler(agent, algorithm)))
    sampler = PromptSampler(toy_items(), seed=0)
    producer.setup(link, sampler)
    try:
        for round_index in range(3):
            for minibatch in range(2):
                slot = RoundSlot(index=2 * round_index + minibatch)
                stats = producer.fill(slot)
                assert (slot.round_index, slot.minibatch_index) == (round_index, minibatch)
                assert (stats is not None) == (minibatch == 0) and slot.micro_batches
                if stats is not None:
                    assert stats["rollout/groups_kept"] == 2.0 and stats["rollout/policy_version"] == round_index
                with torch.no_grad():  # an optimizer step: new weights, a new version
                    root.policy.weight.add_(1.0)
                root.weights_version += 1
                steps.append(root.weights_version)
                producer.step_done()
        assert producer.state.completed == 3 and producer.state.engine_version == 4  # pushed before round 2
        if not max_staleness:
            assert [version for version, _ in engine.pushes] == [2, 4]  # the engine starts at version 0: no push
            assert torch.equal(engine.pushes[-1][1]["weight"], root.policy.weight - 2.0)  # the weights before round 2
    finally:
        producer.close()


def test_a_two_role_agent_plays_rounds_from_the_engine_process_and_a_checkpoint_resumes_them():
    """Issue 57 (1): an agent of two roles (`dspo.testing.two_role_agent`: the solver's items built from the proposer's
    episodes in the same call) at k = 1, built by `build_agent` in the engine process like any agent: rounds carry both
    roles' groups and `rollout/<role>/...`; the producer's checkpoint is what it always was (plus the round in flight),
    and a producer restored from it goes on from the next round."""
    from dspo.data.rounds import PromptSampler, RoundSlot
    from dspo.testing import StandInTokenizer, recording_engine, toy_items, two_role_agent

    algorithm = AlgorithmConfig(group_size=4, batch_groups=4, micro_batch_size=4, num_minibatches=1)
    spec = WorkerSpec(recording_engine, two_role_agent, None, algorithm, ModelConfig(path="unused"), 0, 1)

    def producer_at(root: _Root, state: dict | None) -> RoundProducer:
        producer = RoundProducer(replace(spec, tokenizer=StandInTokenizer()))
        producer.tokenizer = StandInTokenizer()
        if state is not None:
            producer.load_state_dict(state)
        producer.setup(_link(root, progress=lambda: (root.weights_version, 6)), PromptSampler(toy_items(), seed=0))
        return producer

    def train_round(producer: RoundProducer, root: _Root) -> dict:
        slot = RoundSlot(index=root.weights_version)
        stats = producer.fill(slot)
        root.weights_version += 1
        producer.step_done()
        return stats

    root = _Root(weights_version=0)
    producer = producer_at(root, None)
    try:
        rounds = [train_round(producer, root) for _ in range(2)]
        state = producer.state_dict()
    finally:
        producer.close()
    for stats in rounds:
        assert stats["rollout/groups_kept"] == 4.0
        assert stats["rollout/proposer/groups_kept"] + stats["rollout/solver/groups_kept"] == 4.0
        assert stats["rollout/proposer/groups_sampled"] > 0 and stats["rollout/solver/groups_sampled"] > 0
        assert 0 < stats["rollout/proposer/valid_share"] <= 1
    reference = RoundProducer(replace(spec, agent=None)).state_dict()
    # and, since issue 74, the round generated ahead (checkpointing.in_flight), with both roles' groups
    assert set(state) == set(reference) | {"in_flight"} and state["rounds_completed"] == 2
    assert {g["f"]["role"] for g in state["in_flight"]["rounds"][0]["f"]["groups"]} == {"proposer", "solver"}
    resumed = producer_at(root, state)
    try:
        stats = train_round(resumed, root)
    finally:
        resumed.close()
    assert stats["rollout/policy_version"] == 2.0 and resumed.state.completed == 3
    assert stats["rollout/solver/groups_sampled"] > 0
