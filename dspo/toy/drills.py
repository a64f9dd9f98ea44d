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
    tokenizer, pieces: dict[str, tuple[list[str], list[str]]], count: int, seed: int, names_per_drill: int = 4
) -> list[Example]:
    """Synthetic recall drills: `filler name filler name ... cue name`, loss on the last name.

    Each drill lists `names_per_drill` names of distinct types, then a cue word (" city", " person", ...) and repeats
    the name of that type. Why: answering a toy question is copying the one name of the asked type from a passage; in
    whole demonstrations those few name tokens are ~10 % of the loss and the copy circuit did not form in 1,200 steps
    (measured: 0.8 % of validation name pieces right). A curriculum of 1, then 2, then 4 names per drill forms it
    fastest (measured: with 4 names from the start, 0 % of drills copied after 300 steps; with 1 name first, 47 % of
    single-name validation drills after 200 steps).

    `pieces` is `dspo.toy.world.name_pieces(files)`: per type, the pieces every name is built from. The drilled
    names are *random combinations* of them (a first name with any last name, a city stem with any city suffix).
    Why all pieces: a piece never drilled has an untrained embedding the model cannot produce (measured: restricted to
    the demo split's names, every validation river name failed). Why random combinations: drilled on real names, the
    model completed a name's second piece from memory instead of copying it (measured). Drills state no facts, so a
    combination that happens to name a validation entity teaches nothing about it: the entity splits stay disjoint
    in everything the warm start learns about entities.
    """
    rng = random.Random(seed)
    pieces = {kind: value for kind, value in pieces.items() if kind in _TYPE_CUE}
    types = sorted(pieces)
    if len(types) < 2:
        raise ValueError("recall_examples: the world needs entities of at least two types")
    if not 1 <= names_per_drill <= len(types):
        raise ValueError(f"recall_examples: names_per_drill={names_per_drill} must be in [1, {len(types)}]")
    filler = tokenizer.encode(_DRILL_FILLER, add_special_tokens=False)
    examples = []
    for _ in range(count):
        chosen = rng.sample(types, names_per_drill)
        names = {kind: rng.choice(pieces[kind][0]) + rng.choice(pieces[kind][1]) for kind in chosen}
        tokens: list[int] = []
        for kind in chosen:
            tokens += [rng.choice(filler) for _ in range(rng.randint(1, 4))]
            tokens += tokenizer.encode(" " + names[kind], add_special_tokens=False)
        asked = rng.choice(chosen)
        tokens += [rng.choice(filler)] + tokenizer.encode(_TYPE_CUE[asked], add_special_tokens=False)
        answer = tokenizer.encode(" " + names[asked], add_special_tokens=False)
        examples.append((tokens + answer, [0.0] * len(tokens) + [1.0] * len(answer)))
    return examples
