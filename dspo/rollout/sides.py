"""The two engine sides a `RoundProducer` drives: this process (max_staleness 0) or an engine process (k >= 1).

Both answer the same calls: `push` (the policy's weights, when they changed), `generate` (round r's kept groups, their
statistics and when they were generated), `predict` (greedy answers at the current weights), `sleep` / `wake` (the
CUDA engine's memory during the update) and `close`. The weight version the engine holds and the filter's keep-rate
prior are not theirs: they are `RoundState.engine_version` and `RoundState.keep_rate_estimate`, the producer's one
round state, which they read and advance. What they need of
the trainer comes as a `TrainerLink` (plain values and callables): no Lightning here.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

import torch

from dspo.rollout.link import TrainerLink, on_every_rank
from dspo.rollout.placement import colocated_device, engine_devices_for, share_the_cpu
from dspo.rollout.sampler import RoundSampler
from dspo.rollout.spec import WorkerSpec, round_seed
from dspo.rollout.transfer import check_transfer
from dspo.rollout.worker import EngineProcess

log = logging.getLogger(__name__)


class LocalEngine:
    """max_staleness 0: the engine, the agent and the group filter in this process; a round is generated when training
    asks for it, by the weights after the previous round's last optimizer step (strictly on-policy)."""

    def __init__(self, engine: Any, agent: Any, round_sampler: RoundSampler) -> None:
        self.engine, self.agent, self.round_sampler = engine, agent, round_sampler

    @classmethod
    def build(cls, spec: WorkerSpec, tokenizer: Any) -> LocalEngine:
        from dspo.agent import build_agent

        engine = spec.engine(model_path=spec.model.path)
        agent = build_agent(spec.agent, engine=engine, tokenizer=tokenizer, env=spec.env)
        return cls(engine, agent, RoundSampler(agent, spec.algorithm, spec.rank, spec.world_size))

    @property
    def credit(self) -> str:
        return getattr(getattr(self.agent, "env", None), "credit", "trajectory")

    @property
    def keep_rate_estimate(self) -> float | None:
        return getattr(self.round_sampler, "keep_rate_estimate", None)

    @keep_rate_estimate.setter
    def keep_rate_estimate(self, value: float | None) -> None:
        if self.round_sampler is not None and value is not None:  # the filter always has a prior of its own
            self.round_sampler.keep_rate_estimate = float(value)

    def push(self, link: TrainerLink, state, sampler=None) -> None:
        """Algorithm 1 step 1: push the policy into the engine if it changed (gathers full params under FSDP).

        "Changed" means the module's count of applied optimizer steps moved: a skipped (non-finite) step leaves the
        weights, hence the engine, as they were, and the next round is sampled from them."""
        self.wake()
        version = link.weights_version()
        if state.engine_version == version:
            return
        self.engine.push_weights(link.weights(), version=version)
        state.engine_version = version

    def generate(self, link: TrainerLink, state, sampler, seed: int):
        """Round `state.completed`: push the policy if it changed, then generate here, now."""
        started, round_index = time.time(), state.completed
        self.push(link, state)
        weights = link.weights_version()
        if getattr(self.engine, "version", weights) != weights:
            raise RuntimeError(
                f"engine holds weights after {self.engine.version} optimizer steps, the policy after {weights}; "
                f"round {round_index} is starting: the weight push was skipped (a bug in dspo; please report it)"
            )
        env = getattr(self.agent, "env", None)
        if env is not None:  # curricula (a simulator's growing noise) read where training is
            env.on_progress(*link.progress())
        if state.keep_rate_estimate is not None:  # the round state's prior (restored, rewound) drives the filter
            self.keep_rate_estimate = state.keep_rate_estimate
        groups, stats = self.round_sampler.sample_round(
            sampler, policy_version=round_index, seed=round_seed(seed, round_index), all_done=link.all_true
        )
        state.keep_rate_estimate = self.keep_rate_estimate
        return groups, stats, (started, time.time())

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

    def close(self, state) -> None:
        """The in-process engine lives as long as the producer (a later fit/validate/test reuses it)."""


class EngineProcessSide:
    """max_staleness k >= 1: the engine, agent, filter and a copy of the sampler in a spawned engine process
    (`dspo.rollout.worker`), started at the first push; rounds are taken from it in order."""

    def __init__(self, spec: WorkerSpec, engine_cores: str, engine_threads: int | None, engine_devices) -> None:
        self.spec, self.engine_cores, self.engine_threads = spec, engine_cores, engine_threads
        self.engine_devices = engine_devices
        self.worker: EngineProcess | None = None
        self._saved_cpu: tuple | None = None  # (affinity or None, torch threads) to restore when the process stops

    @property
    def credit(self) -> str:
        """The environment's credit, as the engine process built it (its config's before it started)."""
        if self.worker is not None:
            return self.worker.credit
        return getattr(self.spec.env, "credit", "trajectory")

    def push(self, link: TrainerLink, state, sampler=None) -> None:
        """`_push` on every rank: one rank's failure (its engine process died, a transfer failed) raises on all of them
        instead of leaving the others waiting in the next collective."""
        weights = self._gathered(link, state)
        on_every_rank(link, "pushing weights", lambda: self._push(link, state, sampler, weights))

    def _gathered(self, link: TrainerLink, state) -> list | None:
        """The policy's full weights when they changed (or the engine process is not started), else None. Under FSDP
        this is an all-gather, so it stays outside `on_every_rank`'s call: a rank failing inside it would leave the
        others in the gather, not at the vote."""
        if state.engine_version != link.weights_version() or self.worker is None:
            return list(link.weights())
        return None

    def _push(self, link: TrainerLink, state, sampler, weights: list | None) -> None:
        """Start the engine process on first use, then send the policy (only when it changed; the completed-round
        count, which moves the staleness bound, always)."""
        version = link.weights_version()
        if self.worker is None:
            self.worker = EngineProcess(self._spec(link))
            # evaluation only: no rounds to produce
            self.worker.start(sampler if link.fitting() else None, state.keep_rate_estimate, state.completed, weights)
        self.worker.push_weights(weights, state.completed, version, link.progress())
        state.engine_version = version

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

    def generate(self, link: TrainerLink, state, sampler, seed: int):
        """The round the engine process generated (up to max_staleness rounds ago); every rank fails together."""
        round_index = state.completed
        weights = self._gathered(link, state)

        def push_and_take():
            self._push(link, state, sampler, weights)
            return self.worker.take_round(round_index)

        sampled, waited = on_every_rank(link, f"taking round {round_index}", push_and_take)
        sampler.load_state_dict(sampled.end_state["sampler"])  # what a checkpoint saves: round r+1's start
        state.keep_rate_estimate = sampled.end_state["keep_rate_estimate"]  # the engine process's, after the round
        stats = dict(sampled.stats)
        stats["rollout/trainer_wait_s"] = waited
        stats["rollout/producer_idle_s"] = sampled.idle_s
        return sampled.groups, stats, sampled.generation

    def predict(self, items: list, round_index: int, eval_batch_size: int) -> list:
        return self.worker.predict(items, round_index)

    def sleep(self) -> None:
        """The engine process generates during the update: it never sleeps (`check_staleness` refuses the setting)."""

    def wake(self) -> None:
        """See `sleep`."""

    def close(self, state) -> None:
        """Stop the engine process and give the trainer its cores and threads back; a later push starts a new one."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
            state.engine_version = -1
        if self._saved_cpu is not None:
            cores, threads = self._saved_cpu
            if cores is not None:
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
            self._saved_cpu = None
