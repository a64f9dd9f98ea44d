"""`Environment`: the tools an agent can call and the reward it is paid, selected by the config group `env`.

`env=search` (the default) is today's setup: one search tool over the `retriever` group + the subEM reward. The agent
loop (`dspo.agent.tool_calling.ToolCallingAgent`) is the framework; an environment is the plug-in, built by Hydra from
`_target_`s, and used by training, `dspo-eval`, `dspo-rollout`, the toy warm start and the benchmarks alike
(`build_agent`). docs/extending.md shows a new tool and a new reward in a few lines each.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from string import Formatter
from typing import Any

from dspo.env.rewards import Reward, SubEMReward
from dspo.env.search_tool import SearchTool
from dspo.env.tools import Tool


class Environment:
    """Args:
    tools: {name: tool}; each key must be its tool's `name` (the name the model calls).
    reward: a `dspo.env.rewards.Reward`.
    max_tool_error_share: above this share of a round's calls failing inside a tool (exceptions, timeouts), the round
        fails naming the tool.
    instruction: the first user message, with `{question}`; None = dspo's default for the agent's tag format
        (written for one `search` tool: give your own when the tools differ).
    agent: an agent written against the OpenAI chat API, `module.function` (or the function): `async def agent(client,
        item, tools) -> str | None`, trained through the policy's endpoint (`env=agent`, docs/agents.md). None: the
        agent is `rollout.agent` (the built-in tool-calling loop by default).
    max_agent_error_share: with `agent`, above this share of a batch's episodes failing (an exception, a timeout),
        the round fails naming the agent; below it each failed episode is a counted, untrained stub.
    steady_validation: true when validation poses the same task at every step; false when it moves with training
        (env=simulated's noise curriculum applies at validation too), so that validations of different steps do not
        compare: the guard's `val_drop` and its best-validation target are then off (`guard.steady_validation`).
    """

    def __init__(
        self,
        tools: Mapping[str, Tool],
        reward: Reward,
        max_tool_error_share: float = 0.05,
        instruction: str | None = None,
        agent: str | Callable | None = None,
        max_agent_error_share: float = 0.05,
        steady_validation: bool = True,
    ) -> None:
        self.tools = dict(tools)
        for key, tool in self.tools.items():
            if getattr(tool, "name", None) != key:
                raise ValueError(
                    f"env.tools.{key}: the tool is named {getattr(tool, 'name', None)!r}; the key is the name the "
                    f"model calls, so they must agree (set env.tools.{key}.name={key} or rename the key)"
                )
        if not 0 <= max_tool_error_share <= 1:
            raise ValueError(f"env.max_tool_error_share must be within [0, 1], got {max_tool_error_share}")
        if instruction is not None:
            check_instruction(instruction)
        self.reward, self.max_tool_error_share, self.instruction = reward, max_tool_error_share, instruction
        if not 0 <= max_agent_error_share <= 1:
            raise ValueError(f"env.max_agent_error_share must be within [0, 1], got {max_agent_error_share}")
        self.agent = resolve_agent(agent) if agent is not None else None
        self.max_agent_error_share = max_agent_error_share
        self.steady_validation = steady_validation

    @property
    def credit(self) -> str:
        return getattr(self.reward, "credit", "trajectory")

    def on_progress(self, step: int, total_steps: int | None) -> None:
        """Tell every tool where training is (curricula); the trainer calls it before each round."""
        for tool in self.tools.values():
            tool.on_progress(step, total_steps)

    @classmethod
    def search(cls, retriever: Any, **search_limits: Any) -> Environment:
        """The default environment over `retriever`: one search tool (`topk`, `max_queries_per_call`,
        `max_query_chars`) and the subEM reward (`max_answer_words`)."""
        max_answer_words = search_limits.pop("max_answer_words", None)
        return cls({"search": SearchTool(retriever, **search_limits)}, SubEMReward(max_answer_words))


_TRIAL_QUESTION = "\u2983question\u2984"


def check_instruction(instruction: str) -> None:
    """`env.instruction` formatted once with a trial question, so that a brace the template cannot take fails when the
    environment is built, naming the key, not at the first rollout as `KeyError: '"name"'`."""
    literal = 'write a literal brace as {{ and }}, e.g. {{"name": "search"}}'
    try:
        fields = [name for _, name, _, _ in Formatter().parse(instruction) if name is not None]
        other = [name for name in fields if name != "question"]
        if other:
            raise ValueError(f"{{{other[0]}}} is not a placeholder (the only one is {{question}})")
        text = instruction.format(question=_TRIAL_QUESTION)
    except (ValueError, KeyError, IndexError, AttributeError, TypeError) as error:
        raise ValueError(f"env.instruction: {error}; {literal}") from None
    if _TRIAL_QUESTION not in text:
        raise ValueError("env.instruction must contain {question}, where the question goes")


def check_credit_fits(env: Environment, objective: Any) -> None:
    """`credit: turn` gives each token its turn's advantage: only objectives that weigh tokens one by one take it."""
    if env.credit == "turn" and not getattr(objective, "token_advantages", False):
        raise ValueError(
            f"env.reward.credit=turn credits each turn's tokens with their own advantage, but objective "
            f"'{objective.name}' takes one advantage per sequence; use env.reward.credit=trajectory (the trajectory's "
            "total reward), or a token-level objective (algorithm=dapo or algorithm=grpo)"
        )


def resolve_agent(agent: str | Callable) -> Callable:
    """`env.agent` as a function: `module.function` is imported (the module must be importable: PYTHONPATH)."""
    if callable(agent):
        function = agent
    else:
        if not isinstance(agent, str) or "." not in agent:
            raise ValueError(f"env.agent={agent!r}: expected module.function, e.g. env.agent=openai_agent.agent")
        module_name, name = agent.rsplit(".", 1)
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImportError(
                f"env.agent={agent}: module {module_name!r} failed to import ({error}); put its folder on PYTHONPATH "
                "(e.g. PYTHONPATH=docs/examples dspo-train env=agent)"
            ) from error
        function = getattr(module, name, None)
        if function is None:
            raise ValueError(f"env.agent={agent}: module {module_name!r} has no {name!r}")
    if not inspect.iscoroutinefunction(function):
        raise TypeError(f"env.agent: {function!r} must be an async function: async def agent(client, item, tools)")
    return function
