"""rollout.engine.sleep_during_update (issue 31, point 2): the engine sleeps once a round is generated and wakes
before the next weight push, so the call order is generate, sleep, update(s), wake, push, generate. A stand-in engine
records the order (CUDA vLLM's sleep mode cannot run here); on CPU both real engines refuse the setting."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from dspo.testing import RecordingEngine, ScriptedAgent, build_toy_lm, toy_run
from dspo.training.module import DSPOModule


@dataclass
class SleepyEngine(RecordingEngine):
    events: list[str] = field(default_factory=list)
    sleep_during_update: bool = True
    asleep: bool = False

    def sleep(self) -> None:
        assert not self.asleep, "slept twice"
        self.events.append("sleep")
        self.asleep = True

    def wake_up(self) -> None:
        assert self.asleep, "woke while awake"
        self.events.append("wake")
        self.asleep = False

    def push_weights(self, named_tensors, version: int) -> None:
        assert not self.asleep, "weights pushed into a sleeping engine"
        self.events.append("push")
        super().push_weights(named_tensors, version)


class Generating(ScriptedAgent):
    def rollout(self, items, group_size, policy_version, greedy=False, seed=None):
        assert not self.engine.asleep, "generated with a sleeping engine"
        self.engine.events.append("generate")
        return super().rollout(items, group_size, policy_version, greedy, seed)


class Updating(DSPOModule):
    def training_step(self, slot, batch_idx):
        self.trainer.callbacks[0].producer.side.engine.events.append("update")
        return super().training_step(slot, batch_idx)


@pytest.mark.parametrize("sleeps", [True, False])
def test_the_engine_sleeps_through_the_update_and_wakes_before_the_push(tmp_path, sleeps) -> None:
    lm = build_toy_lm(str(tmp_path / "lm"))
    run = toy_run(lm, str(tmp_path / "run"), max_steps=4, module_cls=Updating, num_minibatches=2)
    engine = SleepyEngine(sleep_during_update=sleeps)
    agent = Generating()
    agent.engine = engine
    from dspo.testing import attach

    attach(run.callback, agent, engine)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    one_round = ["generate", "sleep", "update", "update"] if sleeps else ["generate", "update", "update"]
    between = ["wake", "push"] if sleeps else ["push"]
    assert engine.events == one_round + between + one_round
    assert [version for version, _ in engine.pushes] == [2]


def test_the_cpu_engines_refuse_to_sleep(tmp_path) -> None:
    from dspo.engines import HFEngine, VLLMEngine

    with pytest.raises(ValueError, match="sleep_during_update=true needs CUDA vLLM"):
        VLLMEngine(model_path=str(tmp_path), sleep_during_update=True)
    with pytest.raises(ValueError, match="only the CUDA vLLM engine"):
        HFEngine(model_path=str(tmp_path), sleep_during_update=True)
