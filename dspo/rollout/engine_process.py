"""The engine in its own process: rounds generated up to `max_staleness` rounds ahead of training (issue 28).

With `rollout.max_staleness = k >= 1` the trainer process no longer generates. A spawned *engine process* builds the
engine, the agent and the group filter (`RoundSampler`) from a picklable `WorkerSpec`, owns the prompt sampler,
and produces round after round into a queue while the trainer updates. Four rules keep it bounded and reproducible:

- **One behaviour policy per round.** Weights are loaded only between rounds (as verl's one-step-off and fully-async
  "finish on old weights" modes do), so the filter and DSPO's sequence ratio see one sampling policy per group
  (unless `rollout.partial_rollouts`: then an episode carried into the next round takes its later turns from newer
  weights, each token keeping its version; `dspo.agent.partial`).
- **Bounded at admission.** Round r starts only once the engine holds the weights after at least r - k completed
  rounds; the trainer re-checks the bound when it takes the round. Every trajectory carries `policy_version` = the
  completed rounds of the weights that sampled it, so staleness = r - policy_version (logged as rollout/staleness_*).
- **Seeded by the round index.** Round r samples with seed `seed * 1_000_003 + r * 1_009`, as the synchronous path.
- **At k = 1, one version per round whatever the timing.** Round r is sampled by the weights after exactly r - 1
  rounds: `push_weights` writes a push only once the engine process reported the previous one loaded (`Loaded`),
  and the engine process loads a push only when the bound needs it (`EngineProcessLoop._hold_back`). Without these a
  fast update (or a fresh engine process after a resume) could hand round r newer weights: fresher, but not the same
  run twice (issue 74).

Weights travel by `rollout.weight_transfer` (`dspo.rollout.transfer`): host shared memory (default; on a GPU box a
device-to-host copy per push), or a two-member gloo (CPU) / NCCL (GPU to GPU, engines on their own GPUs) process group
between the trainer rank and its engine process, received by a thread while the engine generates. Either way the engine
process copies the newest weights into the engine with `push_weights` between rounds (docs/scaling.md; NCCL not run
here: no GPU).

This module is the trainer's handle on the engine process (`EngineProcess`: start it, push weights, take rounds in
order, ask for predictions, end it and what it started); what runs in the process is
`dspo.rollout.engine_process_main`, what they say to each other `dspo.rollout.messages`. Who drives it:
`dspo.rollout.sides.EngineProcessSide` (a `RoundProducer`'s engine side at k >= 1); where it runs (cores, threads,
GPUs): `dspo.rollout.placement`.

Faults (issue 38): the engine process is not daemonic, so vLLM's multiprocess executor (tensor_parallel_size > 1) and
tools backed by process pools may start children there; it watches its trainer instead (`_exit_with_the_trainer`: a
thread that, once the trainer is gone, kills the engine process's own children and exits), and every wait of the
trainer checks that the engine process lives. The engine process builds the environment from its config
(`dspo.env.spec.EnvironmentSpec`) and imports the run's `imports=` modules first, so user plug-ins exist there.
`dspo.rollout.faults` kills either side at named points for the tests.

Departures from common implementations: π_old is never the engine's logprobs (verl/prime-rl/TRL "bypass" it); it stays
the trainer's own at the start of the round it trains (Eq. 6), and the engine-vs-old gap, staleness plus numerics, is
what `algorithm.rollout_correction` weighs. Rounds in flight are checkpointed (`wait_rounds`, `dspo.rollout.in_flight`):
a resumed run's engine process starts after the last of them (`start(..., resume)`) and the trainer takes them first
(`adopt`); with `checkpointing.in_flight=false` a resumed run regenerates them from the saved start state of the first
unconsumed round (sampler position, keep-rate prior), at the restored weights.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import signal
import time
from collections.abc import Iterable
from typing import Any

import torch

from dspo.rollout.channel import Replies, ReplySender
from dspo.rollout.engine_process_main import serve
from dspo.rollout.faults import fault_point
from dspo.rollout.messages import (
    Failed,
    Loaded,
    LoadWeights,
    Predict,
    Predictions,
    Ready,
    Reply,
    RoundDone,
    SampledRound,
    Stop,
)
from dspo.rollout.spec import POLL_S, WorkerSpec

log = logging.getLogger(__name__)


class EngineProcessDied(RuntimeError):
    """The engine process exited (killed, out of memory, crashed) while the trainer waited for it."""


class EngineProcessError(RuntimeError):
    """The engine process raised (sampling exhausted, a tool failed the round, ...); the message has its traceback."""


def _engine_dtype(engine: Any) -> torch.dtype | None:
    """The engine's `dtype` keyword (`rollout.engine.dtype`) as a torch dtype; None when it has none."""
    name = (getattr(engine, "keywords", None) or {}).get("dtype")
    return getattr(torch, str(name), None) if name else None


def check_round_bounds(sampled: SampledRound, max_staleness: int, max_token_age: int | None) -> None:
    """The bounds a round is admitted under: its weights at most `max_staleness` rounds behind it, and every
    trajectory's oldest tokens at most `max_token_age` (partial rollouts; else `max_staleness`)."""
    index, staleness = sampled.index, sampled.index - sampled.weights_round
    oldest = min((t.policy_version for g in sampled.groups for t in g.trajectories), default=sampled.weights_round)
    age_bound = max_staleness if max_token_age is None else max_token_age
    if not 0 <= staleness <= max_staleness or index - oldest > age_bound:
        raise RuntimeError(
            f"round {index} was sampled by the weights after {sampled.weights_round} rounds, its oldest tokens by "
            f"those after {oldest}: outside rollout.max_staleness={max_staleness} / max token age {age_bound} (a bug "
            "in dspo; please report it)"
        )


def end_group(pid: int) -> None:
    """SIGKILL what is left of the engine process's group (it is its leader: `dspo.rollout.engine_process_main`): its
    children, orphaned when it died mid-round, would keep their GPU memory."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) != pid:  # not its own group (it died before making it): nothing of it to sweep
            return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class EngineProcess:
    """The trainer's handle on the engine process: push weights, take rounds in order, ask for predictions."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.process = None
        self._ctx = torch.multiprocessing.get_context("spawn")
        self._ready: dict[int, SampledRound] = {}
        self._predictions = 0
        self._pushes = 0  # sends so far: the engine process loads the weights of push n when handling command n
        self._loaded = 0  # the last push the engine process reported loaded (`Loaded`)
        self.produces = False  # whether it generates rounds (started with a sampler: training, not evaluation only)
        self.pid: int | None = None
        self.credit = "trajectory"  # the environment's credit, as the engine process built it (dspo.env)

    @property
    def started(self) -> bool:
        return self.process is not None

    def start(
        self,
        sampler,
        keep_rate: float | None,
        first_round: int,
        weights: Iterable[tuple[str, torch.Tensor]],
        resume: dict | None = None,
    ):
        """Allocate the shared weight buffers from the first weights and spawn the process (blocks until its engine
        is built, so a bad config fails here, at the start). `resume`: the engine process's state after a
        checkpoint's last in-flight round (`dspo.rollout.in_flight.InFlight.engine_resume`)."""
        from dspo.rollout.transfer import make_transfer

        named = [(name, tensor.detach()) for name, tensor in weights]
        self.transfer = make_transfer(
            self.spec.weight_transfer, self._ctx, engine_device="cuda:0", wire_dtype=_engine_dtype(self.spec.engine)
        )
        self.transfer.allocate(named)
        # replies on a one-way pipe read by a thread (`dspo.rollout.channel`): a round half-written by an engine
        # process that died cannot block the trainer
        reader, writer = self._ctx.Pipe(duplex=False)
        self.commands = self._ctx.Queue()
        channels = (self.commands, ReplySender(writer), self.transfer)
        # not daemonic: it may start children (vLLM's multiprocess executor, tool pools); it exits with the trainer
        # by itself (`_exit_with_the_trainer`), and `close` ends it
        self.process = self._ctx.Process(
            target=serve, args=(self.spec, sampler, keep_rate, first_round, channels, resume), daemon=False
        )
        self.produces = sampler is not None
        try:
            self.process.start()
        finally:
            writer.close()  # the engine process holds the only write end: its death is an EOF here
        self.results = Replies(reader)
        # a trainer that ends without `close` (a notebook, a script driving the producer itself): multiprocessing's
        # own exit hook would join this non-daemonic process for ever, while it waits for its living trainer.
        # Registered after that hook, this one runs first.
        atexit.register(self._end_at_exit)
        message = self._wait("the engine to start")
        if not isinstance(message, Ready):
            raise EngineProcessError(f"unexpected {type(message).__name__} from the engine process while it started")
        self.pid, self.credit = message.pid, message.credit
        self.transfer.connect_trainer(self.process.is_alive)

    def push_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | None,
        completed_rounds: int,
        version: int,
        progress: tuple[int, int],
    ) -> None:
        """Send the policy (None: unchanged weights, a skipped step: the round count only) and tell the engine
        process; it loads them before its next round."""
        fault_point("trainer.push")
        if self.spec.max_staleness == 1:  # the previous push is loaded first: round r gets exactly r - 1's weights
            self._wait_loaded(self._pushes)
        try:
            self.transfer.send(weights, completed_rounds, version, self._pushes + 1)
        except Exception as error:  # a collective transfer fails when its peer is gone: say which and why
            self.process.join(1.0)  # a peer whose sockets closed may not be reaped yet
            if not self.process.is_alive():
                raise EngineProcessDied(
                    f"the engine process (pid {self.pid}) exited with code {self.process.exitcode} while the trainer "
                    f"sent it weights ({error}); see its log"
                ) from error
            raise
        self._pushes += 1
        self.commands.put(LoadWeights(self._pushes, progress))

    def _wait_loaded(self, sequence: int) -> None:
        """Until push `sequence` is loaded (rounds that come meanwhile wait to be taken)."""
        while self._loaded < sequence:
            message = self._wait(f"the engine to load push {sequence}", loads=True)
            if isinstance(message, RoundDone):
                self._ready[message.sampled.index] = message.sampled
            elif not isinstance(message, Loaded):
                raise EngineProcessError(
                    f"unexpected {type(message).__name__} from the engine process while it loaded push {sequence}"
                )

    def wait_rounds(self, first: int) -> list[SampledRound]:
        """Rounds `first` .. `first + k - 1`, in order, once generated: with `first` rounds trained, the rounds sampled
        by weights older than the trainer's (a checkpoint stores them; they stay to be taken). The engine process
        generates them without another push; a later round is sampled by the trainer's weights or newer, so a resumed
        run regenerates it as it was (waiting for it, after a validation push, would cost a round's generation)."""
        if not self.produces:
            return []
        last = first + self.spec.max_staleness - 1
        for index in range(first, last + 1):
            self._await_round(index, f"round {index} (to checkpoint it)")
        return [self._ready[index] for index in range(first, last + 1)]

    def _await_round(self, index: int, waiting_for: str) -> None:
        """Receive rounds until round `index` is among the ready ones; any other message is a protocol error."""
        while index not in self._ready:
            message = self._wait(waiting_for)
            if not isinstance(message, RoundDone):
                raise EngineProcessError(
                    f"unexpected {type(message).__name__} from the engine process while waiting for round {index}"
                )
            self._ready[message.sampled.index] = message.sampled

    def adopt(self, rounds: list[SampledRound]) -> None:
        """A checkpoint's in-flight rounds, taken as if this engine process had generated them."""
        self._ready.update({sampled.index: sampled for sampled in rounds})

    def take_round(self, index: int) -> tuple[SampledRound, float]:
        """Round `index` and the seconds the trainer waited for it."""
        fault_point("trainer.take")
        start = time.perf_counter()
        self._await_round(index, f"round {index}")
        sampled = self._ready.pop(index)
        check_round_bounds(sampled, self.spec.max_staleness, self.spec.max_token_age)
        return sampled, time.perf_counter() - start

    def predict(self, items: list, version: int) -> list:
        """Greedy predictions at the weights last pushed (served between rounds)."""
        self._predictions += 1
        tag = self._predictions
        self.commands.put(Predict(tag, list(items), version))
        while True:
            message = self._wait("predictions")
            if isinstance(message, Predictions) and message.tag == tag:
                return message.answers
            if not isinstance(message, RoundDone):
                raise EngineProcessError(
                    f"unexpected {type(message).__name__} from the engine process while waiting for predictions"
                )
            self._ready[message.sampled.index] = message.sampled

    def _wait(self, what: str, loads: bool = False) -> Reply:
        """The next message; raises if the process reported an error or died. A `Loaded` is recorded, and returned
        only with `loads`."""
        while True:
            message = self._reply(what)
            if isinstance(message, Loaded):
                self._loaded = max(self._loaded, message.sequence)
                if not loads:
                    continue
            return message

    def _reply(self, what: str) -> Reply:
        while True:
            try:
                message = self.results.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    with contextlib.suppress(queue.Empty):  # what it wrote whole before it died is still read
                        message = self.results.get(timeout=POLL_S)
                        if isinstance(message, Failed):
                            raise EngineProcessError(
                                f"the engine process failed while the trainer waited for {what}:\n{message.traceback}"
                            ) from None
                        return message
                    raise EngineProcessDied(
                        f"the engine process (pid {self.pid or self.process.pid}) exited with code "
                        f"{self.process.exitcode} while the trainer waited for {what}; the run stops (dspo-train "
                        "writes checkpoints/failure.ckpt after the first step; resume with ckpt_path=last). An exit "
                        "code of -9 is a SIGKILL, often the out-of-memory killer: lower "
                        "rollout.engine.kv_cache_space_gb or algorithm.max_prompts_per_call"
                    ) from None
                continue
            if isinstance(message, Failed):
                raise EngineProcessError(
                    f"the engine process failed while the trainer waited for {what}:\n{message.traceback}"
                )
            return message

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the engine process: it stops between two rounds; one still generating after `timeout_s` (a round
        nobody will train on) is killed."""
        if self.process is None:
            return
        with contextlib.suppress(Exception):
            self.commands.put(Stop())
        deadline = time.perf_counter() + timeout_s
        while self.process.is_alive() and time.perf_counter() < deadline:
            self._drain()  # unread rounds in the pipe would keep the engine process's exit waiting on them
            self.process.join(0.05)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)
        end_group(self.process.pid)
        log.info("engine process %s ended (exit code %s)", self.pid, self.process.exitcode)
        atexit.unregister(self._end_at_exit)
        self.process = None
        self._ready.clear()
        self.transfer.close()
        self.results.close()
        # the trainer exits later: its own queue feeder must not wait for a reader that is gone
        self.commands.cancel_join_thread()

    def _end_at_exit(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(2.0)
        if self.process is not None:
            end_group(self.process.pid)

    def _drain(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                self.results.get_nowait()
