"""Scripted search-agent demonstrations for the toy world (the SFT warm start's training data).

A `ScriptedPolicy` plays one question: called with the tool observations received so far, it returns the next
assistant text in exactly the format the agent parses (`<think>...</think>` then a `<tool_call>` JSON block, or
`<answer>...</answer>`). The correct policy *reads* the observations: it only states a fact (and moves to the next
hop) when a retrieved sentence states it, quoting that sentence, so it stays honest under real BM25 results and never
teaches answering from memory. A configurable share of policies is imperfect (answer without searching, stop one
hop early, pick a wrong entity from the passages, emit a malformed call), so that the warm-started model leaves room
for RL.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dspo.toy.world import ANSWER_TYPE
from dspo.types import QAItem

CORRECT = "correct"
IMPERFECT_KINDS = ("no_search", "wrong_hop", "distractor", "malformed")
# How the scripted thoughts name a relation: "the {phrase} of {entity}" (see _plan).
RELATION_PHRASE = {"born_in": "birthplace", "founded_by": "founder", "country": "country", "capital": "capital"}
RELATION_PHRASE |= {"city": "city", "person": "patron or designer"}
_NAME = re.compile(r"[A-Z][a-z]+(?: [A-Z][a-z]+)*")
_DOC_HEADER = re.compile(r"Doc \d+ \(Title: [^)]*\)\s*")  # the agent's passage prefix (dspo.agent.tool_calling)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def tool_call_text(query: str, think: str, tag_format: str = "qwen", tool: str = "search") -> str:
    """An assistant turn that calls the search tool `tool` with one query, in the agent's `tag_format`."""
    if tag_format == "searchr1":
        return f"<think>{think}</think>\n<{tool}> {query} </{tool}>"
    call = json.dumps({"name": tool, "arguments": {"query_list": [query]}})
    return f"<think>{think}</think>\n<tool_call>\n{call}\n</tool_call>"


def answer_text(answer: str, think: str) -> str:
    """An assistant turn that gives the final answer."""
    return f"<think>{think}</think>\n<answer>{answer}</answer>"


@dataclass
class ScriptedPolicy:
    """Plays one question; `policy(observations)` returns the next assistant text.

    `observations[i]` is the text of the i-th tool response (whatever the agent inserted: retrieved passages or an
    error message). `kind` is `correct` or one of IMPERFECT_KINDS.
    """

    item: QAItem
    world: dict[str, dict]
    kind: str
    rng: random.Random
    tag_format: str = "qwen"  # rollout.agent.tag_format: "qwen" (<tool_call> JSON) or "searchr1" (<search> q </search>)
    # env=two_sources (dspo.toy.sources): {tool: entity types its source holds}; each hop asks the source holding its
    # page with probability `right_tool_share`, else another one (whose results then lack the fact). None: `search`
    sources: dict | None = None
    right_tool_share: float = 1.0

    def __post_init__(self) -> None:
        self.hop_tools = ["search"] * len(self.item.metadata["chain"])
        # searches before a `wrong_hop` answer: one on 2-hop questions; on deeper ones (dspo.toy.deep) any number short
        # of the chain, drawn only there so that 1-/2-hop demonstrations stay what they were
        hops = len(self.item.metadata["relations"])
        self.stop_after = self.rng.randint(1, hops - 1) if self.kind == "wrong_hop" and hops > 2 else 1
        if self.sources:  # drawn once, so every turn of the episode agrees (and nothing is drawn without sources)
            from dspo.toy.sources import chain_types, source_of

            for hop, kind in enumerate(chain_types(self.item.metadata)):
                right = source_of(kind, self.sources)
                others = sorted(tool for tool in self.sources if tool != right)
                wrong = self.rng.random() >= self.right_tool_share and others
                self.hop_tools[hop] = self.rng.choice(others) if wrong else right

    def __call__(self, observations: Sequence[str]) -> str:
        meta = self.item.metadata
        chain, relations = list(meta["chain"]), list(meta["relations"])
        if self.kind == "no_search":
            return answer_text(self._guess(relations[-1]), "I think I know this.")
        if self.kind == "malformed":
            tool = self.hop_tools[0]
            if not observations and self.tag_format == "searchr1":  # a call without its opening tag
                return f"<think>Search for {chain[0]}.</think>\n{chain[0]} </{tool}>"
            if not observations:  # a call whose JSON does not parse (missing closing brace)
                broken = json.dumps({"name": tool, "arguments": {"query_list": [chain[0]]}})[:-1]
                return f"<think>Search for {chain[0]}.</think>\n<tool_call>\n{broken}\n</tool_call>"
            return answer_text(self._guess(relations[-1]), "The search failed, so I will guess.")
        return self._hop(observations, chain, relations)

    def _hop(self, observations: Sequence[str], chain: list[str], relations: list[str]) -> str:
        """Correct behaviour (and the base of wrong_hop / distractor): one search per hop, reading each result."""
        entity = chain[0]
        for step, rel in enumerate(relations):
            if step >= len(observations):  # only the first search: later ones follow the evidence (below)
                return tool_call_text(entity, _plan(relations[step:], entity), self.tag_format, self.hop_tools[step])
            value = self.world[entity][rel]
            fact = evidence(observations[step], entity, value)
            if fact is None:  # the passage was not retrieved: say so, never answer from memory
                return answer_text(self._guess(rel), f"The results do not say the {RELATION_PHRASE[rel]} of {entity}.")
            last = step == len(relations) - 1
            if self.kind == "wrong_hop" and len(relations) > 1 and step + 1 == self.stop_after:
                return answer_text(value, fact)  # stops early: answers the hop it just read
            if last and self.kind in ("wrong_hop", "distractor"):
                wrong = self._other_name(observations[step], exclude={entity, value}) or self._guess(rel)
                return answer_text(wrong, fact.replace(value, wrong))  # misreads the name
            if last:
                return answer_text(value, fact)
            if step + 1 >= len(observations):
                think = f"{fact} {_plan(relations[step + 1 :], value)}"
                return tool_call_text(value, think, self.tag_format, self.hop_tools[step + 1])
            entity = value
        raise AssertionError("unreachable: every relation step returns")

    def _guess(self, relation: str) -> str:
        """A plausible but (almost surely) wrong answer: a random entity of the right type from the same split."""
        kind = ANSWER_TYPE[relation]
        split = self.world[self.item.metadata["chain"][0]]["split"]
        golds = set(self.item.golden_answers)
        pool = sorted(n for n, e in self.world.items() if e["type"] == kind and e["split"] == split and n not in golds)
        if not pool:  # a tiny world can have a single entity of this type in the split
            pool = sorted(n for n, e in self.world.items() if e["type"] == kind and n not in golds) or ["unknown"]
        return self.rng.choice(pool)

    def _other_name(self, text: str, exclude: set[str]) -> str | None:
        """Another entity name that appears in the retrieved text (the 'distractor' mistake)."""
        names = sorted({m for m in _NAME.findall(text) if m in self.world and m not in exclude})
        names = [n for n in names if n not in self.item.golden_answers]
        return self.rng.choice(names) if names else None


def _plan(relations: Sequence[str], entity: str) -> str:
    """The thought before a search: every hop still to go, outermost first ("I need the country of the birthplace of
    X."), so the turn after a passage can see from its own plan whether another hop is due. After a passage the
    thought quotes its evidence (`evidence`) and, when a hop is left, plans the rest: the final thought never restates
    the whole chain (measured: sampled 2-hop answers failed mostly inside a restated chain)."""
    phrases = " of the ".join(RELATION_PHRASE[rel] for rel in reversed(relations))
    return f"I need the {phrases} of {entity}."


def evidence(observation: str, entity: str, value: str) -> str | None:
    """The sentence of `observation` that states the fact (names both `entity` and `value`), quoted as retrieved up to
    the later of the two names ("X was founded by Y in 1998." -> "X was founded by Y."); None when no sentence does
    (the entity's passage was not retrieved). The cut keeps the name the next turn needs at the end of the quote:
    with the year after it, the stop-24 warm start got 1 of 120 sampled founder->birthplace rollouts right
    (measured: it garbled the year or the name, then the format).

    Every turn after a passage starts by quoting it, and the answer is the name the quote gives. An earlier design wrote
    "The {relation} of {entity} is {value}." instead: the tiny model then had to pick the relation's phrase itself, and
    after two searches it wrote the first hop's ("The birthplace of <city>.") in 123 of 138 sampled 2-hop rollouts
    (measured) and answered the city. A quote is copied, not composed."""
    text = _DOC_HEADER.sub("\n", observation)
    sentences = _SENTENCE_END.split(text)
    for sentence in sentences:
        if entity in sentence and value in sentence:
            end = max(sentence.index(entity) + len(entity), sentence.index(value) + len(value))
            return sentence[:end].strip().rstrip(",;") + "."
    return _pronoun_evidence(sentences, entity, value)


def _pronoun_evidence(sentences: list[str], entity: str, value: str) -> str | None:
    """A landmark's designer ("The X Tower stands in Y. It was designed by Z."): the fact's sentence says "It", so the
    quote is the sentence naming the entity and that one, cut after the value. Only reached where no sentence names
    both (the 3-/4-hop chains through a landmark, dspo.toy.deep): 1-/2-hop demonstrations never get here with a hit."""
    for before, sentence in zip(sentences, sentences[1:]):
        if entity in before and sentence.startswith("It ") and value in sentence:
            return f"{before.strip()} {sentence[: sentence.index(value) + len(value)].strip()}."
    return None


def check_imperfect_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    """`kinds` as a tuple, or ValueError naming the unknown ones."""
    unknown = [kind for kind in kinds if kind not in IMPERFECT_KINDS]
    if unknown:
        raise ValueError(f"imperfect_kinds: unknown {unknown}; choose from {list(IMPERFECT_KINDS)}")
    return tuple(kinds)


def choose_kind(
    rng: random.Random,
    imperfect_share: float,
    hops: int,
    early_stop_share: float = 0.0,
    imperfect_kinds: Sequence[str] = IMPERFECT_KINDS,
) -> str:
    """Multi-hop questions: `wrong_hop` (answer after the first search) with probability `early_stop_share`.
    Otherwise `correct` with probability 1 - imperfect_share, else a kind drawn uniformly from `imperfect_kinds`
    (`wrong_hop` only for multi-hop questions: a 1-hop question has no hop to stop before; `correct` when none is
    left)."""
    for name, share in (("imperfect_share", imperfect_share), ("early_stop_share", early_stop_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {share}")
    kinds = [kind for kind in check_imperfect_kinds(imperfect_kinds) if hops > 1 or kind != "wrong_hop"]
    if hops > 1 and rng.random() < early_stop_share:
        return "wrong_hop"
    if rng.random() >= imperfect_share or not kinds:
        return CORRECT
    return rng.choice(kinds)


def make_script(
    item: QAItem,
    world_meta: dict[str, dict],
    rng: random.Random,
    imperfect_share: float,
    tag_format: str = "qwen",
    early_stop_share: float = 0.0,
    imperfect_kinds: Sequence[str] = IMPERFECT_KINDS,
    hop2_imperfect_share: float | None = None,
    sources: dict | None = None,
    right_tool_share: float = 1.0,
) -> ScriptedPolicy:
    """The scripted policy for `item` (a toy-world question; its metadata holds `chain` and `relations`).

    `world_meta` is `dspo.toy.world.load_world_meta(files)`. The policy's kind is drawn from `rng` (`choose_kind`),
    with `hop2_imperfect_share` instead of `imperfect_share` for multi-hop questions when it is given. `sources` and
    `right_tool_share`: env=two_sources (see ScriptedPolicy).
    """
    meta = item.metadata
    if "relations" not in meta or "chain" not in meta:
        raise ValueError(
            f"make_script: item {item.id!r} has no toy-world metadata (chain/relations); not a toy question"
        )
    hops = int(meta["hops"])
    share = imperfect_share if hop2_imperfect_share is None or hops == 1 else hop2_imperfect_share
    kind = choose_kind(rng, share, hops, early_stop_share, imperfect_kinds)
    return ScriptedPolicy(
        item=item,
        world=world_meta,
        kind=kind,
        rng=random.Random(rng.random()),
        tag_format=tag_format,
        sources=sources,
        right_tool_share=right_tool_share,
    )
