"""`EnvironmentSpec`: the `env` config, built where the agent runs (issue 38, point 9).

At `rollout.max_staleness` 0 the agent runs in the trainer, which builds the environment at once (as Hydra did before).
At k >= 1 it runs in the engine process, which builds the environment itself from this config: an environment can
hold an in-memory BM25 index of many GB, which used to be pickled into the engine process and so held twice.
conf/callbacks/default.yaml passes `env` this way (`_recursive_: false`), resolved when the spec is made.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


class EnvironmentSpec:
    """Args:
    config: the `env` node (a `_target_` + its arguments, nested `_target_`s included), resolved here.
    """

    def __init__(self, config: Any) -> None:
        if isinstance(config, DictConfig):
            config = OmegaConf.to_container(config, resolve=True)
        if not isinstance(config, dict) or "_target_" not in config:
            raise TypeError(f"env: expected a config with a _target_ (conf/env/*.yaml), got {config!r}")
        self.config = OmegaConf.create(config)

    def build(self) -> Any:
        """The environment (Hydra instantiates the config: tools, reward, retriever)."""
        from dspo.env.build import build_environment

        return build_environment(self.config)

    @property
    def credit(self) -> str:
        """The reward's credit as configured (`env.reward.credit`; the built reward's own value is authoritative)."""
        return str(OmegaConf.select(self.config, "reward.credit", default="trajectory"))

    def __repr__(self) -> str:
        return f"EnvironmentSpec({self.config.get('_target_')})"


def built(env: Any) -> Any:
    """`env` itself, or the environment its spec describes."""
    return env.build() if isinstance(env, EnvironmentSpec) else env
