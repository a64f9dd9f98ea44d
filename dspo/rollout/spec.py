"""What an engine side is built from (`WorkerSpec`: in this process, or in the engine process) and the rules both
ends of the engine process keep (how often a waiting side polls, each round's seed). Below both: the trainer's handle
(`dspo.rollout.engine_process`) and the engine process's loop (`dspo.rollout.engine_process_main`) import it, and
neither imports the other's module back; what they send each other is `dspo.rollout.messages`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

POLL_S = 0.5  # how often a waiting side checks that the other is still alive


@dataclass
class WorkerSpec:
    """Everything an engine side is built from: in this process at max_staleness 0, else in the engine process
    (pickled once, at spawn)."""

    engine: Callable[..., Any]  # partial constructor taking model_path (conf/rollout/*.yaml `engine`)
    agent: Any  # rollout.agent: the agent's constructor (dspo.agent.build_agent completes it: engine, tokenizer, env)
    env: Any  # dspo.env.Environment, its EnvironmentSpec (built where the agent runs), or a bare retriever
    algorithm: Any  # AlgorithmConfig
    model: Any  # ModelConfig
    seed: int
    max_staleness: int
    rank: int = 0
    world_size: int = 1
    threads: int = 1  # torch threads of the engine process
    cores: list[int] | None = None  # CPU affinity of the engine process (None: inherit)
    eval_batch_size: int = 64
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES of the engine process (None: the rank's own)
    tokenizer: Any = None  # the trainer's tokenizer, for the agent (None: the engine process loads `model`'s)
    weight_transfer: str = "shared_memory"  # rollout.weight_transfer (dspo.rollout.transfer)
    imports: tuple[str, ...] = ()  # the run's `imports=`: user modules imported in the engine process before building
    # rollout.partial_rollouts: the most rounds a carried group's oldest tokens may be behind the round that trains
    # them (rollout.max_token_age; None: partial rollouts off, every round runs its groups to the end)
    max_token_age: int | None = None
    # checkpointing.in_flight: checkpoints of a k >= 1 run store the rounds generated but not trained, and the engine
    # process reports what they need with every round (dspo.rollout.in_flight)
    in_flight: bool = True


def round_seed(seed: int, round_index: int) -> int:
    """The sampling seed of round `round_index` of a run seeded `seed`, whichever process generates it."""
    return seed * 1_000_003 + round_index * 1_009
