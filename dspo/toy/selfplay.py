"""Scripted proposer demonstrations for search self-play (experiment=toy_selfplay's warm start).

The shipped warm start only ever answered questions, so from it a proposer episode (`dspo.env.proposals`: search a
topic, then write `<question> ... </question> <answer> ... </answer>`) would almost never be well-formed and the
proposer's reward would have nothing to rank. As the solver learned its format from scripted demonstrations, the
proposer learns its own from these: for a demo-split question (its chain and relations), the topic is the question's
first entity, the turns are the solver's correct search turns for that question (one search per hop, each quoting
what it read), and the final turn writes the question the world asks of that chain, then the answer it read. So a
1-hop demonstration proposes a 1-hop question and a 2-hop one a 2-hop question, in the world's own question shares.
Demonstrations use only demo-split entities (RL's topics are train-split pages: `dspo.toy.world.train_seeds`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dspo.env.environment import Environment
from dspo.env.proposals import proposer_environment as env_of_proposer
from dspo.env.search_tool import SearchTool
from dspo.toy.demos import ScriptedPolicy, make_script
from dspo.toy.render import SEARCH_LIMITS, demo_agent, observations_in
from dspo.types import QAItem, Trajectory

PROPOSED = "proposed_question"  # metadata key of a proposer item: the question its demonstration writes


def proposer_items(items: Sequence[QAItem]) -> list[QAItem]:
    """Each toy question as a proposer's item: the topic (its first entity) as the prompt, the question it asks kept in
    the metadata for the script."""
    return [
        replace(
            item,
            id=f"{item.id}/proposer",
            question=item.metadata["chain"][0],
            metadata={**item.metadata, PROPOSED: item.question},
        )
        for item in items
    ]


@dataclass
class ProposerScript:
    """The solver's correct turns for the item's chain, with the final answer turn turned into a proposal."""

    policy: ScriptedPolicy
    question: str

    def __call__(self, observations: Sequence[str]) -> str:
        text = self.policy(observations)
        head, marker, tail = text.rpartition("<answer>")
        if not marker:  # a search turn
            return text
        return f"{head}<question> {self.question} </question>\n<answer>{tail}"


def proposer_environment(index, agent: dict | None = None) -> Environment:
    """The proposer's environment as experiment=toy_selfplay builds it: the search tool with the run's limits, the
    proposal reward, the proposer instruction in the agent's tag format."""
    settings = agent or {}
    limits = {key: settings[key] for key in SEARCH_LIMITS if key in settings}
    return env_of_proposer({"search": SearchTool(index, **limits)}, settings.get("tag_format", "qwen"))


def render_proposer_demonstrations(
    items: Sequence[QAItem], world_meta: dict[str, dict], tokenizer, index, seed: int, agent: dict | None = None
) -> list[Trajectory]:
    """One proposer demonstration per toy question (the module), rendered by the real agent loop."""
    from dspo.engines.scripted import ScriptedEngine

    rng = random.Random(seed)
    tag_format = (agent or {}).get("tag_format", "qwen")
    proposals = proposer_items(items)
    scripts = [
        ProposerScript(make_script(item, world_meta, rng, 0.0, tag_format), item.metadata[PROPOSED])
        for item in proposals
    ]

    def script(prompt_text: str, turn: int, index_: int) -> str:
        return scripts[index_](observations_in(prompt_text))

    engine = ScriptedEngine(tokenizer, script)
    env = proposer_environment(index, agent)
    groups = demo_agent(engine, tokenizer, env, agent).rollout(proposals, group_size=1, policy_version=0).groups
    return [group.trajectories[0] for group in groups]
