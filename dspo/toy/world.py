"""Synthetic multi-hop world for the embedded CPU default: invented entities, one passage each, 1- and 2-hop questions.

Why a synthetic world: nothing pretrained can be downloaded here, so the default task must be learnable from scratch
in minutes and must *need* the search tool. Every name is invented (so no prior knowledge helps), and the train,
validation, test and demo splits are built from disjoint entity sets (so answers cannot be memorized from training).

Why a fourth, `demo` split (common RL setups warm-start and train RL on the same questions): the SFT warm start's
scripted demonstrations use only demo entities. A tiny model memorizes the facts of the questions it is fine-tuned
on, so RL on those same questions would reward recalling memorized answers, a skill that cannot transfer to unseen
entities. With disjoint demo entities, RL's training questions are as new to the warm-started model as validation
ones, and what RL reinforces (searching the right entity, reading the passage, doing both hops) is what validation
measures.

Files are written in the formats real data uses (FlashRAG QA JSON Lines and a FlashRAG corpus), so the same loaders,
BM25 index and evaluation code run on them. `world.json` keeps the structured facts for the scripted demonstrations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspo.cachedir import build_lock, write_atomically
from dspo.metrics import normalize_answer
from dspo.toy.deep import DEEP_HOPS, deep_demo_questions, deep_files, deep_questions

log = logging.getLogger(__name__)
FORMAT_VERSION = 6  # bump when the generated text changes, so cached worlds are rebuilt
MANIFEST = "manifest.json"  # written last: records the config hash of a finished world
SPLITS = ("train", "val", "test", "demo")  # demo: entities only the warm-start demonstrations use
HOP_SPLITS = ("val", "test")  # also written per question type (val_1hop.jsonl, ...): benchmarks toy_1hop / toy_2hop
# (3- and 4-hop files beside them, on a random stream of their own: dspo.toy.deep, benchmarks toy_3hop / toy_4hop)
# Which entity type a relation points to (the demonstrations' plausible wrong guesses, env=two_sources' hop sources)
ANSWER_TYPE = {"born_in": "city", "founded_by": "person", "country": "country", "capital": "city", "city": "city"}
ANSWER_TYPE |= {"person": "person"}  # a landmark's patron or designer (3-/4-hop chains, dspo.toy.deep)

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kl", "l", "m", "n", "p", "pr", "r", "s", "st", "t", "tr", "v"]
_ONSETS += ["z", "th", "sh", "j", "h"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ae", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "x", "m", "nd", "rk"]
# One word pool per name slot; a name is `pool word + suffix` (people: first + last). The pools are disjoint, so every
# name piece says what it is part of (see _Namer).
_POOLS = ("first", "last", "city", "country", "company", "river", "landmark")
_SUFFIX = {
    "country": ["ia", "land", "stan", "ora", "avia"],
    "city": ["burg", "ton", "holm", "port", "ville", "dale"],
    "company": [" Corp", " Industries", " Labs", " Systems", " Group", " Works"],
    "river": [" River"],
    "landmark": [" Tower", " Bridge", " Festival", " Museum", " Stadium"],
}
_OCCUPATIONS = ["painter", "engineer", "chemist", "poet", "architect", "sailor", "judge", "composer", "banker"]

# Passage sentence templates per fact; one variant is drawn per passage (ToyWorldConfig.template_variants). No passage
# names two entities of the same type besides its subject (a company names its founder but not also its CEO), so a
# fact is read by the *type* of the name that states it (see _Namer).
_TEMPLATES = {
    "person.born_in": ["{name} was born in {born_in}.", "Born in {born_in}, {name} grew up there."],
    "person.occupation": ["{name} works as a {occupation}.", "By profession, {name} is a {occupation}."],
    "company.founded_by": ["{name} was founded by {founded_by} in {year}.", "{founded_by} founded {name} in {year}."],
    "company.staff": ["It employs about {staff} people."],
    "city.country": ["{name} is a city in {country}.", "{name} is located in the country of {country}."],
    "city.population": ["It has about {population} inhabitants."],
    "country.capital": ["The capital of {name} is {capital}.", "{capital} is the capital city of {name}."],
    "river.city": ["The {name} flows through {city}.", "The city of {city} lies on the {name}."],
    "river.length": ["It is {length} kilometres long."],
    "landmark.place": ["The {name} stands in {city}. It was designed by {person}."],
    "landmark.event": ["The {name} is held every year in {city}; its patron is {person}."],
}

# (relations followed, question templates). The first entity's name is always in the question text.
_QUESTIONS = {
    ("person", "born_in"): ["In which city was {e} born?", "Where was {e} born?"],
    ("company", "founded_by"): ["Who founded {e}?", "Who is the founder of {e}?"],
    ("city", "country"): ["In which country is {e} located?", "{e} is a city in which country?"],
    ("country", "capital"): ["What is the capital of {e}?"],
    ("river", "city"): ["Which city does the {e} flow through?"],
    ("company", "founded_by", "born_in"): ["In which city was the founder of {e} born?"],
    ("person", "born_in", "country"): ["In which country was {e} born?"],
    ("river", "city", "country"): ["In which country does the {e} flow?"],
}


@dataclass
class ToyWorldConfig:
    """Sizes are totals over all splits; `split_fractions` divides every entity type between train/val/test/demo."""

    seed: int = 0
    num_countries: int = 24
    cities_per_country: int = 4
    num_people: int = 800
    num_companies: int = 240
    num_rivers: int = 36
    num_distractors: int = 160
    split_fractions: tuple[float, float, float, float] = (0.3, 0.15, 0.15, 0.4)  # train, val, test, demo
    num_train: int = 600
    num_val: int = 200
    num_test: int = 200
    num_demo: int = 800  # questions the warm start turns into scripted demonstrations
    hop2_fraction: float = 0.5
    # Sentence variants per fact. 1 = only the first wording ("X was founded by Y"); 2 adds a second one per fact
    # ("Y founded X"). Facts are read by the type of their names, so wording matters less, but 1 is what was measured.
    template_variants: int = 1
    name_pool_size: int = 50  # words per pool (first names, last names, city stems, ...), shared by all splits

    def __post_init__(self) -> None:
        fractions = tuple(self.split_fractions)
        if len(fractions) != len(SPLITS) or min(fractions) <= 0 or abs(sum(fractions) - 1.0) > 1e-6:
            raise ValueError(
                f"ToyWorldConfig.split_fractions must be {len(SPLITS)} positive shares {SPLITS} summing to 1, "
                f"got {self.split_fractions}"
            )
        self.split_fractions = fractions


@dataclass
class ToyWorldFiles:
    """Paths of one built world. QA files are FlashRAG JSON Lines; `meta` is world.json (facts for demonstrations)."""

    root: str
    train: str
    val: str
    test: str
    corpus: str
    meta: str
    demo: str = ""  # demo.jsonl: questions over the demo entities (warm-start demonstrations only)
    extra: dict = field(default_factory=dict)  # "val_1hop", "test_2hop", ...: the HOP_SPLITS per question type


def config_hash(config: ToyWorldConfig) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, **asdict(config)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class _Namer:
    """Entity names built from shared pools of invented words; no full name is a substring of another, so subEM
    cannot match a wrong entity.

    Why pools: every split draws its names from the same word pools (the *entities* and their facts stay disjoint
    between splits). A validation name is then a new combination of words the tokenizer and the model have seen in
    training; with per-entity invented words, validation names consist of tokens never trained, which a small model
    cannot produce (measured: 0% val subEM after SFT).

    Why one pool per slot (first names, last names, city stems, country stems, ...): the toy tokenizer makes every
    pool word one id, so an id tells the type of the name it belongs to, and no passage names two entities of one type
    besides its subject. Reading a fact is then "copy the city-stem id in the passage", which a 3-layer model learns
    in minutes from recall drills plus the demonstrations (dspo.toy.warmstart). With names that share pieces across
    types, reading needs induction heads (copy what follows a key phrase); measured: a 3-layer model copied 1.5 % of
    validation name pieces after 1,200 SFT steps, and formed no induction heads in 800 steps of a synthetic copy task.
    """

    def __init__(self, rng: random.Random, pool_size: int) -> None:
        self.rng = rng
        self.used: set[str] = set()
        self.pieces: set[str] = set()  # every substring of every pool word
        self.pools = {kind: [self.word(2) for _ in range(pool_size)] for kind in _POOLS}
        self.names: set[str] = set()

    def word(self, syllables: int) -> str:
        for _ in range(1000):
            parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables)]
            w = ("".join(parts) + self.rng.choice(_CODAS)).lower()
            subs = {w[i:j] for i in range(len(w)) for j in range(i + 1, len(w) + 1)}
            if len(w) >= 4 and w not in self.pieces and not subs & self.used:
                self.used.add(w)
                self.pieces |= subs
                return w.capitalize()
        raise RuntimeError("toyworld: ran out of unique words; lower ToyWorldConfig.name_pool_size")

    def _candidate(self, kind: str) -> str:
        if kind == "person":
            return f"{self.rng.choice(self.pools['first'])} {self.rng.choice(self.pools['last'])}"
        return self.rng.choice(self.pools[kind]) + self.rng.choice(_SUFFIX[kind])

    def name(self, kind: str) -> str:
        for _ in range(10_000):
            name = self._candidate(kind)
            low = name.lower()
            if not any(low in other or other in low for other in self.names):
                self.names.add(low)
                return name
        raise RuntimeError("toyworld: ran out of unique names; raise ToyWorldConfig.name_pool_size")


def _split_sizes(total: int, fractions: tuple[float, ...]) -> list[int]:
    """Per-split counts in SPLITS order: every split but train gets its rounded share (at least 1), train the rest."""
    others = [max(1, round(total * f)) for f in fractions[1:]]
    if total - sum(others) < 1:
        raise ValueError(f"toyworld: {total} entities of a type cannot fill {len(fractions)} splits; raise the count")
    return [total - sum(others), *others]


def _make_entities(cfg: ToyWorldConfig, rng: random.Random, namer: _Namer, split: str, share: int) -> dict:
    """Entities of one split (`share` indexes split_fractions). Relations only point inside the split."""
    n = {k: _split_sizes(v, cfg.split_fractions)[share] for k, v in _counts(cfg).items()}
    ents: dict[str, dict] = {}

    def add(kind: str, **facts) -> str:
        name = namer.name(kind)
        ents[name] = {"type": kind, "split": split, **facts}
        return name

    countries = [add("country") for _ in range(n["countries"])]
    cities = []
    for country in countries:
        local = [
            add("city", country=country, population=rng.randrange(5, 900) * 1000) for _ in range(cfg.cities_per_country)
        ]
        ents[country]["capital"] = local[0]
        cities += local
    people = [
        add("person", born_in=rng.choice(cities), occupation=rng.choice(_OCCUPATIONS)) for _ in range(n["people"])
    ]
    for _ in range(n["companies"]):
        add("company", founded_by=rng.choice(people), year=rng.randrange(1850, 2020), staff=rng.randrange(2, 900) * 10)
    for _ in range(n["rivers"]):
        add("river", city=rng.choice(cities), length=rng.randrange(40, 3000))
    for _ in range(n["distractors"]):
        add("landmark", city=rng.choice(cities), person=rng.choice(people))
    return ents


def _counts(cfg: ToyWorldConfig) -> dict[str, int]:
    return {
        "countries": cfg.num_countries,
        "people": cfg.num_people,
        "companies": cfg.num_companies,
        "rivers": cfg.num_rivers,
        "distractors": cfg.num_distractors,
    }


def _sentence(rng: random.Random, variants: int, key: str, **slots) -> str:
    return rng.choice(_TEMPLATES[key][: max(1, variants)]).format(**slots)


def _passage(rng: random.Random, name: str, e: dict, variants: int) -> str:
    """The entity's passage text: its facts, one template variant each, in a shuffled order after the first."""
    kind = e["type"]
    if kind == "person":
        facts = [_sentence(rng, variants, "person.born_in", name=name, born_in=e["born_in"])]
        facts.append(_sentence(rng, variants, "person.occupation", name=name, occupation=e["occupation"]))
    elif kind == "company":
        facts = [_sentence(rng, variants, "company.founded_by", name=name, founded_by=e["founded_by"], year=e["year"])]
        facts.append(_sentence(rng, variants, "company.staff", staff=f"{e['staff']:,}"))
    elif kind == "city":
        facts = [_sentence(rng, variants, "city.country", name=name, country=e["country"])]
        facts.append(_sentence(rng, variants, "city.population", population=f"{e['population']:,}"))
    elif kind == "country":
        facts = [_sentence(rng, variants, "country.capital", name=name, capital=e["capital"])]
    elif kind == "river":
        facts = [
            _sentence(rng, variants, "river.city", name=name, city=e["city"]),
            _sentence(rng, variants, "river.length", length=e["length"]),
        ]
    else:
        key = "landmark.event" if name.endswith("Festival") else "landmark.place"
        facts = [_sentence(rng, variants, key, name=name, city=e["city"], person=e["person"])]
    head, tail = facts[:1], facts[1:]
    rng.shuffle(tail)
    return " ".join(head + tail)


def _questions(ents: dict, rng: random.Random, split: str, n_total: int, hop2_fraction: float) -> list[dict]:
    """Distinct (entity, relation path) questions, `hop2_fraction` of them 2-hop, in a seeded random order."""
    pools: dict[int, list[dict]] = {1: [], 2: []}
    for name, e in ents.items():
        for path, templates in _QUESTIONS.items():
            if path[0] != e["type"]:
                continue
            chain, value = [name], name
            for rel in path[1:]:
                value = ents[value][rel]
                chain.append(value)
            hops = len(path) - 1
            question = rng.choice(templates).format(e=name)
            meta = {"hops": hops, "chain": chain[:-1], "relations": list(path[1:]), "entity_type": e["type"]}
            pools[hops].append({"question": question, "golden_answers": [value], "metadata": meta})
    n2 = round(n_total * hop2_fraction)
    want = {1: n_total - n2, 2: n2}
    out = []
    for hops, pool in pools.items():
        if want[hops] > len(pool):
            raise ValueError(
                f"toyworld: split '{split}' asks for {want[hops]} {hops}-hop questions but its entities only support "
                f"{len(pool)}; raise the entity counts in ToyWorldConfig or lower num_{split}/hop2_fraction"
            )
        out += rng.sample(pool, want[hops])
    rng.shuffle(out)
    for i, q in enumerate(out):
        q["id"] = f"toy-{split}-{i}"
    return [{"id": q["id"], **{k: v for k, v in q.items() if k != "id"}} for q in out]


def generate_world(
    config: ToyWorldConfig,
) -> tuple[dict[str, dict], list[dict], dict[str, list[dict]], list[str], dict[str, list[str]]]:
    """Pure generation (no files): (entities by name, corpus rows, questions per split, name words, name pools).
    Deterministic in the seed. The name words (the shared pools, by slot: first, last, city, ...) are what every entity
    name is built from; the toy tokenizer makes each of them one id."""
    rng = random.Random(config.seed)
    namer = _Namer(rng, config.name_pool_size)
    ents: dict[str, dict] = {}
    for share, split in enumerate(SPLITS):
        ents.update(_make_entities(config, rng, namer, split, share))
    contents = [f'"{name}"\n{_passage(rng, name, e, config.template_variants)}' for name, e in ents.items()]
    rng.shuffle(contents)  # passage ids do not reveal the entity type or split
    corpus = [{"id": f"toy{i}", "contents": c} for i, c in enumerate(contents)]
    sizes = {"train": config.num_train, "val": config.num_val, "test": config.num_test, "demo": config.num_demo}
    split_ents = {s: {k: v for k, v in ents.items() if v["split"] == s} for s in SPLITS}
    qa = {s: _questions(split_ents[s], rng, s, sizes[s], config.hop2_fraction) for s in SPLITS}
    words = sorted({w for pool in namer.pools.values() for w in pool})
    return ents, corpus, qa, words, namer.pools


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    write_atomically(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _files(root: Path) -> ToyWorldFiles:
    per_hop = {f"{s}_{h}hop": str(root / f"{s}_{h}hop.jsonl") for s in HOP_SPLITS for h in (1, 2)}
    per_hop |= deep_files(root)  # val_3hop ... test_4hop, train_deep (dspo.toy.deep)
    per_hop["seeds"] = str(root / "seeds.jsonl")  # experiment=toy_selfplay's topics (train_seeds)
    return ToyWorldFiles(
        root=str(root),
        train=str(root / "train.jsonl"),
        val=str(root / "val.jsonl"),
        test=str(root / "test.jsonl"),
        corpus=str(root / "corpus.jsonl"),
        meta=str(root / "world.json"),
        demo=str(root / "demo.jsonl"),
        extra=per_hop,
    )


def build_toyworld(output_dir: str, config: ToyWorldConfig | None = None, overwrite: bool = False) -> ToyWorldFiles:
    """Write the world to `output_dir` (train/val/test/demo.jsonl, corpus.jsonl, world.json, manifest.json).

    Idempotent: when manifest.json records the same config hash and every file exists, nothing is regenerated.
    Processes building one world at once (the ranks of a node) take turns on its build lock (`dspo.cachedir`): one
    writes it, the others then find its manifest and use it. Each file is replaced by a rename, so a reader never finds
    one missing or half written.
    """
    config = config or ToyWorldConfig()
    root = Path(output_dir).expanduser().resolve()
    files = _files(root)
    digest = config_hash(config)
    if not overwrite and _world_is_built(files, digest):
        return files
    with build_lock(root):
        if not overwrite and _world_is_built(files, digest):  # another process built it while this one waited
            return files
        _write_world(files, config, digest)
    log.info("toy world: built %s", root)
    return files


def _world_paths(files: ToyWorldFiles) -> list[str]:
    return [files.train, files.val, files.test, files.demo, files.corpus, files.meta, *files.extra.values()]


def _world_is_built(files: ToyWorldFiles, digest: str) -> bool:
    """Whether `files.root` holds a finished world of the config hashed to `digest`."""
    manifest = Path(files.root) / MANIFEST
    if not manifest.exists() or not all(Path(p).exists() for p in _world_paths(files)):
        return False
    return json.loads(manifest.read_text()).get("config_hash") == digest


def _write_world(files: ToyWorldFiles, config: ToyWorldConfig, digest: str) -> None:
    root = Path(files.root)
    manifest = root / MANIFEST
    root.mkdir(parents=True, exist_ok=True)
    # first, a manifest that matches no config (rather than none: the path never goes missing), and the real one last:
    # a crash mid-build never leaves a valid-looking cache
    write_atomically(manifest, json.dumps({"config_hash": None, "unfinished": "a build started and has not ended"}))
    ents, corpus, qa, words, pools = generate_world(config)
    for split in SPLITS:
        _write_jsonl(Path(getattr(files, split)), qa[split])
    for split in HOP_SPLITS:  # the same questions, one file per question type (1-hop, 2-hop)
        for hops in (1, 2):
            rows = [q for q in qa[split] if q["metadata"]["hops"] == hops]
            _write_jsonl(Path(files.extra[f"{split}_{hops}hop"]), rows)
    _write_jsonl(Path(files.corpus), corpus)
    _write_deep(files, ents, corpus, qa["train"], config.seed)
    _write_jsonl(Path(files.extra["seeds"]), train_seeds(ents, config.seed))
    meta = {"entities": ents, "name_words": words, "name_pools": pools}
    write_atomically(Path(files.meta), json.dumps(meta, ensure_ascii=False))
    stats = {s: len(qa[s]) for s in SPLITS} | {"passages": len(corpus)}
    write_atomically(manifest, json.dumps({"config_hash": digest, "config": asdict(config), "stats": stats}, indent=2))


def _write_deep(files: ToyWorldFiles, ents: dict, corpus: list[dict], train: list[dict], seed: int) -> None:
    """The 3-/4-hop files (dspo.toy.deep), drawn on their own random stream: the files above stay as they were."""
    deep = deep_questions(ents, corpus, seed)
    for split in ("val", "test"):
        for hops in DEEP_HOPS:
            rows = [q for q in deep[split] if q["metadata"]["hops"] == hops]
            _write_jsonl(Path(files.extra[f"{split}_{hops}hop"]), rows)
    mixed = train + deep["train"]  # experiment=toy_deep trains on 1-4 hops
    random.Random(f"toyworld-deep-train-{seed}").shuffle(mixed)
    _write_jsonl(Path(files.extra["train_deep"]), mixed)
    _write_jsonl(Path(files.extra["demo_deep"]), deep_demo_questions(ents, corpus, seed))  # the deep warm start's


def train_seeds(ents: dict, seed: int) -> list[dict]:
    """Search self-play's topics (experiment=toy_selfplay): the train split's pages that a question can be asked
    about (every entity type but the landmarks), one row each, in a seeded order. The QA format needs a gold answer, so
    `golden_answers` holds the topic itself: the proposer's reward never reads it (`dspo.env.proposals`)."""
    asked = {path[0] for path in _QUESTIONS}
    names = sorted(name for name, e in ents.items() if e["split"] == "train" and e["type"] in asked)
    random.Random(f"toyworld-seeds-{seed}").shuffle(names)
    return [
        {
            "id": f"toy-seed-{i}",
            "question": name,
            "golden_answers": [name],
            "metadata": {"topic_type": ents[name]["type"]},
        }
        for i, name in enumerate(names)
    ]


def load_world_meta(files: ToyWorldFiles | str) -> dict[str, dict]:
    """Entities by name (facts + split) from world.json; `files` is a ToyWorldFiles or the world.json path."""
    path = Path(files.meta if isinstance(files, ToyWorldFiles) else files)
    if not path.exists():
        raise FileNotFoundError(f"toyworld meta {path} not found; build the world with build_toyworld(output_dir)")
    return json.loads(path.read_text())["entities"]


def load_name_words(files: ToyWorldFiles) -> list[str]:
    """The invented words every entity name is built from (world.json `name_words`), sorted."""
    return json.loads(Path(files.meta).read_text())["name_words"]


def name_pieces(files: ToyWorldFiles) -> dict[str, tuple[list[str], list[str]]]:
    """Per entity type: (first pieces, remainders) any name of that type is built from, e.g. city: (every city stem,
    ["burg", "ton", ...]), person: (every first name, [" " + every last name]). Random combinations of them are
    well-formed names (dspo.toy.drills, dspo.toy.renaming); most are no entity of the world."""
    pools = json.loads(Path(files.meta).read_text())["name_pools"]
    pieces = {"person": (pools["first"], [" " + w for w in pools["last"]])}
    for kind in ("city", "country", "company", "river", "landmark"):
        pieces[kind] = (pools[kind], list(_SUFFIX[kind]))
    return {kind: (sorted(heads), sorted(rests)) for kind, (heads, rests) in pieces.items()}


def answer_in_text(answer: str, text: str) -> bool:
    """subEM-style containment (normalized), used by checks that a gold answer is stated somewhere in the corpus."""
    return normalize_answer(answer) in normalize_answer(text)
