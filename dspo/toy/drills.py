"""Name-recall drills for the toy warm start: `filler name filler name ... cue name`, loss on the repeated name.

A stage before the demonstrations (`dspo.toy.warmstart`) that forms the circuit copying the one name of the asked type
from the context, the skill whole demonstrations failed to teach a tiny model in the time budget (measured in
`recall_examples`). Not part of the paper: it stands in, with the demonstrations, for a pretrained instruct model.
"""

from __future__ import annotations

import random

Example = tuple[list[int], list[float]]  # token ids, per-token loss weight of that token as a *target*

# Words that separate names in recall drills, and the cue word that asks for an entity type.
_DRILL_FILLER = " was born in the city of a is founded by through flows and, with its. "
_TYPE_CUE = {"person": " person", "city": " city", "country": " country", "company": " company", "river": " river"}


def recall_examples(
    tokenizer, world_meta: dict[str, dict], name_words: list[str], count: int, seed: int, split: str = "demo"
) -> list[Example]:
    """Synthetic recall drills: `filler name filler name ... cue name`, loss on the last name.

    Each drill lists 3-4 names of distinct types, then a cue word (" city", " person", ...) and repeats the name of
    that type. Why: answering a toy question is copying the one name of the asked type from a passage; in whole
    demonstrations those few name tokens are ~10 % of the loss and the copy circuit did not form in 1,200 steps
    (measured: 0.8 % of validation name pieces right), while on these drills it forms in ~100 steps.

    The drilled names are *fresh combinations* of the pieces of `split` names (a first name with another last name,
    a city stem with another suffix), never a name of another split's entity. Why: drilled on real names, the model
    completed a name's second piece from memory (a stem with the suffix it was trained with) instead of copying it,
    and unseen validation names came out with a familiar wrong suffix (measured). No facts are drilled.
    """
    rng = random.Random(seed)
    pieces = _name_pieces(world_meta, name_words, split)
    types = sorted(pieces)
    if len(types) < 2:
        raise ValueError(f"recall_examples: the world needs {split}-split entities of at least two types")
    taken = {name for name, entity in world_meta.items() if entity["split"] != split}
    filler = tokenizer.encode(_DRILL_FILLER, add_special_tokens=False)
    examples = []
    for _ in range(count):
        chosen = rng.sample(types, min(4, len(types)))
        names = {kind: _fresh_name(rng, *pieces[kind], taken) for kind in chosen}
        tokens: list[int] = []
        for kind in chosen:
            tokens += [rng.choice(filler) for _ in range(rng.randint(1, 4))]
            tokens += tokenizer.encode(" " + names[kind], add_special_tokens=False)
        asked = rng.choice(chosen)
        tokens += [rng.choice(filler)] + tokenizer.encode(_TYPE_CUE[asked], add_special_tokens=False)
        answer = tokenizer.encode(" " + names[asked], add_special_tokens=False)
        examples.append((tokens + answer, [0.0] * len(tokens) + [1.0] * len(answer)))
    return examples


def _name_pieces(world_meta: dict[str, dict], name_words: list[str], split: str) -> dict[str, tuple[list, list]]:
    """Per entity type: (first pieces, remainders) of its `split` names, e.g. ("Jaros", "ville"), ("Ada", " Bo")."""
    longest_first = sorted(name_words, key=len, reverse=True)
    heads: dict[str, set[str]] = {}
    rests: dict[str, set[str]] = {}
    for name, entity in world_meta.items():
        if entity["split"] != split or entity["type"] not in _TYPE_CUE:
            continue
        head = next((w for w in longest_first if name.startswith(w) and len(w) < len(name)), None)
        if head is not None:
            heads.setdefault(entity["type"], set()).add(head)
            rests.setdefault(entity["type"], set()).add(name[len(head) :])
    return {kind: (sorted(heads[kind]), sorted(rests[kind])) for kind in heads}


def _fresh_name(rng: random.Random, heads: list[str], rests: list[str], taken: set[str]) -> str:
    """A random head + remainder that is not the name of an entity in `taken` (another split's)."""
    for _ in range(100):
        name = rng.choice(heads) + rng.choice(rests)
        if name not in taken:
            return name
    raise ValueError("recall_examples: every name combination belongs to another split; enlarge the name pools")
