"""The search tool: a `Retriever` (local BM25, the remote `/retrieve` service, or your own) behind the tool interface.

Its limits (`topk`, `max_queries_per_call`, `max_query_chars`) are the environment's: `env.tools.search.topk=5`
(they were `rollout.agent.*` until issue 41; the old keys fail naming these). Arguments:
`query_list` (a list of strings), or a plain `query` string as Search-R1's retriever tool takes; in Search-R1's tag
format, `<search> q </search>` is one query. All queries of all calls of a turn go to the retriever in one batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dspo.env.tools import BAD_ARGUMENTS, CallContext, InvalidCall, Tool, ToolResult
from dspo.search.base import Retriever
from dspo.types import Passage

SEARCH_TOOL_SCHEMA: dict = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search Wikipedia. Returns the top passages for each query, best first.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "One or more short keyword queries.",
                }
            },
            "required": ["query_list"],
        },
    },
}

# The search tool's own error kinds (counted as rollout/invalid/<tool>/<kind>)
EMPTY_QUERY = "empty_query"
TOO_MANY_QUERIES = "too_many_queries"
QUERY_TOO_LONG = "query_too_long"


@dataclass
class QueryCheck:
    """Queries after `validate_queries`: stripped `queries` when valid, else `error_kind` + `error`."""

    queries: list[str] = field(default_factory=list)
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None


def validate_queries(queries: list[str], max_queries: int, max_query_chars: int) -> QueryCheck:
    """Strip queries and check count and length limits (the search tool's limits)."""
    cleaned = [q.strip() for q in queries]
    if not cleaned or any(not q for q in cleaned):
        message = "Error: the query list is empty or contains an empty query. Give at least one query."
        return QueryCheck(error_kind=EMPTY_QUERY, error=message)
    if len(cleaned) > max_queries:
        message = (
            f"Error: {len(cleaned)} queries in one call; at most {max_queries} are allowed. Split or shorten the list."
        )
        return QueryCheck(error_kind=TOO_MANY_QUERIES, error=message)
    too_long = [q for q in cleaned if len(q) > max_query_chars]
    if too_long:
        message = (
            f"Error: a query has {len(too_long[0])} characters; at most {max_query_chars} are allowed. Use keywords."
        )
        return QueryCheck(error_kind=QUERY_TOO_LONG, error=message)
    return QueryCheck(queries=cleaned)


def queries_from_arguments(arguments: object) -> list[str] | None:
    """`query_list` (list of strings) or `query` (string or list of strings); None if neither is usable."""
    if isinstance(arguments, str):  # some models emit arguments as a JSON-encoded string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # malformed, a number past the digit limit, or nested too deep
            return None
    if not isinstance(arguments, dict):
        return None
    value = arguments.get("query_list", arguments.get("query"))
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(q, str) for q in value):
        return list(value)
    return None


def format_passages(queries: list[str], results: list[list[Passage]]) -> str:
    """`Doc i (Title: t) text` lines; with several queries, one block per query headed by the query."""
    blocks = []
    for query, passages in zip(queries, results):
        lines = [f"Doc {i} (Title: {p.title}) {p.text}" for i, p in enumerate(passages, start=1)]
        body = "\n".join(lines) if lines else "No results."
        blocks.append(body if len(queries) == 1 else f'Results for "{query}":\n{body}')
    return "\n\n".join(blocks)


class SearchTool(Tool):
    """Args:
    retriever: any `dspo.search.Retriever` (`search(queries, k) -> passages per query`).
    topk: passages per query. max_queries_per_call, max_query_chars: limits of one call (the model is told).
    name, description: for several search tools over different sources (`env=two_sources`); the schema's argument
        stays `query_list`.
    """

    parameters = SEARCH_TOOL_SCHEMA["function"]["parameters"]
    tag_argument = "query"

    def __init__(
        self,
        retriever: Retriever,
        topk: int = 3,
        max_queries_per_call: int = 3,
        max_query_chars: int = 512,
        name: str = "search",
        description: str | None = None,
    ) -> None:
        if topk < 1 or max_queries_per_call < 1 or max_query_chars < 1:
            raise ValueError(
                f"search tool {name!r}: topk, max_queries_per_call and max_query_chars must be >= 1, got "
                f"{topk}, {max_queries_per_call}, {max_query_chars} (env.tools.{name}.*)"
            )
        self.retriever, self.topk = retriever, topk
        self.max_queries_per_call, self.max_query_chars = max_queries_per_call, max_query_chars
        self.name = name
        self.description = description or SEARCH_TOOL_SCHEMA["function"]["description"]

    def usage(self) -> str:
        return json.dumps({"name": self.name, "arguments": {"query_list": ["first query", "second query"]}})

    def tag_hint(self, open_tag: str, close_tag: str) -> str:
        return f"Search with {open_tag} query {close_tag}."

    def prepare(self, arguments: Any) -> dict:
        queries = queries_from_arguments(arguments)
        if queries is None:
            message = f"Error: the arguments must hold a list of strings under 'query_list'. Use {self.usage()}."
            raise InvalidCall(BAD_ARGUMENTS, message)
        call = validate_queries(queries, self.max_queries_per_call, self.max_query_chars)
        if not call.ok:
            raise InvalidCall(call.error_kind, call.error)
        return {"query_list": call.queries}

    def run(self, calls: list[dict], contexts: list[CallContext]) -> list[ToolResult]:
        queries = [q for call in calls for q in call["query_list"]]
        results = self.retriever.search(queries, self.topk)
        if len(results) != len(queries):
            raise RuntimeError(
                f"retriever {type(self.retriever).__name__} returned {len(results)} result lists for {len(queries)} "
                "queries; a Retriever must return one list per query"
            )
        out, offset = [], 0
        for call in calls:
            n = len(call["query_list"])
            hits = results[offset : offset + n]
            out.append(ToolResult(format_passages(call["query_list"], hits), [p for ps in hits for p in ps]))
            offset += n
        return out
