"""The two engine sides a `RoundProducer` drives, named by where the engine is: `InProcessSide` (in this process,
max_staleness 0) or `EngineProcessSide` (in an engine process, k >= 1; `dspo.rollout.engine_process` is the handle
it drives).

Both answer the same calls: `push` (the policy's weights, when they changed; returns the version the engine holds),
`generate` (round r as a `RoundResult`: its kept groups, their statistics, when they were generated, the filter's
keep-rate prior after it, the version that sampled it), `predict` (greedy answers at the current weights), `sleep` /
`wake` (the CUDA engine's memory during the update) and `close`. The weight version the engine holds and the filter's
keep-rate prior are not theirs: they are `RoundState.engine_version` and `RoundState.keep_rate_estimate`, the
producer's one round state, which the sides read as a frozen `RoundPosition` and which only the producer writes, from
what they return. What they need of the trainer comes as a `TrainerLink` (plain values and callables): no Lightning
here.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from dspo.process.progress_log import phase, progress_logger
from dspo.rollout.engine_process import EngineProcess
from dspo.rollout.in_flight import InFlight, engine_name
from dspo.rollout.link import TrainerLink, on_every_rank
from dspo.rollout.messages import SampledRound
from dspo.rollout.placement import colocated_device, engine_devices_for, share_the_cpu
from dspo.rollout.sampler import RoundSampler
from dspo.rollout.spec import WorkerSpec, round_seed
from dspo.rollout.transfer import check_transfer
from dspo.types import RolloutGroup

log = logging.getLogger(__name__)
progress = progress_logger("engine")


@dataclass(frozen=True)
class RoundPosition:
    """What an engine side reads of the producer's `RoundState` (a copy: the sides never write the round state)."""

    completed: int  # rounds whose last optimizer step ended: the index of the round to generate next
    engine_version: int  # DSPOModule.weights_version the engine holds (-1: unknown, push before sampling)
    keep_rate: float | None = None  # the filter's keep-rate prior for the next round (None: the filter's own)


@dataclass(frozen=True)
class RoundResult:
    """One round as an engine side hands it to the producer, which records in `RoundState` what it changed."""

    groups: list[RolloutGroup]  # [B / world] this rank's kept groups, unbuilt (the producer pads them)
    stats: dict[str, float]  # RoundSampler.sample_round's statistics (at k >= 1 with the trainer's wait, the idle time)
    generation: tuple[float, float]  # time.time() when its generation started and ended
    keep_rate: float | None  # the filter's keep-rate prior after the round: the next round's
    engine_version: int  # the weight version the engine held for the round (pushed first when the policy changed)
    # the engine process's prompt sampler after the round (over-sampled prompts included): round r+1's start, which
    # the trainer's sampler takes for its checkpoint. None in this process, where the trainer's sampler drew them
    sampler_state: dict[str, int] | None = None


class InProcessSide:
    """max_staleness 0: the engine, the agent and the group filter in this process; a round is generated when training
    asks for it, by the weights after the previous round's last optimizer step (strictly on-policy)."""

    def __init__(self, engine: Any, agent: Any, round_sampler: RoundSampler) -> None:
        self.engine, self.agent, self.round_sampler = engine, agent, round_sampler

    @classmethod
    def build(cls, spec: WorkerSpec, tokenizer: Any) -> InProcessSide:
        from dspo.agent import build_agent

        with phase(f"engine start ({engine_name(spec.engine)})", progress):  # vLLM: tens of seconds on a CPU
            engine = spec.engine(model_path=spec.model.path)
        agent = build_agent(spec.agent, engine=engine, tokenizer=tokenizer, env=spec.env)
        return cls(engine, agent, RoundSampler(agent, spec.algorithm, spec.rank, spec.world_size))

    @property
    def credit(self) -> str:
        return getattr(getattr(self.agent, "env", None), "credit", "trajectory")

    @property
    def initial_keep_rate(self) -> float | None:
        """The filter's own keep-rate prior, before the round state gives it one (None: no filter)."""
        return getattr(self.round_sampler, "keep_rate_estimate", None)

    def push(self, link: TrainerLink, position: RoundPosition, sampler=None) -> int:
        """Algorithm 1 step 1: push the policy into the engine if it changed (gathers full params under FSDP). Returns
        the version the engine holds.

        "Changed" means the module's count of applied optimizer steps moved: a skipped (non-finite) step leaves the
        weights, hence the engine, as they were, and the next round is sampled from them."""
        self.wake()
        version = link.weights_version()
        if position.engine_version != version:
            self.engine.push_weights(link.weights(), version=version)
        return version

    def generate(self, link: TrainerLink, position: RoundPosition, sampler, seed: int) -> RoundResult:
        """Round `position.completed`: push the policy if it changed, then generate here, now."""
        started, round_index = time.time(), position.completed
        engine_version = self.push(link, position)
        weights = link.weights_version()
        if getattr(self.engine, "version", weights) != weights:
            raise RuntimeError(
                f"engine holds weights after {self.engine.version} optimizer steps, the policy after {weights}; "
                f"round {round_index} is starting: the weight push was skipped (a bug in dspo; please report it)"
            )
        env = getattr(self.agent, "env", None)
        if env is not None:  # curricula (a simulator's growing noise) read where training is
            env.on_progress(*link.progress())
        if position.keep_rate is not None:  # the round state's prior (restored, rewound) drives the filter
            self.round_sampler.keep_rate_estimate = float(position.keep_rate)
        groups, stats = self.round_sampler.sample_round(
            sampler, policy_version=round_index, seed=round_seed(seed, round_index), all_done=link.all_true
        )
        generation = (started, time.time())
        return RoundResult(groups, stats, generation, self.round_sampler.keep_rate_estimate, engine_version)

    def predict(self, items: list, round_index: int, eval_batch_size: int) -> list:
        from dspo.eval.pipeline import predict

        return predict(self.agent, items, eval_batch_size, policy_version=round_index, progress=False)

    def sleep(self) -> None:
        """With `rollout.engine.sleep_during_update` (CUDA vLLM): the engine frees the GPU for the update (vLLM sleep
        level 1: weights offloaded to host memory, KV cache dropped); `push` wakes it first."""
        if getattr(self.engine, "sleep_during_update", False) and not self.engine.asleep:
            self.engine.sleep()

    def wake(self) -> None:
        if getattr(self.engine, "asleep", False):
            self.engine.wake_up()

    def close(self) -> bool:
        """The in-process engine lives as long as the producer (a later fit/validate/test reuses it): it keeps its
        weights (returns False)."""
        return False


class EngineProcessSide:
    """max_staleness k >= 1: the engine, agent, filter and a copy of the sampler in a spawned engine process
    (`dspo.rollout.engine_process`), started at the first push; rounds are taken from it in order."""

    initial_keep_rate = None  # the engine process's filter reports its prior with each round (`RoundResult.keep_rate`)

    def __init__(self, spec: WorkerSpec, engine_cores: str, engine_threads: int | None, engine_devices) -> None:
        self.spec, self.engine_cores, self.engine_threads = spec, engine_cores, engine_threads
        self.engine_devices = engine_devices
        self.worker: EngineProcess | None = None  # the handle on the engine process (None: not started)
        self._saved_cpu: tuple | None = None  # (affinity or None, torch threads) to restore when the process stops
        self.restored: InFlight | None = None  # a checkpoint's in-flight rounds, until the engine process starts

    def restore(self, in_flight: InFlight | None) -> None:
        """Train `in_flight`'s rounds first; the engine process, when it starts, continues after the last of them."""
        self.restored = in_flight

    def rounds_in_flight(self, completed: int) -> list[SampledRound]:
        """The rounds from `completed` on that are generated or may be without another push (a checkpoint stores them;
        `EngineProcess.wait_rounds`); a restored set not yet handed to an engine process is still in flight."""
        if self.worker is None:
            return list(self.restored.rounds) if self.restored is not None else []
        return self.worker.wait_rounds(completed)

    @property
    def credit(self) -> str:
        """The environment's credit, as the engine process built it (its config's before it started)."""
        if self.worker is not None:
            return self.worker.credit
        return getattr(self.spec.env, "credit", "trajectory")

    def push(self, link: TrainerLink, position: RoundPosition, sampler=None) -> int:
        """`_push` on every rank: one rank's failure (its engine process died, a transfer failed) raises on all of them
        instead of leaving the others waiting in the next collective. Returns the version the engine holds."""
        weights = self._gathered(link, position)
        return on_every_rank(link, "pushing weights", lambda: self._push(link, position, sampler, weights))

    def _gathered(self, link: TrainerLink, position: RoundPosition) -> list | None:
        """The policy's full weights when they changed (or the engine process is not started), else None. Under FSDP
        this is an all-gather, so it stays outside `on_every_rank`'s call: a rank failing inside it would leave the
        others in the gather, not at the vote."""
        if position.engine_version != link.weights_version() or self.worker is None:
            return list(link.weights())
        return None

    def _push(self, link: TrainerLink, position: RoundPosition, sampler, weights: list | None) -> int:
        """Start the engine process on first use, then send the policy (only when it changed; the completed-round
        count, which moves the staleness bound, always). Returns the version sent."""
        version = link.weights_version()
        if self.worker is None:
            self.worker = EngineProcess(self._spec(link))
            # evaluation only: no rounds to produce
            fitting_sampler = sampler if link.fitting() else None
            start = self._start_point(position, fitting_sampler)
            with phase(f"engine process start ({engine_name(self.spec.engine)})", progress):
                self.worker.start(*start[:3], weights, resume=start[3])
            if start[4]:
                self.worker.adopt(start[4])
        self.worker.push_weights(weights, position.completed, version, link.progress())
        return version

    def _start_point(self, position: RoundPosition, sampler) -> tuple:
        """(sampler, keep-rate prior, first round, engine resume state, rounds to adopt) of a new engine process: after
        a checkpoint's in-flight rounds when there are some for this round, else at `position`."""
        restored, self.restored = self.restored, None
        if sampler is None or restored is None or restored.rounds[0].index != position.completed:
            if restored is not None and sampler is not None:
                first = restored.rounds[0].index
                log.warning("in-flight rounds from %d do not follow round %d: regenerated", first, position.completed)
            self.restored = restored if sampler is None else None  # evaluation only: keep them for the fit
            return sampler, position.keep_rate, position.completed, None, []
        ahead = copy.copy(sampler)  # the engine process's copy draws on from where the last stored round ended
        if restored.sampler_state is not None:
            ahead.load_state_dict(restored.sampler_state)
        return ahead, restored.keep_rate, restored.next_round, restored.engine_resume(), restored.rounds

    def _spec(self, link: TrainerLink) -> WorkerSpec:
        local = link.local_world_size
        devices = engine_devices_for(self.engine_devices, link.local_rank, local)
        cuda = getattr(link.device, "type", "cpu") == "cuda"
        engine_on_gpu = cuda or devices is not None
        engine_threads, cores, self._saved_cpu = share_the_cpu(
            self.engine_cores, self.engine_threads, local, engine_on_cpu=not engine_on_gpu
        )
        log.info("engine process: %d thread(s), cores %s; trainer: %d", engine_threads, cores, torch.get_num_threads())
        check_transfer(self.spec.weight_transfer, colocated=devices is None, cuda=cuda)
        if cuda and devices is not None and self.spec.weight_transfer == "shared_memory":
            log.info("weights go through host memory; rollout.weight_transfer=nccl sends them GPU to GPU")
        return replace(
            self.spec,
            rank=link.rank,
            world_size=link.world_size,
            threads=engine_threads,
            cores=cores,
            visible_devices=devices or colocated_device(link.device, os.environ.get("CUDA_VISIBLE_DEVICES")),
        )

    def generate(self, link: TrainerLink, position: RoundPosition, sampler, seed: int) -> RoundResult:
        """The round the engine process generated (up to max_staleness rounds ago); every rank fails together."""
        round_index = position.completed
        weights = self._gathered(link, position)

        def push_and_take():
            version = self._push(link, position, sampler, weights)
            return version, *self.worker.take_round(round_index)

        version, sampled, waited = on_every_rank(link, f"taking round {round_index}", push_and_take)
        stats = dict(sampled.stats)
        stats["rollout/trainer_wait_s"] = waited
        stats["rollout/producer_idle_s"] = sampled.idle_s
        return RoundResult(
            sampled.groups, stats, sampled.generation, sampled.keep_rate, version, sampler_state=sampled.sampler_state
        )

    def predict(self, items: list, round_index: int, eval_batch_size: int) -> list:
        return self.worker.predict(items, round_index)

    def sleep(self) -> None:
        """The engine process generates during the update: it never sleeps (`check_staleness` refuses the setting)."""

    def wake(self) -> None:
        """See `sleep`."""

    def close(self) -> bool:
        """Stop the engine process and give the trainer its cores and threads back; a later push starts a new one.
        Returns whether an engine, with the weights it held, was ended (a later push must send them again)."""
        ended = self.worker is not None
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self._saved_cpu is not None:
            cores, threads = self._saved_cpu
            if cores is not None:
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
            self._saved_cpu = None
        return ended
