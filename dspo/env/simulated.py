"""Simulated search (ZeroSearch, Sun et al. 2025; SSRL): a search tool whose documents are written by a simulator, with
a noise curriculum that makes more and more of them useless as training goes on (`env=simulated`, docs/simulated.md).

The tool is the search tool (same name, arguments, limits and `Doc i (Title: t) text` answer, so a policy that calls
`<search> q </search>` works unchanged) with a `Simulator` in place of the retriever: all queries of all calls of a turn
go to it in one batch. Two simulators:
- `EngineSimulator`: an LLM prompted as a search engine, through the same engine classes as the policy (vLLM, HF), with
  its own engine instance and seed; one batched `generate` per turn.
- `ScriptedSimulator`: the toy's stand-in (the toy has no model that can write its pages): the retriever's page for
  the query, or a distractor page.

Where this departs from ZeroSearch, and why:
- Noise is drawn per document (each of the k documents is noisy with the curriculum's probability p), and each
  document is one generation prompted as useful or noisy. ZeroSearch prompts one generation for all documents of a
  query; one per document keeps the useful/noisy mix exact, the parsing trivial (no splitting of k documents out of
  one text), and a malformed document from spoiling its siblings, at the price of k times more (shorter) prompts.
- The draws are not sampled from a generator but hashed (blake2b) from (seed, step, question id, episode, turn, query
  position, document slot): a resumed run, another process or a validation pass in between draw exactly the same.
- The schedule is linear by default; ZeroSearch's exponential one (`schedule: exponential`, base b = 10:
  p = start + (end - start) (b^(step/total) - 1) / (b - 1)) is one key away.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dspo.engines.base import SamplingConfig
from dspo.env.search_tool import SearchTool, format_passages
from dspo.env.tools import CallContext, ToolResult
from dspo.metrics import sub_exact_match
from dspo.search.base import Retriever
from dspo.types import Passage

SCHEDULES = ("linear", "exponential")


# ------------------------------------------------------------------------------------------ the curriculum and draws
@dataclass
class NoiseCurriculum:
    """The probability that a document is noisy at `step` of `total_steps`: `start` at step 0, `end` from the last step
    on, `linear` or ZeroSearch's `exponential` (slow at first, `base` sets how slow) in between. Without a horizon
    (`total_steps` None or <= 0: evaluation, an unbounded run) it stays at `start`."""

    start: float = 0.0
    end: float = 0.5
    schedule: str = "linear"
    base: float = 10.0
    where: str = "env.tools.search"  # the config node, for error messages

    def __post_init__(self) -> None:
        for key, value in (("noise_start", self.start), ("noise_end", self.end)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{self.where}.{key}={value}: a probability, within [0, 1]")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{self.where}.schedule={self.schedule!r}: expected one of {list(SCHEDULES)}")
        if self.schedule == "exponential" and self.base <= 1.0:
            raise ValueError(f"{self.where}.schedule_base={self.base}: must be > 1 for the exponential schedule")

    def at(self, step: int, total_steps: int | None) -> float:
        if not total_steps or total_steps <= 0:
            return self.start
        progress = min(max(step / total_steps, 0.0), 1.0)
        if self.schedule == "exponential":
            progress = (self.base**progress - 1.0) / (self.base - 1.0)
        return self.start + (self.end - self.start) * progress


def uniform(*key: object) -> float:
    """A uniform number in [0, 1) that depends only on `key` (not on the process, the hash seed or any global RNG)."""
    digest = hashlib.blake2b("/".join(map(str, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass
class SimulatedQuery:
    """One query for a simulator: `noisy[i]` says whether document i must be noisy (k = len(noisy)); `key` seeds the
    simulator's own choices for this query; `question` and `answers` are the episode's (hidden from the policy;
    ZeroSearch's simulator prompt is conditioned on them)."""

    query: str
    noisy: list[bool]
    key: str
    question: str = ""
    answers: list[str] = field(default_factory=list)


class Simulator(Protocol):
    def simulate(self, queries: list[SimulatedQuery]) -> list[list[Passage]]:
        """Documents for every query (at most len(query.noisy) each, in slot order), all queries in one batch."""
        ...


# ------------------------------------------------------------------------------------------ the tool
class SimulatedSearchTool(SearchTool):
    """The search tool over a simulator. Args (config keys `env.tools.search.<key>`):
    simulator: an `EngineSimulator`, a `ScriptedSimulator` or any `Simulator`.
    topk, max_queries_per_call, max_query_chars, name, description: as the search tool's.
    noise_start, noise_end: the probability that a document is noisy at the first and at the last training step.
    schedule: `linear` | `exponential` (ZeroSearch's; `schedule_base` b) between them, over `trainer.max_steps`.
    noise: a constant probability instead of the curriculum (noise_start = noise_end = noise; None: the curriculum):
        the perturbation study's one key (`env.tools.search.noise=0.3`, env=simulated or env=goal_reflect).
    seed: of the noise draws (the engine simulator's sampling has its own `seed`).
    """

    def __init__(
        self,
        simulator: Simulator,
        topk: int = 3,
        max_queries_per_call: int = 3,
        max_query_chars: int = 512,
        noise_start: float = 0.0,
        noise_end: float = 0.5,
        schedule: str = "linear",
        schedule_base: float = 10.0,
        seed: int = 0,
        name: str = "search",
        description: str | None = None,
        noise: float | None = None,
    ) -> None:
        # no retriever: `retriever` is the scripted simulator's, if any (the agent's retry statistics read it)
        retriever = getattr(simulator, "retriever", None)
        super().__init__(retriever, topk, max_queries_per_call, max_query_chars, name, description)
        if not callable(getattr(simulator, "simulate", None)):
            raise TypeError(f"env.tools.{name}.simulator: {type(simulator).__name__} has no simulate(queries) method")
        self.simulator, self.seed = simulator, seed
        if noise is not None:
            if not 0.0 <= noise <= 1.0:
                raise ValueError(f"env.tools.{name}.noise={noise}: a probability, within [0, 1]")
            noise_start = noise_end = noise
        self.curriculum = NoiseCurriculum(noise_start, noise_end, schedule, schedule_base, f"env.tools.{name}")
        self.step, self.total_steps = 0, None

    @property
    def noise_probability(self) -> float:
        return self.curriculum.at(self.step, self.total_steps)

    def on_progress(self, step: int, total_steps: int | None) -> None:
        self.step, self.total_steps = int(step), total_steps

    def run(self, calls: list[dict], contexts: list[CallContext]) -> list[ToolResult]:
        p = self.noise_probability
        queries = [
            self._query(query, position, context, p)
            for call, context in zip(calls, contexts)
            for position, query in enumerate(call["query_list"])
        ]
        results = self.simulator.simulate(queries)
        if len(results) != len(queries):
            raise RuntimeError(
                f"simulator {type(self.simulator).__name__} returned {len(results)} result lists for {len(queries)} "
                "queries; a Simulator must return one list per query"
            )
        out, offset = [], 0
        for call in calls:
            n = len(call["query_list"])
            hits, asked = results[offset : offset + n], queries[offset : offset + n]
            metrics = {"noise_probability": p, "noisy_share": sum(sum(q.noisy) for q in asked) / (n * self.topk)}
            passages = [d for ds in hits for d in ds]
            out.append(ToolResult(format_passages(call["query_list"], hits), passages, metrics=metrics))
            offset += n
        return out

    def _query(self, query: str, position: int, context: CallContext, p: float) -> SimulatedQuery:
        item = context.item
        key = f"{self.seed}/{self.step}/{getattr(item, 'id', '')}/{context.episode_index}/{context.turn}/{position}"
        return SimulatedQuery(
            query=query,
            noisy=[uniform(key, "noise", slot) < p for slot in range(self.topk)],
            key=key,
            question=getattr(item, "question", ""),
            answers=list(getattr(item, "golden_answers", [])),
        )


# ------------------------------------------------------------------------------------------ the toy's simulator
class ScriptedSimulator:
    """Stands in for an LLM simulator in the toy, which has no model that can write its pages: a useful document is
    the retriever's page for the query (BM25 top-1 over the toy corpus: the page of the entity the query names), a
    noisy one a *distractor*: a page drawn (seeded by the query's key) from the retriever's next `distractor_pool`
    pages that does not state a gold answer. In the toy those share a name word with the query: another entity of the
    same kind (another "... Corp", another person called "Tares") or a page that mentions the entity but states
    another fact (a landmark the person designed, in another city); never the page asked for. A noisy slot with no
    such page left is left out (fewer documents): a page stating the answer would be no noise.

    One `retriever.search` per turn, for every query, `k + distractor_pool` pages deep.
    """

    def __init__(self, retriever: Retriever, distractor_pool: int = 5) -> None:
        if distractor_pool < 1:
            raise ValueError(f"env.tools.search.simulator.distractor_pool={distractor_pool}: must be >= 1")
        self.retriever, self.distractor_pool = retriever, distractor_pool

    def simulate(self, queries: list[SimulatedQuery]) -> list[list[Passage]]:
        if not queries:
            return []
        k = max(len(q.noisy) for q in queries)
        results = self.retriever.search([q.query for q in queries], k + self.distractor_pool)
        if len(results) != len(queries):
            raise RuntimeError(f"retriever {type(self.retriever).__name__}: {len(results)} lists for {len(queries)}")
        return [self._documents(q, hits) for q, hits in zip(queries, results)]

    def _documents(self, query: SimulatedQuery, hits: list[Passage]) -> list[Passage]:
        k = len(query.noisy)
        useful, below = hits[:k], hits[k:]
        clean = [p for p in below if not sub_exact_match(f"{p.title} {p.text}", query.answers)]
        docs = []
        for slot, noisy in enumerate(query.noisy):
            if not noisy:
                if slot < len(useful):
                    docs.append(useful[slot])
                continue
            pool = [p for p in clean if p not in docs]
            if pool:
                docs.append(pool[int(uniform(query.key, "pick", slot) * len(pool))])
        return docs


# ------------------------------------------------------------------------------------------ the LLM simulator
USEFUL_PROMPT = (
    "You are a search engine. Write one web document that the search engine returns for the query below. The user is "
    "trying to answer the question: {question} Its answer is: {answers}. The document must contain information useful "
    "for answering the question.\nQuery: {query}\nWrite a title on the first line, then about 40 words of text."
)
NOISY_PROMPT = (
    "You are a search engine. Write one web document that the search engine returns for the query below. The user is "
    "trying to answer the question: {question} Its answer is: {answers}. The document must look related to the query "
    "but must not contain the answer or anything that helps find it.\nQuery: {query}\nWrite a title on the first "
    "line, then about 40 words of text."
)
_SPECIAL = re.compile(r"<\|[^|>]{1,40}\|>")  # <|im_end|>, <|endoftext|>: chat markers, never document text
_TITLE = re.compile(r"^\W*(?:doc(?:ument)?\s*\d*\s*[:.)-]?\s*)?\(?\s*title\s*[:：]\s*(.*?)\)?\s*$", re.IGNORECASE)
_TEXT_LABEL = re.compile(r"^\s*(?:text|content|body|snippet)\s*:\s*", re.IGNORECASE)


def parse_document(text: str, query: str, max_title_chars: int = 120) -> tuple[str, str]:
    """(title, text) of one generated document; never raises. A `Title: t` first line (or `(Title: t) ...`, the
    format the policy sees) gives the title; else a short first line followed by more lines is the title; else the
    title is the query and everything is text."""
    text = _SPECIAL.sub("", text).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return query, ""
    inline = re.match(r"^\(\s*title\s*:\s*([^)]*)\)\s*(.+)$", lines[0], re.IGNORECASE)
    if inline:
        return inline.group(1).strip() or query, " ".join([inline.group(2), *lines[1:]]).strip()
    labelled = _TITLE.match(lines[0])
    if labelled:
        title, rest = labelled.group(1).strip(), lines[1:]
    elif len(lines) > 1 and len(lines[0]) <= max_title_chars:
        title, rest = lines[0].strip('#*" '), lines[1:]
    else:
        title, rest = query, lines
    body = " ".join(rest)
    return (title[:max_title_chars] or query), _TEXT_LABEL.sub("", body).strip()


class EngineSimulator:
    """An LLM prompted as a search engine: one generation per document, `useful_prompt` or `noisy_prompt` as the
    curriculum drew it, all queries x k documents of a turn in one batched `engine.generate`.

    Args (config keys `env.tools.search.simulator.<key>`):
    model_path: a local model directory (a ZeroSearch simulator, any instruct model).
    engine: a partial engine constructor taking `model_path` (`dspo.engines.VLLMEngine` / `HFEngine` with
        `_partial_: true`, as `rollout.engine`), or a built engine; None = HFEngine on CPU. Built on first use.
    useful_prompt, noisy_prompt: templates with `{query}` and optionally `{question}`, `{answers}`.
    max_new_tokens, temperature: sampling of a document. seed: of the simulator's sampling (mixed with each batch's
        query keys, so a batch is reproducible). chat_template: wrap the prompt as a user turn where the tokenizer has
        a chat template (instruct models); false for base / completion-style simulators.
    """

    def __init__(
        self,
        model_path: str | None = None,
        engine: Any = None,
        useful_prompt: str = USEFUL_PROMPT,
        noisy_prompt: str = NOISY_PROMPT,
        max_new_tokens: int = 96,
        temperature: float = 1.0,
        seed: int = 0,
        chat_template: bool = True,
    ) -> None:
        for key, template in (("useful_prompt", useful_prompt), ("noisy_prompt", noisy_prompt)):
            _check_template(key, template)
        if max_new_tokens < 1:
            raise ValueError(f"env.tools.search.simulator.max_new_tokens={max_new_tokens}: must be >= 1")
        built = engine is not None and callable(getattr(engine, "generate", None))
        if not built and model_path is None:
            raise ValueError("env.tools.search.simulator.model_path: set the simulator model's directory")
        self.model_path, self.engine_factory = model_path, (None if built else engine)
        self.engine = engine if built else None
        self.prompts = {False: useful_prompt, True: noisy_prompt}
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.chat_template = chat_template

    def _engine(self):
        """Built on first use, not at config time: a training run builds the policy's engine first."""
        if self.engine is None:
            factory: Callable[..., Any] = self.engine_factory or _default_engine
            self.engine = factory(model_path=self.model_path)
        return self.engine

    def prompt(self, query: SimulatedQuery, slot: int) -> str:
        template = self.prompts[bool(query.noisy[slot])]
        answers = "; ".join(query.answers) or "unknown"
        return template.format(query=query.query, question=query.question or query.query, answers=answers)

    def _encode(self, tokenizer, prompt: str) -> list[int]:
        if self.chat_template and getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(prompt, add_special_tokens=False)

    def simulate(self, queries: list[SimulatedQuery]) -> list[list[Passage]]:
        slots = [(q, slot) for q in queries for slot in range(len(q.noisy))]
        if not slots:
            return [[] for _ in queries]
        engine = self._engine()
        prompts = [self._encode(engine.tokenizer, self.prompt(q, slot)) for q, slot in slots]
        batch_seed = int(uniform(self.seed, *(q.key for q in queries)) * 2**31)
        sampling = SamplingConfig(temperature=self.temperature, max_new_tokens=self.max_new_tokens, seed=batch_seed)
        generations = engine.generate(prompts, sampling)
        if len(generations) != len(prompts):
            raise RuntimeError(f"simulator engine returned {len(generations)} generations for {len(prompts)} prompts")
        out: list[list[Passage]] = [[] for _ in queries]
        owners = [i for i, q in enumerate(queries) for _ in q.noisy]
        for owner, (q, slot), generation in zip(owners, slots, generations):
            title, text = parse_document(generation.text, q.query)
            out[owner].append(Passage(id=_document_id(q, slot), title=title, text=text))
        return out


def _document_id(query: SimulatedQuery, slot: int) -> str:
    """`simulated/<useful|noisy>/<digest>`: rewards and analyses can tell written documents and their kind apart."""
    kind = "noisy" if query.noisy[slot] else "useful"
    return f"simulated/{kind}/{hashlib.blake2b(f'{query.key}/{slot}'.encode(), digest_size=6).hexdigest()}"


def _default_engine(model_path: str):
    from dspo.engines import HFEngine

    return HFEngine(model_path=model_path)


def _check_template(key: str, template: str) -> None:
    try:
        template.format(query="q", question="q", answers="a")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"env.tools.search.simulator.{key}: fields may be {{query}}, {{question}}, {{answers}} ({exc!r}); "
            "double literal braces ({{ }})"
        ) from None
    if "{query}" not in template:
        raise ValueError(f"env.tools.search.simulator.{key} must contain {{query}}, where the query goes")
