"""`build_environment`: the `env` config built, with the reward layers of `env/reward=judge|rubric` put on top.

A layer changes the reward of whichever environment the run selected, so it cannot be a config of its own reward: Hydra
merges a group option into `env.reward`, it cannot move the env's own reward under a new key. So each layer adds one
node beside the env's reward's own arguments (`env.reward.judge`, `env.reward.rubric`), a partial constructor call of
the layer (`_target_` + `_partial_: true` + its settings). Here the node is taken off, the environment is built with its
own reward, and the layer is called with that reward as `base`:

    env/reward=judge          the judge's verdict replaces the reward's outcome (dspo.env.judge.JudgedReward)
    env/reward=rubric         a weighted sum of named criteria is the reward (dspo.env.rubric.RubricReward)
    env/reward=[judge,rubric] both: the judge first, so that the rubric can weigh its verdict

Every command that builds an environment (training, `dspo-eval`, `dspo-rollout`, the engine process at k >= 1, the toy's
rebuild) goes through here, so a layer applies wherever the env's reward does.
"""

from __future__ import annotations

import copy
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

LAYERS = ("judge", "rubric")  # applied in this order: the rubric may weigh the judge's verdict


def _reward(config: Any) -> Any:
    reward = config.get("reward") if isinstance(config, DictConfig | dict) else None
    return reward if isinstance(reward, DictConfig | dict) else {}


def reward_layers(config: Any) -> list[str]:
    """The layers `config` (an `env` node) puts on its reward, in the order they apply."""
    return [name for name in LAYERS if _reward(config).get(name) is not None]


def build_environment(config: Any, **kwargs: Any) -> Any:
    """The environment of an `env` node (Hydra instantiates it; `kwargs` as `instantiate`'s), each reward layer called
    on the reward below it."""
    from hydra.utils import instantiate

    if not any(name in _reward(config) for name in LAYERS):  # a `judge: null` key is taken off too
        return instantiate(config, **kwargs)
    layers = reward_layers(config)
    config = copy.deepcopy(config) if isinstance(config, DictConfig) else OmegaConf.create(config)
    with open_dict(config):  # the copy keeps its parent, so ${retriever} and friends still resolve
        nodes = {name: config.reward.pop(name) for name in LAYERS if name in config.reward}
    env = instantiate(config, **kwargs)
    for name in layers:
        node = nodes[name]
        if not isinstance(node, DictConfig) or "_target_" not in node or node.get("_partial_") is not True:
            raise TypeError(
                f"env.reward.{name}: expected a partial constructor call (_target_ + _partial_: true) that takes the "
                f"reward below it as `base`, got {node!r}; see conf/env/reward/{name}.yaml"
            )
        env.reward = instantiate(node)(base=env.reward)
    return env
