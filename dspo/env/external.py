"""What the adapters of other standards' environments share (`env=openenv`, `env=verifiers`): the environment scores
its own episodes, and dspo takes that score as the outcome.

Each adapter is an `env.agent` (docs/agents.md): an async function that runs one episode of the foreign environment,
talking to the policy through dspo's OpenAI-compatible endpoint, so every call is recorded by token ids exactly as for
any endpoint agent. The foreign environment computes the reward (OpenEnv's step reward, a verifiers rubric), which
dspo's own rewards cannot recompute from an answer string. So the agent returns a `ScoredAnswer`: a `str` (the
endpoint's contract is unchanged: `ep.answer` is still the answer evaluation scores by subEM) that also carries the
environment's reward and its named parts, and `ExternalReward` reads them instead of scoring the answer again.

`ProxyTool` is a foreign tool as the policy's prompt and parser need it: its schema is rendered into the prompt, and in
Search-R1's tag format its closing tag stops generation and `<name> value </name>` parses to its one argument. It is
never run by dspo: the adapter sends the call to the foreign environment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dspo.env.rewards import EpisodeRecord, RewardResult, check_credit, extract_answer
from dspo.env.tools import Tool, ToolResult, ToolUnavailableError


class ScoredAnswer(str):
    """An answer string with the score the environment gave its episode (`reward`) and that score's named parts."""

    reward: float
    components: dict[str, float]

    def __new__(cls, answer: str | None, reward: float, components: Mapping[str, float] | None = None) -> ScoredAnswer:
        text = super().__new__(cls, answer or "")
        text.reward = float(reward)
        text.components = {str(k): float(v) for k, v in (components or {}).items()}
        return text

    def __reduce__(self) -> tuple:  # pickled across the engine process boundary (k >= 1) with its score
        return (ScoredAnswer, (str(self), self.reward, self.components))


class ExternalReward:
    """The outcome is the score the foreign environment returned with the answer; logged as `reward/<name>` beside each
    of its parts. An episode without one (the agent failed: a masked stub) scores 0.

    Args:
        name: the component name (`openenv`, `verifiers`).
        credit: "trajectory" (the only one: an endpoint agent's calls may rewrite its history).
    """

    def __init__(self, name: str, credit: str = "trajectory") -> None:
        self.name = name
        self.credit = check_credit(credit)

    def extract_answer(self, text: str) -> str | None:
        return extract_answer(text)

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        results = []
        for episode in episodes:
            answer = episode.answer
            if isinstance(answer, ScoredAnswer):
                results.append(RewardResult(answer.reward, components={self.name: answer.reward, **answer.components}))
            else:
                results.append(RewardResult(0.0, components={self.name: 0.0}))
        return results


def tag_argument(parameters: Mapping[str, Any]) -> str | None:
    """The argument `<name> value </name>` fills: the one required string property, if there is exactly one."""
    required = list(parameters.get("required") or [])
    properties = parameters.get("properties") or {}
    if len(required) == 1 and (properties.get(required[0]) or {}).get("type") == "string":
        return required[0]
    return None


class ProxyTool(Tool):
    """A foreign environment's tool, for the prompt and the parser only (module docstring)."""

    def __init__(self, name: str, description: str, parameters: Mapping[str, Any], owner: str) -> None:
        self.name, self.description, self.owner = name, description, owner
        self.parameters = dict(parameters) or {"type": "object", "properties": {}, "required": []}
        self.tag_argument = tag_argument(self.parameters)

    def run(self, calls: list[dict], contexts: list) -> list[ToolResult]:
        raise ToolUnavailableError(
            f"tool {self.name!r} belongs to the {self.owner} environment and runs there, through env.agent; keep "
            f"env.agent as env={self.owner} sets it"
        )


def tool_message(result: Any) -> str:
    """A foreign tool's result as the text of a tool message: a string as is, anything else as JSON."""
    import json

    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=str)
