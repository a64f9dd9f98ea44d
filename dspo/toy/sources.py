"""Two sources (`env=two_sources`, HierSearch-style): the toy world served as two corpora by two search tools.

`search_people` holds the pages of people and companies, `search_places` those of cities, countries, rivers and
landmarks. Every hop of a toy question needs the page of one entity (`metadata.chain`), held by exactly one source, so
the agent has to pick the right tool per hop: a 2-hop question about a company's founder's birthplace asks
`search_people` twice, one about a river's country asks `search_places` twice, and "in which country was X born" asks
people, then places.

Departures from HierSearch: its sources are a local knowledge base and the web, searched by separate agents under a
planner; here one agent picks between two BM25 corpora of one world, so that the choice is right or wrong by
construction and `reward/right_tool` (the share of searches sent to the source that holds the hop's page) can be
measured. The reward stays subEM: the right source is not paid for, only the answer it makes possible.

Each source is a corpus file of its own beside the world's corpus (`corpus.<tool>.jsonl`) with its own BM25 index
(`bm25.<tool>/`), built on first use and reused while the world's corpus is unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from dspo.env.environment import Environment
from dspo.env.rewards import EpisodeRecord, RewardResult, SubEMReward
from dspo.env.search_tool import SearchTool, queries_from_arguments
from dspo.metrics import normalize_answer
from dspo.search.bm25 import BM25Index, build_or_load_index
from dspo.search.corpus import load_corpus
from dspo.toy.world import ANSWER_TYPE
from dspo.types import Passage

# tool name -> the entity types whose pages that source holds (every type exactly once)
SOURCES: dict[str, tuple[str, ...]] = {
    "search_people": ("person", "company"),
    "search_places": ("city", "country", "river", "landmark"),
}
DESCRIPTIONS = {
    "search_people": "Search the people directory: pages of people and companies.",
    "search_places": "Search the gazetteer: pages of cities, countries, rivers and landmarks.",
}
INSTRUCTION = (
    "Answer the given question. Reason inside <think> and </think> first every time you get new information. Two "
    "search tools hold different pages: <search_people> query </search_people> searches people and companies, "
    "<search_places> query </search_places> searches cities, countries, rivers and landmarks; the top results come "
    "back between <information> and </information>. You may search as many times as you want. When you need no "
    "further knowledge, give the answer inside <answer> and </answer>, without explanation, for example "
    "<answer> Beijing </answer>. Question: {question}\n"
)


def check_sources(sources: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """`sources` as {tool: types}, or ValueError when a type is held by two sources."""
    owner: dict[str, str] = {}
    for tool, types in sources.items():
        for kind in types:
            if kind in owner:
                raise ValueError(f"sources: entity type {kind!r} is held by both {owner[kind]!r} and {tool!r}")
            owner[kind] = tool
    return {tool: tuple(types) for tool, types in sources.items()}


def source_of(entity_type: str, sources: Mapping[str, Sequence[str]] = SOURCES) -> str:
    """The tool whose source holds pages of `entity_type`."""
    for tool, types in sources.items():
        if entity_type in types:
            return tool
    raise ValueError(f"no source holds pages of type {entity_type!r}; sources: {dict(sources)}")


def chain_types(metadata: Mapping) -> list[str]:
    """The entity type of every page a toy question needs (`chain`): the first from `entity_type`, each later one the
    type its relation points to."""
    types = [str(metadata["entity_type"])]
    for relation in list(metadata["relations"])[: len(metadata["chain"]) - 1]:
        types.append(ANSWER_TYPE[relation])
    return types


def split_passages(
    passages: Sequence[Passage], world_meta: Mapping[str, dict], sources: Mapping[str, Sequence[str]] = SOURCES
) -> dict[str, list[Passage]]:
    """Each source's passages (by the type of the entity a passage is titled after)."""
    out: dict[str, list[Passage]] = {tool: [] for tool in sources}
    for passage in passages:
        entity = world_meta.get(passage.title)
        if entity is None:
            raise ValueError(f"passage {passage.id!r} is titled {passage.title!r}, which is not a toy-world entity")
        out[source_of(entity["type"], sources)].append(passage)
    empty = [tool for tool, kept in out.items() if not kept]
    if empty:
        raise ValueError(f"sources {empty} hold no passage of this world; check the types they list")
    return out


def source_corpus(corpus: str | Path, meta: str | Path, tool: str, sources: Mapping[str, Sequence[str]]) -> Path:
    """`corpus.<tool>.jsonl` beside `corpus`: the source's passages, rewritten only when they change."""
    world_meta = json.loads(Path(meta).read_text())["entities"]
    kept = split_passages(load_corpus(corpus), world_meta, sources)[tool]
    lines = "".join(json.dumps({"id": p.id, "contents": f'"{p.title}"\n{p.text}'}) + "\n" for p in kept)
    path = Path(corpus).with_name(f"corpus.{tool}.jsonl")
    if not path.is_file() or path.read_text() != lines:
        path.write_text(lines)
    return path


def source_tool(
    corpus: str,
    name: str,
    topk: int = 1,
    max_queries_per_call: int = 3,
    max_query_chars: int = 512,
    sources: Mapping[str, Sequence[str]] | None = None,
    meta: str | None = None,
) -> SearchTool:
    """The search tool `name` over its source of the toy world whose corpus is `corpus` (conf/env/two_sources.yaml);
    `meta`: the world's `world.json` (default: beside the corpus), which says each page's entity type."""
    sources = check_sources(sources or SOURCES)
    if name not in sources:
        raise ValueError(f"env.tools.{name}: no source named {name!r}; sources are {list(sources)}")
    meta = meta or str(Path(corpus).with_name("world.json"))
    if not Path(meta).is_file():
        raise FileNotFoundError(
            f"env.tools.{name}: {meta} not found: two sources split a toy world's corpus by entity type, and need "
            "the world.json built with it (retriever=toyworld; pass meta=... for a world elsewhere)"
        )
    path = source_corpus(corpus, meta, name, sources)
    index = build_or_load_index(path, Path(corpus).with_name(f"bm25.{name}"), show_progress=False)
    description = DESCRIPTIONS.get(name, f"Search the pages of {', '.join(sources[name])}.")
    return SearchTool(index, topk, max_queries_per_call, max_query_chars, name=name, description=description)


def source_environment(
    passages: Sequence[Passage],
    world_meta: Mapping[str, dict],
    topk: int = 1,
    max_queries_per_call: int = 3,
    max_query_chars: int = 512,
    max_answer_words: int | None = None,
    sources: Mapping[str, Sequence[str]] | None = None,
) -> Environment:
    """The two-sources environment over in-memory passages (the warm start's renamed worlds), as the YAML builds it."""
    sources = check_sources(sources or SOURCES)
    tools = {
        tool: SearchTool(
            BM25Index.build(kept, show_progress=False),
            topk,
            max_queries_per_call,
            max_query_chars,
            tool,
            DESCRIPTIONS.get(tool),
        )  # fmt: skip
        for tool, kept in split_passages(passages, world_meta, sources).items()
    }
    return Environment(tools, SourceAwareSubEM(max_answer_words, sources=sources), instruction=INSTRUCTION)


class SourceAwareSubEM(SubEMReward):
    """subEM (the outcome, unchanged) + `right_tool`, logged, not paid: the share of an episode's searches sent to the
    source that holds the page of the hop they look for (episodes without a search leave it out of the mean).

    A search looks for the chain entity its query names (the last one it names); a query naming none looks for the
    hop of its position (the k-th search, the k-th page; the last page beyond the chain)."""

    def __init__(
        self,
        max_answer_words: int | None = None,
        credit: str = "trajectory",
        sources: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__(max_answer_words, credit)
        self.sources = check_sources(sources or SOURCES)

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        results = super().score(episodes)
        for episode, result in zip(episodes, results):
            share = self.right_tool_share(episode)
            if share is not None:
                result.components["right_tool"] = share
        return results

    def right_tool_share(self, episode: EpisodeRecord) -> float | None:
        searches = [turn.call for turn in episode.searches if turn.call[0] in self.sources]
        if not searches:
            return None
        meta = episode.item.metadata
        chain = [normalize_answer(str(name)) for name in meta["chain"]]
        wanted = [source_of(kind, self.sources) for kind in chain_types(meta)]
        right = 0
        for position, (tool, arguments) in enumerate(searches):
            query = normalize_answer(" ".join(queries_from_arguments(arguments) or []))
            named = [hop for hop, name in enumerate(chain) if name and name in query]
            hop = named[-1] if named else min(position, len(chain) - 1)
            right += tool == wanted[hop]
        return right / len(searches)
