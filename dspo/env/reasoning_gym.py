"""reasoning-gym tasks as QA items, and each task's own scorer as the reward (`data=reasoning_gym env=reasoning_gym`).

reasoning-gym (the `envs` extra) generates its questions procedurally from a seed: nothing is downloaded, and the same
(task, config, seed, size) gives the same items on every machine. verifiers and TRL wrap it as a dataset whose rows
carry the whole generated entry; here an item carries only where it came from (`item.metadata["reasoning_gym"]`: task,
config, seed, size, index), and the reward regenerates the entry from that and calls the task's own
`score_answer(answer, entry)`. So nothing reasoning-gym returns (its metadata holds grids, sets and other objects) has
to survive JSON or a process boundary, and the score is the task's own, not subEM against the answer string: many
tasks accept more than one form (`-4.0`, a permutation, a list in any order) or give partial credit.

The answer scored is the one the agent extracts from the model's last `<answer>…</answer>`, as for every reward, so
the instruction asks for it there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from dspo.env.rewards import EpisodeRecord, RewardResult, check_credit, extract_answer
from dspo.types import QAItem

METADATA_KEY = "reasoning_gym"

INSTRUCTION = (
    "Solve the task below. Think step by step inside <think> </think>, then give only the final answer inside "
    "<answer> </answer>, in the form the task asks for.\n\nTask: {question}"
)


def task_configs(tasks: Sequence[str] | Mapping[str, Mapping | None]) -> dict[str, dict]:
    """`data.tasks` as {task: its reasoning-gym config}: a list of names (defaults), or a map of name -> settings."""
    import reasoning_gym

    if isinstance(tasks, str):
        raise TypeError(f"data.tasks={tasks!r}: give a list, e.g. data.tasks=[basic_arithmetic,chain_sum]")
    configs = (
        {name: dict(config or {}) for name, config in tasks.items()}
        if isinstance(tasks, Mapping)
        else {str(name): {} for name in tasks}
    )
    if not configs:
        raise ValueError("data.tasks is empty: name at least one reasoning-gym task, e.g. data.tasks=[chain_sum]")
    known = set(reasoning_gym.factory.DATASETS)
    unknown = sorted(set(configs) - known)
    if unknown:
        raise ValueError(f"data.tasks: {unknown} are not reasoning-gym tasks; some that are: {sorted(known)[:12]}")
    return configs


@lru_cache(maxsize=64)
def _dataset(task: str, config_json: str, seed: int, size: int) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(config_json))


def dataset(task: str, config: Mapping, seed: int, size: int) -> Any:
    """The task's `ProceduralDataset` (cached: the reward regenerates entries of the same few datasets every round)."""
    return _dataset(task, json.dumps(dict(config), sort_keys=True), int(seed), int(size))


def generate_items(tasks: Mapping[str, Mapping], seed: int, size: int, split: str) -> list[QAItem]:
    """`size` items of each task generated from `seed`; the benchmark of an item is its task."""
    if size < 1:
        raise ValueError(f"data.size (and val_size/test_size) must be >= 1, got {size} for the {split} split")
    items = []
    for task, config in tasks.items():
        data = dataset(task, config, seed, size)
        for index in range(size):
            entry = data[index]
            source = {"task": task, "config": dict(config), "seed": seed, "size": size, "index": index}
            items.append(
                QAItem(
                    id=f"{task}-{split}-{seed}-{index}",
                    question=entry["question"],
                    golden_answers=[str(entry["answer"])],
                    benchmark=task,
                    metadata={METADATA_KEY: source},
                )
            )
    return items


def entry_of(item: QAItem) -> tuple[Any, dict]:
    """(the task's dataset, the generated entry) an item came from; fails naming `data=reasoning_gym` for another."""
    source = item.metadata.get(METADATA_KEY)
    if not isinstance(source, Mapping):
        raise ValueError(
            f"env.reward (reasoning_gym) scores reasoning-gym items only; question {item.id!r} has no "
            f"metadata.{METADATA_KEY}: train on data=reasoning_gym, or pick another env"
        )
    data = dataset(source["task"], source.get("config", {}), source["seed"], source["size"])
    entry = data[int(source["index"])]
    if entry["question"] != item.question:
        raise ValueError(
            f"question {item.id!r} is not what reasoning-gym {source['task']} generates at index {source['index']} "
            f"with seed {source['seed']} (a different reasoning-gym version?): regenerate the items"
        )
    return data, entry


class ReasoningGymReward:
    """The task's own `score_answer` on the extracted answer: the outcome, and the component `reasoning_gym`.

    Args:
        credit: "trajectory" (the only meaningful one: there are no step rewards).
    """

    name = METADATA_KEY

    def __init__(self, credit: str = "trajectory") -> None:
        self.credit = check_credit(credit)

    def extract_answer(self, text: str) -> str | None:
        return extract_answer(text)

    def score_one(self, item: QAItem, answer: str | None) -> float:
        data, entry = entry_of(item)
        return float(data.score_answer(answer, entry))

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        results = []
        for episode in episodes:
            outcome = self.score_one(episode.item, episode.answer)
            results.append(RewardResult(outcome, components={self.name: outcome}))
        return results
