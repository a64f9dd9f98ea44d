"""Demonstrations rendered by the real agent loop, for the toy warm start (`dspo.toy.warmstart`).

A scripted policy (`dspo.toy.demos.make_script`) plays the model's turns through `ToolCallingAgent` with a
`ScriptedEngine` and the toy world's BM25 index (or its sources), so each demonstration is token for token what an RL
rollout of the same episode would be: the same chat template, tool-turn wrappers, observation format and loss mask.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

from dspo.agent import AgentConfig, build_agent
from dspo.engines.scripted import ScriptedEngine
from dspo.search.bm25 import BM25Index, build_or_load_index
from dspo.toy.demos import IMPERFECT_KINDS, make_script
from dspo.toy.world import ToyWorldFiles
from dspo.types import QAItem, Trajectory

# Tool responses as the agent inserts them: Qwen chat-template turns, or Search-R1 <information> blocks (the
# Search-R1 instruction itself mentions the tags, so the block must be the inserted one, between blank lines).
_OBSERVATION = re.compile(
    r"<tool_response>\n(.*?)\n</tool_response>|\n\n<information>(.*?)</information>\n\n", re.DOTALL
)


def observations_in(prompt_text: str) -> list[str]:
    """Tool responses so far in a decoded multi-turn prompt (as the chat template wraps them)."""
    return [qwen or searchr1 for qwen, searchr1 in _OBSERVATION.findall(prompt_text)]


def render_demonstrations(
    items: list[QAItem],
    world_meta: dict[str, dict],
    tokenizer,
    retriever,
    imperfect_share: float,
    seed: int = 0,
    agent_overrides: dict | None = None,
    early_stop_share: float = 0.0,
    imperfect_kinds: Sequence[str] = IMPERFECT_KINDS,
    hop2_imperfect_share: float | None = None,
    sources: dict | None = None,
    right_tool_share: float = 1.0,
    goal_reflect: bool = False,
) -> list[Trajectory]:
    """One scripted trajectory per item, rendered by `ToolCallingAgent` with a `ScriptedEngine` (exact ids and masks).
    `retriever`: a Retriever (the default search environment) or a `dspo.env.Environment` (e.g. two sources').
    `goal_reflect`: the turns state goals and reflections (`dspo.toy.goal_demos`; render in `demo_environment`'s)."""
    rng = random.Random(seed)
    tag_format = (agent_overrides or {}).get("tag_format", "qwen")
    scripts = [
        make_script(
            item,
            world_meta,
            rng,
            imperfect_share,
            tag_format,
            early_stop_share,
            imperfect_kinds,
            hop2_imperfect_share,
            sources,
            right_tool_share,
        )  # fmt: skip
        for item in items
    ]
    if goal_reflect:
        from dspo.toy.goal_demos import GoalReflectScript

        searches = int((agent_overrides or {}).get("max_turns", AgentConfig().max_turns)) - 1
        scripts = [GoalReflectScript(policy, max_searches=searches) for policy in scripts]

    def script(prompt_text: str, turn: int, index: int) -> str:
        return scripts[index](observations_in(prompt_text))

    engine = ScriptedEngine(tokenizer, script)
    groups = demo_agent(engine, tokenizer, retriever, agent_overrides).rollout(items, group_size=1, policy_version=0)
    return [group.trajectories[0] for group in groups.groups]


SEARCH_LIMITS = ("topk", "max_queries_per_call", "max_query_chars")


def demo_agent(engine, tokenizer, retriever, settings: dict | None):
    """The tool-calling agent of `WarmStartConfig.agent`'s settings: the episode's limits go to the agent, the search
    limits and the answer guard to the default environment over `retriever` (an `Environment` is taken as it is)."""
    from dspo.env import Environment

    limits = dict(settings or {})
    search = {key: limits.pop(key) for key in (*SEARCH_LIMITS, "max_answer_words") if key in limits}
    env = retriever if isinstance(retriever, Environment) else Environment.search(retriever, **search)
    return build_agent(AgentConfig(**limits), engine=engine, tokenizer=tokenizer, env=env)


def demo_environment(
    index: BM25Index,
    world_meta: dict[str, dict],
    sources: dict | None = None,
    agent: dict | None = None,
    goal_reflect: bool = False,
    noise: float = 0.0,
):
    """What the demonstrations search: `index` (the default search tool), or with `sources`
    (`WarmStartConfig.sources`) the sources (dspo.toy.sources) over the same passages, with the search limits of
    `agent` (`WarmStartConfig.agent`), or with `goal_reflect` env=goal_reflect's tool and reward at `noise`."""
    if goal_reflect:
        from dspo.toy.goal_demos import goal_reflect_environment

        return goal_reflect_environment(index, agent, noise)
    if not sources:
        return index
    from dspo.toy.sources import source_environment

    agent = agent or {}
    limits = {key: agent[key] for key in SEARCH_LIMITS if key in agent}
    return source_environment(
        index.passages,
        world_meta,
        max_answer_words=agent.get("max_answer_words"),
        sources=sources,
        **limits,
    )


def toy_retriever(world: ToyWorldFiles) -> BM25Index:
    """The BM25 index over the toy corpus, cached beside it (`<world>/bm25`), built with the project's BM25 code."""
    return build_or_load_index(world.corpus, Path(world.root) / "bm25", show_progress=False)
