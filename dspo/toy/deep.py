"""Deep questions in the toy world (issue 43): chains of 3 and 4 hops, each hop one search.

The entity graph already chains four relations: a company's founder (person), where that person was born (city), the
country that city is in, and that country's capital (city). A 4-hop question starts at a company (or at a landmark,
whose passage names its designer or patron) and asks for the capital; each fact is stated only in the passage of the
entity it belongs to, so every hop needs one search for the previous hop's answer. `deep_questions` keeps a chain only
when no shortcut exists: no passage names an entity earlier in the chain together with a later hop's answer (a
landmark passage that names both a founder and the city they were born in would let one search skip a hop), and no
hop's answer repeats an earlier entity (a person born in the capital would make the 4-hop answer their birth city).

Why separate files and a separate random stream: `dspo-train` with no arguments must stay byte-identical, so the 1- and
2-hop splits (`dspo.toy.world.generate_world`) are untouched and the deep questions are drawn from the same entities
with their own `random.Random`, written beside them: `val_3hop.jsonl`, `test_4hop.jsonl`, ... (benchmarks toy_3hop /
toy_4hop) and `train_deep.jsonl` (the train split's 1-/2-hop questions plus its 3- and 4-hop ones: experiment=toy_deep).

`demo_deep.jsonl`: 3- and 4-hop chains of the demo split's entities (`deep_demo_questions`, a third random stream),
for the deep warm start's demonstrations only (`WarmStartConfig.deep_demos`, experiment=toy_deep): like the 1-/2-hop
demonstrations, they never name an entity RL or evaluation sees.
"""

from __future__ import annotations

import random
from pathlib import Path

from dspo.metrics import normalize_answer

DEEP_HOPS = (3, 4)
DEEP_SPLITS = ("train", "val", "test")  # the demo split's deep chains are demo_deep.jsonl (deep_demo_questions)

# (relations followed, question templates), as dspo.toy.world._QUESTIONS; the first entity's name is in the question.
DEEP_QUESTIONS = {
    ("company", "founded_by", "born_in", "country"): ["In which country was the founder of {e} born?"],
    ("person", "born_in", "country", "capital"): ["What is the capital of the country where {e} was born?"],
    ("river", "city", "country", "capital"): ["What is the capital of the country the {e} flows through?"],
    ("landmark", "person", "born_in", "country"): ["In which country was the patron or designer of the {e} born?"],
    ("company", "founded_by", "born_in", "country", "capital"): [
        "What is the capital of the country where the founder of {e} was born?"
    ],
    ("landmark", "person", "born_in", "country", "capital"): [
        "What is the capital of the country where the patron or designer of the {e} was born?"
    ],
}
# questions per split and hop count, at most (a split has as many 4-hop chains as companies + landmarks, ~60 in val,
# fewer without a shortcut: 41 in val, 44 in test)
DEEP_COUNTS = {"train": {3: 300, 4: 300}, "val": {3: 100, 4: 100}, "test": {3: 100, 4: 100}}
DEMO_COUNTS = {3: 300, 4: 300}  # the demo split's (the largest entity share: every 4-hop chain without a shortcut)


def deep_files(root: str | Path) -> dict[str, str]:
    """Paths of the deep files of a world folder: `val_3hop`, ..., `test_4hop` and `train_deep`."""
    root = Path(root)
    files = {f"{s}_{h}hop": str(root / f"{s}_{h}hop.jsonl") for s in ("val", "test") for h in DEEP_HOPS}
    return files | {"train_deep": str(root / "train_deep.jsonl"), "demo_deep": str(root / "demo_deep.jsonl")}


def _mentions(corpus: list[dict], names: list[str]) -> dict[str, frozenset[int]]:
    """For each name, the indices of the passages whose normalized text contains it (subEM-style containment)."""
    texts = [normalize_answer(row["contents"]) for row in corpus]
    keys = {n: normalize_answer(n) for n in names}
    return {n: frozenset(i for i, t in enumerate(texts) if keys[n] in t) for n in names}


def has_shortcut(chain: list[str], mentions: dict[str, frozenset[int]]) -> bool:
    """True when some hop's answer chain[k] is reachable without searching chain[k-1]: it repeats an earlier entity,
    or a passage names an entity before chain[k-1] together with chain[k]."""
    for k in range(1, len(chain)):
        if chain[k] in chain[:k] or any(mentions[chain[k]] & mentions[chain[j]] for j in range(k - 1)):
            return True
    return False


def deep_questions(ents: dict[str, dict], corpus: list[dict], seed: int) -> dict[str, list[dict]]:
    """3- and 4-hop questions per split ("train", "val", "test"), FlashRAG rows with metadata like the 1-/2-hop ones
    (hops, chain, relations, entity_type), ids `toy-deep-<split>-<i>`. Deterministic in `seed`, on its own stream."""
    rng = random.Random(f"toyworld-deep-{seed}")
    mentions = _mentions(corpus, list(ents))
    return {split: _split_questions(ents, mentions, rng, split, DEEP_COUNTS[split]) for split in DEEP_SPLITS}


def deep_demo_questions(ents: dict[str, dict], corpus: list[dict], seed: int) -> list[dict]:
    """3- and 4-hop questions over the demo split's entities (ids `toy-deep-demo-<i>`), with the same shortcut filter
    as `deep_questions`. A stream of their own (not `deep_questions`' next draws), so the train/val/test files stay
    byte for byte what they were before these existed."""
    rng = random.Random(f"toyworld-deep-demo-{seed}")
    return _split_questions(ents, _mentions(corpus, list(ents)), rng, "demo", DEMO_COUNTS)


def _split_questions(
    ents: dict[str, dict], mentions: dict[str, frozenset[int]], rng: random.Random, split: str, counts: dict[int, int]
) -> list[dict]:
    """The shortcut-free chains starting at `split`'s entities, at most `counts[hops]` per hop count, shuffled."""
    pools: dict[int, list[dict]] = {h: [] for h in DEEP_HOPS}
    for name, e in ents.items():
        if e["split"] != split:
            continue
        for path, templates in DEEP_QUESTIONS.items():
            if path[0] != e["type"]:
                continue
            chain = [name]
            for rel in path[1:]:
                chain.append(ents[chain[-1]][rel])
            if has_shortcut(chain, mentions):
                continue
            meta = {
                "hops": len(path) - 1,
                "chain": chain[:-1],
                "relations": list(path[1:]),
                "entity_type": e["type"],
            }
            row = {
                "question": rng.choice(templates).format(e=name),
                "golden_answers": [chain[-1]],
                "metadata": meta,
            }
            pools[meta["hops"]].append(row)
    rows = []
    for hops, pool in pools.items():
        rows += rng.sample(pool, min(len(pool), counts[hops]))
    rng.shuffle(rows)
    return [{"id": f"toy-deep-{split}-{i}", **q} for i, q in enumerate(rows)]
