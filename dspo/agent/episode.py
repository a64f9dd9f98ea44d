"""`Episode`: the mutable state of one trajectory while the tool-calling agent rolls it out (`dspo.agent.tool_calling`).

Its token lists grow in step: `response_ids`, `mask` (1 = model-generated), `logprobs` (the engine's on mask-1 tokens)
and `versions`, the policy version that generated each token (with `rollout.partial_rollouts`, an episode carried into
a later round continues on newer weights, issue 43 point 3; the environment's tokens take the version of the turn
they follow, and are never trained).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from dspo.agent import compaction, parsing
from dspo.env.rewards import TurnRecord
from dspo.types import STOP_REASONS, QAItem, Segment


@dataclass
class Episode:
    """Mutable state of one trajectory while it is being rolled out."""

    item: QAItem
    prompt_ids: list[int]
    version: int = 0  # the policy version generating now (set by each rollout call that continues the episode)
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # [R] policy version of each response token
    model_text: list[str] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # response positions of each model turn
    tool_calls: Counter = field(default_factory=Counter)  # valid calls per tool
    invalid: Counter = field(default_factory=Counter)  # (tool, kind) -> count
    tool_errors: Counter = field(default_factory=Counter)  # tool -> count
    done: bool = False
    truncated: bool = False
    stop_reason: str = ""  # why it ended (dspo.types.STOP_REASONS), set by `end`
    observation: str | None = None  # pending tool message for this turn
    pending: parsing.ParsedCall | None = None  # a valid call, to run with the turn's batch
    spliced: list[compaction.Spliced] = field(default_factory=list)  # tool responses in the context (overflow=compact)
    segments: list[Segment] = field(default_factory=list)  # contexts closed by a compaction
    compactions: int = 0

    def end(self, reason: str) -> None:
        """The episode is over, for `reason` (dspo.types.STOP_REASONS): any reason but the model's own ending
        ("finished") leaves it truncated, without its answer."""
        if reason not in STOP_REASONS:
            raise ValueError(f"unknown stop reason {reason!r}; one of {STOP_REASONS}")
        self.done, self.truncated, self.stop_reason = True, reason != "finished", reason

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def turn(self) -> int:
        """The 0-based index of the episode's next model turn."""
        return len(self.turns)

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.response_ids.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend([self.version] * len(ids))

    def spans_versions(self) -> bool:
        """Whether more than one policy version generated its tokens (it was carried into a later round)."""
        return bool(self.versions) and min(self.versions) != max(self.versions)
