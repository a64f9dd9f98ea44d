"""One episode of an agent that talks to the endpoint: its calls by token ids, and the training samples they make.

Every call is recorded as (prompt ids, the ids of each of its `n` completions, their engine logprobs). The samples:
a call whose prompt extends a sample's tokens (prompt + everything after) continues that sample: the tokens between
are the template's (tool turns, headers: loss mask 0), the completion is the model's (mask 1). A call that extends no
sample starts a new one from its prompt (mask 0 on all of it): the agent or the template rewrote history. That is a
*prefix break*, counted, never re-tokenized; every sample shares the episode's advantage (`Trajectory.segments`). The
completions 2..n of a call with `n > 1` are samples of their own from that prompt (branches, not breaks), so no token
is ever trained twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dspo.env.rewards import TurnRecord
from dspo.env.tools import ToolResult
from dspo.types import Generation, QAItem, Segment


class RequestError(Exception):
    """A request the endpoint refuses: `status` is its HTTP status, the message says what to change."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class CallRecord:
    prompt_ids: list[int]
    completions: list[Generation]  # [n] as the engine returned them


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # response positions of each completion

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def extend(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.response_ids.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def add_completion(self, generation: Generation) -> None:
        start = len(self.response_ids)
        self.extend(list(generation.token_ids), 1, list(generation.logprobs))
        self.spans.append((start, len(self.response_ids)))

    def segment(self) -> Segment:
        return Segment(list(self.prompt_ids), list(self.response_ids), list(self.mask), list(self.logprobs))


def build_samples(calls: list[CallRecord]) -> tuple[list[Sample], int]:
    """The training samples of an episode's calls (module docstring) and the number of prefix breaks."""
    samples: list[Sample] = []
    breaks = 0
    for call in calls:
        host = _longest_prefix(samples, call.prompt_ids)
        for k, generation in enumerate(call.completions):
            if k == 0 and host is not None:
                host.extend(call.prompt_ids[len(host.ids) :], 0)
                host.add_completion(generation)
                continue
            if k == 0 and samples:
                breaks += 1
            sample = Sample(prompt_ids=list(call.prompt_ids))
            sample.add_completion(generation)
            samples.append(sample)
    return samples, breaks


def _longest_prefix(samples: list[Sample], prompt: list[int]) -> Sample | None:
    best = None
    for sample in samples:
        ids = sample.ids
        if len(ids) <= len(prompt) and prompt[: len(ids)] == ids and (best is None or len(ids) > len(best.ids)):
            best = sample
    return best


@dataclass
class Episode:
    """What the endpoint knows of one running episode (`index` in the rollout's batch, `key` in its URL with the
    round's id)."""

    index: int
    key: str
    item: QAItem
    calls: list[CallRecord] = field(default_factory=list)
    admitted: int = 0  # requests admitted to generation (the turn budget; `calls` grows only once they are answered)
    turns: list[TurnRecord] = field(default_factory=list)  # one per call: its first completion's text, its tool call
    messages: list[dict] | None = None  # the last request's messages, for continuation
    returned: dict | None = None  # the assistant message answered to it (first choice)
    tool_calls: Counter = field(default_factory=Counter)  # valid calls per tool
    invalid: Counter = field(default_factory=Counter)  # (tool, kind) -> count
    tool_errors: Counter = field(default_factory=Counter)
    answer: Any = None
    error: str | None = None  # the agent failed (exception, timeout, bad answer): a masked stub
    truncated: bool = False  # a budget ran out (turns or tokens)
    stop_reason: str = ""  # which budget ("max_turns", "max_tokens"); see `end_reason`
    done: bool = False
    prefix_breaks: int = 0  # calls that extended none of the episode's samples

    def end_reason(self) -> str:
        """Why the episode ended (dspo.types.STOP_REASONS): the agent's failure, a budget, or the agent finished."""
        if self.error is not None:
            return "agent_timeout" if self.error.startswith("TimeoutError") else "agent_error"
        return self.stop_reason or "finished"

    @property
    def last_ids(self) -> list[int] | None:
        """The tokens of the last call's prompt + first completion: what a continuing request extends."""
        if not self.calls:
            return None
        last = self.calls[-1]
        return last.prompt_ids + list(last.completions[0].token_ids)

    def record_tool(self, name: str, arguments: dict, result: ToolResult) -> None:
        """A tool call ran: credit it to the episode's latest model turn (rewards such as StepSearch's read it)."""
        self.tool_calls[name] += 1
        if result.error is not None:
            self.tool_errors[name] += 1
        if self.turns and self.turns[-1].call is None:
            self.turns[-1].call, self.turns[-1].result = (name, arguments), result
