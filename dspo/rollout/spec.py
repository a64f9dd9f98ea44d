"""What the engine process is built from (`WorkerSpec`), what it sends back for a round (`SampledRound`), and the
rules both sides keep (how often a waiting side polls, each round's seed). Below both sides: the trainer's handle
(`dspo.rollout.worker`) and the engine process's loop (`dspo.rollout.serve`) import it, and neither imports the
other's module back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dspo.types import RolloutGroup

POLL_S = 0.5  # how often a waiting side checks that the other is still alive


@dataclass
class WorkerSpec:
    """Everything the engine process builds its side from (pickled once, at spawn)."""

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


@dataclass
class SampledRound:
    """One round as the engine process produced it. Groups are this rank's share, unbuilt (the trainer pads them)."""

    index: int  # round r
    groups: list[RolloutGroup]  # [B / world] kept groups
    stats: dict[str, float]  # RoundSampler.sample_round's statistics
    weights_round: int  # completed rounds of the weights that sampled it (every trajectory's newest tokens)
    end_state: dict[str, Any] = field(default_factory=dict)  # sampler + keep-rate prior after it: round r+1's start
    idle_s: float = 0.0  # time the engine process waited for weights before starting it
    generation: tuple[float, float] = (0.0, 0.0)  # time.time() when its generation started and ended


def round_seed(seed: int, round_index: int) -> int:
    """The sampling seed of round `round_index` of a run seeded `seed`, whichever process generates it."""
    return seed * 1_000_003 + round_index * 1_009
