"""Contexts that stay within budget (`rollout.agent.overflow: compact`, issue 43): when the next turn would pass
`max_total_tokens`, the oldest tool responses are replaced by one-line notes (the call and the titles it returned)
until the context fits.

A compacted context no longer continues the token sequence its earlier turns were sampled from, so the episode
becomes several training samples, one per context (`Trajectory.segments`, expanded by `build_round`), all with the
episode's advantage. Each model token is trained once, in the context it was sampled from: the context before a
compaction is closed as a segment with its masks as they were, and in the new context every token already there
(earlier model turns included) has mask 0 and logprob 0.0. Nothing is re-tokenized: tokens are moved as ids, and only
the notes are tokenized, alone, as any observation is.

Departures from common practice, on purpose: verl and OpenRLHF truncate observations or end the episode at the
budget (dspo's `overflow: end`); summarizing agents (AReaL) ask the model for a summary. Here the note is written by
the environment (`compaction_note`, or a tool's own `compaction_note(arguments, result)`), so compaction costs no
generation and the model keeps what it needs to chain the next hop: the queries it sent and the titles it was shown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dspo.agent.stats import Kind
from dspo.env.rewards import TurnRecord
from dspo.env.search_tool import queries_from_arguments

# what an agent that compacts reports per call (dspo.agent.stats): compactions made, training samples per episode
STAT_KINDS = {"compactions": Kind.SUM, "samples_per_episode": Kind.MEAN}

MAX_NOTE_TITLES = 5
MAX_NOTE_QUERY_CHARS = 80


@dataclass
class Spliced:
    """One tool response in an episode's current context: its observation's response positions [start, end)
    (without the template's wrappers) and the note that replaces it when compacted."""

    start: int
    end: int
    note: str
    compacted: bool = False


@dataclass
class Rewritten:
    """A context after compaction: the new response tokens (mask 0 and logprob 0.0 throughout) and where each old
    response position now lies (`moved(p)`, for positions outside the compacted observations)."""

    response_ids: list[int]  # [R']
    response_mask: list[int]  # [R'] all 0: nothing in the rewritten context was sampled from it
    logprobs: list[float]  # [R'] all 0.0 (the engine's logprobs of a context no token was sampled from)
    moved: Callable[[int], int]


def compaction_note(turn: TurnRecord, tool: Any = None) -> str:
    """The one line that replaces a tool response: `(search "query": Title; Title)`, the call's queries and the titles
    it returned, as few tokens as that takes (a tool may write its own: `tool.compaction_note(arguments, result)`)."""
    if turn.call is None:  # an invalid call's explanation, or an agent's `next_message`
        return "(an invalid call)" if turn.invalid else "(a message)"
    name, arguments = turn.call
    custom = getattr(tool, "compaction_note", None)
    if callable(custom):
        return str(custom(arguments, turn.result)).replace("\n", " ")
    call = f"{name} {_queries(arguments)}".strip()
    result = turn.result
    if result is not None and result.error is not None:
        return f"({call}: failed)"
    titles = list(dict.fromkeys(p.title for p in (result.passages if result is not None else [])))
    shown = "; ".join(titles[:MAX_NOTE_TITLES]) + ("; ..." if len(titles) > MAX_NOTE_TITLES else "")
    return f"({call}: {shown or 'nothing'})"


def _queries(arguments: Any) -> str:
    """The call's queries (`query_list` or `query`, as the search tools take them), quoted and shortened."""
    return ", ".join(f'"{_short(q)}"' for q in queries_from_arguments(arguments) or [])


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_NOTE_QUERY_CHARS else text[: MAX_NOTE_QUERY_CHARS - 3] + "..."


def choose(spliced: Sequence[Spliced], note_ids: Callable[[Spliced], list[int]], excess: int) -> list[Spliced]:
    """The oldest not yet compacted responses whose notes free at least `excess` tokens together (all of them that
    free any, when they cannot); responses no longer than their note are skipped."""
    chosen, freed = [], 0
    for obs in spliced:
        if freed >= excess:
            break
        saved = (obs.end - obs.start) - len(note_ids(obs))
        if not obs.compacted and saved > 0:
            chosen.append(obs)
            freed += saved
    return chosen


def rewrite(response_ids: Sequence[int], replacements: Sequence[tuple[int, int, list[int]]]) -> Rewritten:
    """`response_ids` with each `[start, end)` of `replacements` (sorted, disjoint) replaced by its ids."""
    ids: list[int] = []
    shifts: list[tuple[int, int]] = []  # (old end of a replacement, shift of every later position)
    cursor, shift = 0, 0
    for start, end, new in sorted(replacements, key=lambda r: r[0]):
        if start < cursor or end < start:
            raise ValueError(f"compaction: replacements overlap or are reversed at [{start}, {end})")
        ids.extend(response_ids[cursor:start])
        ids.extend(new)
        shift += len(new) - (end - start)
        shifts.append((end, shift))
        cursor = end
    ids.extend(response_ids[cursor:])

    def moved(position: int) -> int:
        applied = 0
        for end, total in shifts:
            if position >= end:
                applied = total
        return position + applied

    return Rewritten(ids, [0] * len(ids), [0.0] * len(ids), moved)
