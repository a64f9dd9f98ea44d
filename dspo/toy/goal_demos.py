"""Demonstrations of goal and reflection (`env=goal_reflect`, `dspo.env.goal_reflect`) for the toy warm start.

`GoalReflectScript` wraps a scripted policy (`dspo.toy.demos.ScriptedPolicy`, any kind) and adds the format to its
turns: before each search, `<goal> the <relation> of <entity> </goal>` naming the page the hop needs (so the reward's
rule finds its target); after each search, `<reflect> yes|no ... </reflect>` saying whether the results hold that page
(a `(Title: <entity>)` header in the observation, the reward's test); the policy's own text follows. A correct
demonstration whose results lack the page searches again for the same hop (once per hop, while `max_searches` allows),
which is the behaviour the perturbation study looks for; otherwise the wrapped policy goes on as it would have (it
guesses, never answering from memory). The retried observation is hidden from the wrapped policy, so its hop-by-hop
reading stays aligned.

The wrapper remembers its turns (the renderer asks once per turn, with every observation so far), so the wrapped
policy is asked once per turn too and draws from its random stream exactly as it would alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dspo.toy.demos import CORRECT, RELATION_PHRASE, ScriptedPolicy, tool_call_text

_SEARCHR1_CALL = re.compile(r"<(search\w*)>\s*(.*?)\s*</\1>\s*$", re.DOTALL)
_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>\s*$", re.DOTALL)


@dataclass
class _Call:
    query: str
    target: str  # the entity whose page the goal names
    hop: int


@dataclass
class GoalReflectScript:
    """Args:
    policy: the scripted policy whose turns get the goal/reflection format.
    max_searches: the searches an episode may make (the agent's max_turns - 1): a retry is made only within it.
    """

    policy: ScriptedPolicy
    max_searches: int | None = None
    turns: list[str] = field(default_factory=list)  # what it said, per turn
    calls: list[_Call] = field(default_factory=list)  # its valid calls, in order
    seen: list[str] = field(default_factory=list)  # the observations the wrapped policy is shown
    retried: set[int] = field(default_factory=set)  # hops searched again

    @property
    def kind(self) -> str:
        return self.policy.kind

    def __call__(self, observations: Sequence[str]) -> str:
        turn = len(observations)
        if turn < len(self.turns):  # asked again for a turn it played: the same text
            return self.turns[turn]
        reflection = ""
        if turn and call_query(self.turns[-1], self.policy.tag_format) is not None:  # results of a valid call
            last = self.calls[-1]
            held = f"(Title: {last.target})" in observations[-1]
            reflection = reflect_text(held, last.target)
            if not held and self._may_retry(last.hop):
                self.retried.add(last.hop)
                return self._say(reflection + self._with_goal(self._call_text(last.query, last.hop), last.query))
        if turn:  # shown to the wrapped policy (also the answer to a malformed call: nothing to reflect on)
            self.seen.append(observations[-1])
        text = self.policy(list(self.seen))
        query = call_query(text, self.policy.tag_format)
        return self._say(reflection + (self._with_goal(text, query) if query is not None else text))

    def _may_retry(self, hop: int) -> bool:
        """A correct demonstration searches a hop again once, when the retry and the hops after it fit the budget."""
        if self.policy.kind != CORRECT or hop in self.retried or self.max_searches is None:
            return False
        later_hops = len(self.policy.item.metadata["relations"]) - hop - 1
        return len(self.calls) + 1 + later_hops <= self.max_searches

    def _call_text(self, query: str, hop: int) -> str:
        think = f"The results do not have the page of {query}. I search for it again."
        return tool_call_text(query, think, self.policy.tag_format, self.policy.hop_tools[hop])

    def _with_goal(self, text: str, query: str) -> str:
        chain = list(self.policy.item.metadata["chain"])
        relations = list(self.policy.item.metadata["relations"])
        hop = chain.index(query) if query in chain else min(len(self.calls), len(chain) - 1)
        self.calls.append(_Call(query, query, hop))
        goal = f"<goal> the {RELATION_PHRASE[relations[hop]]} of {query} </goal>\n"
        start = _call_start(text, self.policy.tag_format)
        return text[:start] + goal + text[start:]

    def _say(self, text: str) -> str:
        self.turns.append(text)
        return text


def reflect_text(held: bool, target: str) -> str:
    """The reflection on a search for `target`'s page: yes when the results hold it."""
    if held:
        return f"<reflect> yes, the results have the page of {target}. </reflect>\n"
    return f"<reflect> no, the results do not have the page of {target}. </reflect>\n"


def call_query(text: str, tag_format: str) -> str | None:
    """The one query of a turn that ends with a well-formed search call (the scripted calls' shape), else None."""
    if tag_format == "searchr1":
        found = _SEARCHR1_CALL.search(text)
        if found is None or f"<{found.group(1)}>" not in text:
            return None
        return found.group(2)
    found = _QWEN_CALL.search(text)
    if found is None:
        return None
    try:
        queries = json.loads(found.group(1))["arguments"]["query_list"]
    except (ValueError, KeyError, TypeError):
        return None
    return str(queries[0]) if queries else None


def _call_start(text: str, tag_format: str) -> int:
    if tag_format == "searchr1":
        return _SEARCHR1_CALL.search(text).start()
    return _QWEN_CALL.search(text).start()


def goal_reflect_environment(index, agent: dict | None = None, noise: float = 0.0, seed: int = 0):
    """What goal/reflection demonstrations are rendered in: env=goal_reflect's tool (the scripted simulator over the
    toy `index`, constant `noise`) and reward, and its instruction for the demonstrations' tag format (`agent`:
    `WarmStartConfig.agent`, whose search limits apply)."""
    from dspo.env import Environment
    from dspo.env.goal_reflect import QWEN_INSTRUCTION, SEARCHR1_INSTRUCTION, GoalReflectReward
    from dspo.env.simulated import ScriptedSimulator, SimulatedSearchTool

    agent = agent or {}
    limits = {key: agent[key] for key in ("topk", "max_queries_per_call", "max_query_chars") if key in agent}
    tool = SimulatedSearchTool(ScriptedSimulator(index), noise=noise, seed=seed, **limits)
    instruction = SEARCHR1_INSTRUCTION if agent.get("tag_format", "qwen") == "searchr1" else QWEN_INSTRUCTION
    reward = GoalReflectReward(max_answer_words=agent.get("max_answer_words"))
    return Environment({"search": tool}, reward, instruction=instruction)
