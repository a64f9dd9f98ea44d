"""`RolloutSettings`: the rollout's config (`callbacks.rollout` in conf/callbacks/default.yaml), checked once, when
the run is built (before any model is loaded), into one record that `dspo.callbacks.rollout_callback.RolloutCallback`
is built from; `spec` gives what the engine side is built from (`WorkerSpec`).

Every refusal names the config key it is about and what to set instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dspo.agent import agent_setting, check_agent_settings
from dspo.algorithms.config import AlgorithmConfig
from dspo.algorithms.rollout_correction import staleness_notice
from dspo.models import ModelConfig
from dspo.rollout.spec import WorkerSpec
from dspo.rollout.transfer import check_transfer

log = logging.getLogger(__name__)


def check_staleness(max_staleness: Any, engine_threads: Any, engine: Any) -> int:
    """`rollout.max_staleness`, `rollout.engine_threads` and the engine's `sleep_during_update` checked: the bound."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(
            f"rollout.max_staleness={max_staleness!r}: use 0 (synchronous) or a whole number of rounds >= 1"
        )
    if engine_threads is not None and (not isinstance(engine_threads, int) or engine_threads < 1):
        raise ValueError(f"rollout.engine_threads={engine_threads!r}: use a number of threads >= 1, or null for half")
    keywords = getattr(engine, "keywords", None) or (engine if isinstance(engine, dict) else {})
    if max_staleness and keywords.get("sleep_during_update"):
        raise ValueError(
            "rollout.engine.sleep_during_update=true with rollout.max_staleness>=1: the engine generates while the "
            "trainer updates, so it cannot sleep then. Set one of them back (docs/scaling.md)"
        )
    return max_staleness


def check_partial(partial_rollouts: Any, max_token_age: Any, max_staleness: int) -> int | None:
    """`rollout.partial_rollouts` and `rollout.max_token_age` checked: the age bound partial rollouts run under
    (default max_staleness + 1: an episode may finish one round later), None when they are off."""
    if not isinstance(partial_rollouts, bool):
        raise ValueError(f"rollout.partial_rollouts={partial_rollouts!r}: use true or false")
    if not partial_rollouts:
        if max_token_age is not None:
            raise ValueError("rollout.max_token_age is set but rollout.partial_rollouts=false: set both or neither")
        return None
    if max_staleness < 1:
        raise ValueError(
            "rollout.partial_rollouts=true needs rollout.max_staleness >= 1: at 0 every round is sampled by the newest "
            "weights, so an episode cannot be carried into the next round (docs/async.md#partial-rollouts)"
        )
    age = max_staleness + 1 if max_token_age is None else max_token_age
    if isinstance(age, bool) or not isinstance(age, int) or age <= max_staleness:
        raise ValueError(
            f"rollout.max_token_age={max_token_age!r}: a whole number of rounds above rollout.max_staleness="
            f"{max_staleness} (a round's newest tokens are already up to max_staleness rounds old), or null for "
            f"{max_staleness + 1}"
        )
    return age


def check_sampling_temperature(agent: Any, algorithm: AlgorithmConfig) -> None:
    """The agent samples at the temperature the trainer scores (`algorithm.temperature`)."""
    sampling = agent_setting(agent, "temperature")
    if sampling is not None and float(sampling) != float(algorithm.temperature):
        raise ValueError(
            f"rollout.agent.temperature={sampling} differs from algorithm.temperature={algorithm.temperature}: "
            "the trainer would score a distribution that was not sampled. Set only algorithm.temperature "
            "(conf/rollout/*.yaml interpolate it)"
        )


@dataclass(frozen=True)
class RolloutSettings:
    """The checked rollout config. Fields are the config keys of `callbacks.rollout`; after the checks they hold the
    values the run uses (`max_token_age` resolved, `env` built at max_staleness 0, `imports` a tuple).

    engine: partial constructor of a RolloutEngine taking `model_path` (conf/rollout/*.yaml `engine`).
    agent: the agent's constructor (`rollout.agent`: `dspo.agent.tool_calling.ToolCallingAgent` and its limits by
        default), completed by `dspo.agent.build_agent` where the agent runs.
    env: the `dspo.env.Environment` (conf/env/: tools + reward), or its `dspo.env.spec.EnvironmentSpec` (built here at
        max_staleness 0, in the engine process at k >= 1); a bare `Retriever` stands for the default one.
    algorithm, model: the same objects the module gets.
    seed: the run's seed (each round's sampling seed derives from it: `dspo.rollout.spec.round_seed`).
    eval_batch_size: questions per engine call in validation/test.
    sample_every_n_rounds: write one kept group's trajectories as TensorBoard text every N rounds (0 = never).
    export_dir: where the final policy is saved (default `<trainer.default_root_dir>/model`).
    max_staleness: rounds generated ahead of training (`rollout.max_staleness`): 0 = synchronous, the engine in this
        process; k >= 1 = the engine in its own process, up to k rounds ahead (`dspo.rollout.engine_process`).
    engine_threads: with k >= 1, CPU threads (and cores) of the engine process (`rollout.engine_threads`; None: half).
    engine_cores: with k >= 1, `split` (engine and trainer pinned to their own cores) or `shared` (both on every core,
        the trainer keeping its threads) (`rollout.engine_cores`).
    engine_devices: with k >= 1 on GPUs, one entry per local rank: the GPU(s) its engine process uses instead of the
        rank's own (`rollout.engine_devices`; docs/scaling.md).
    weight_transfer: with k >= 1, how the weights reach the engine process: `shared_memory`, `gloo` or `nccl`
        (`rollout.weight_transfer`; `dspo.rollout.transfer`).
    imports: the run's `imports=` (user plug-in modules), imported in the engine process as well (k >= 1).
    partial_rollouts: with k >= 1, stop a round's generation once enough groups finished and carry the unfinished
        ones into the next round, on newer weights (`rollout.partial_rollouts`; `dspo.agent.partial`).
    max_token_age: with partial rollouts, the most rounds a trained token may be behind its round
        (`rollout.max_token_age`; None: max_staleness + 1).
    in_flight: with k >= 1, checkpoints store the rounds generated but not trained and the engine process's state
        after them, and a resume trains them first (`checkpointing.in_flight`; `dspo.rollout.in_flight`).
    """

    engine: Any
    agent: Any
    env: Any
    algorithm: AlgorithmConfig
    model: ModelConfig
    seed: int = 0
    eval_batch_size: int = 64
    sample_every_n_rounds: int = 5
    export_dir: str | None = None
    max_staleness: int = 0
    engine_threads: int | None = None
    engine_cores: str = "split"
    engine_devices: list | None = None
    weight_transfer: str = "shared_memory"
    imports: list | tuple | None = None
    partial_rollouts: bool = False
    max_token_age: int | None = None
    in_flight: bool = True

    def __post_init__(self) -> None:
        from dspo.env import Environment, check_credit_fits
        from dspo.env.spec import built

        check_agent_settings(self.agent)  # a moved key fails here, at build time, not where the agent is first built
        check_sampling_temperature(self.agent, self.algorithm)
        max_staleness = check_staleness(self.max_staleness, self.engine_threads, self.engine)
        max_token_age = check_partial(self.partial_rollouts, self.max_token_age, max_staleness)
        if max_token_age is not None and agent_setting(self.agent, "overflow", "end") != "end":
            raise ValueError(
                "rollout.partial_rollouts=true with rollout.agent.overflow=compact: a carried episode's compacted "
                "contexts are not tracked per policy version yet; use one of them"
            )
        # the agent runs here: built now, as Hydra did before (k >= 1: in the engine process)
        env = self.env if max_staleness else built(self.env)
        if isinstance(env, Environment):
            check_credit_fits(env, self.algorithm.objective)  # at build time, before any model is loaded
        if notice := staleness_notice(self.algorithm.rollout_correction.mode, max_staleness):
            log.log(*notice)
        if self.engine_cores not in ("split", "shared"):
            raise ValueError(f"rollout.engine_cores={self.engine_cores!r}: use split (own cores each) or shared")
        if not isinstance(self.in_flight, bool):
            raise ValueError(f"checkpointing.in_flight={self.in_flight!r}: use true or false")
        weight_transfer = check_transfer(self.weight_transfer)
        if not max_staleness and self.weight_transfer != "shared_memory":
            log.warning("rollout.weight_transfer=%s does nothing at rollout.max_staleness=0", self.weight_transfer)
        checked = {
            "max_staleness": max_staleness,
            "max_token_age": max_token_age,
            "env": env,
            "weight_transfer": weight_transfer,
            "imports": tuple(self.imports or ()),
            "engine_devices": list(self.engine_devices) if self.engine_devices is not None else None,
        }
        for name, value in checked.items():  # frozen: the checked values replace the given ones once, here
            object.__setattr__(self, name, value)

    def spec(self) -> WorkerSpec:
        """What the engine side is built from (rank, world size and devices are filled in at the producer's setup)."""
        return WorkerSpec(
            engine=self.engine,
            agent=self.agent,
            env=self.env,
            algorithm=self.algorithm,
            model=self.model,
            seed=self.seed,
            max_staleness=self.max_staleness,
            eval_batch_size=self.eval_batch_size,
            weight_transfer=self.weight_transfer,
            imports=self.imports,
            max_token_age=self.max_token_age,
            in_flight=self.in_flight,
        )
