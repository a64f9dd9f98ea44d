"""A new environment (world): a corpus and questions written by a `prepare` step (docs/extending.md, section 2).

The world: invented ships, each sailing from a home port; each port lies on a coast. One passage per ship and per
port; 1-hop questions ask a ship's home port, 2-hop questions its home port's coast (search the ship, then the port).
Splits use disjoint ships, so answers cannot be memorized from training. Files are in the formats real data uses
(FlashRAG corpus and QA JSON Lines), so dspo's BM25 index, data module and evaluation read them unchanged.

Plugged in by the config files in docs/examples/conf (prepare/ships.yaml, data/ships.yaml, retriever/ships.yaml):

    PYTHONPATH=docs/examples dspo-train 'hydra.searchpath=[file://docs/examples/conf]' \\
        prepare=ships data=ships retriever=ships
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPLITS = ("train", "val", "test")
_SYLLABLES = ["ka", "lo", "mi", "ra", "to", "ve", "su", "an", "dor", "el", "fin", "gar", "hul", "is", "jor", "ny"]
_COASTS = ["North Coast", "Amber Coast", "Salt Coast", "Iron Coast", "Pearl Coast"]


def _names(rng: random.Random, count: int, suffix: str, taken: set[str]) -> list[str]:
    """`count` new invented names (two or three syllables + suffix), none in `taken`."""
    out: list[str] = []
    while len(out) < count:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize() + suffix
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def build_ships_world(root: str, seed: int = 0, num_ports: int = 12, ships_per_split: int = 40) -> str:
    """Write corpus.jsonl and train/val/test.jsonl under `root`; reuse them when built with the same arguments.

    A prepare step runs at every `dspo-train` start, so it must be cached: the arguments are kept in manifest.json.
    """
    out = Path(root)
    manifest = {"seed": seed, "num_ports": num_ports, "ships_per_split": ships_per_split, "version": 1}
    if (out / "manifest.json").is_file() and json.loads((out / "manifest.json").read_text()) == manifest:
        return str(out)
    rng, taken = random.Random(seed), set()
    ports = {port: rng.choice(_COASTS) for port in _names(rng, num_ports, "haven", taken)}
    corpus = [
        {"id": f"port{i}", "contents": f'"{port}"\n{port} is a port on the {coast}.'}
        for i, (port, coast) in enumerate(ports.items())
    ]
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        rows = []
        for i, ship in enumerate(_names(rng, ships_per_split, "", taken)):
            port = rng.choice(sorted(ports))
            ship = f"The {ship}"
            corpus.append({"id": f"{split}-ship{i}", "contents": f'"{ship}"\n{ship} is a ship. It sails from {port}.'})
            if i % 2:  # 2-hop: ship -> port -> coast
                question, answer, hops = f"On which coast is the home port of {ship}?", ports[port], 2
            else:
                question, answer, hops = f"From which port does {ship} sail?", port, 1
            row = {"id": f"ships-{split}-{i}", "question": question, "golden_answers": [answer]}
            rows.append({**row, "metadata": {"hops": hops}})
        _write_jsonl(out / f"{split}.jsonl", rows)
    _write_jsonl(out / "corpus.jsonl", corpus)
    (out / "manifest.json").write_text(json.dumps(manifest))  # last: a half-written world is rebuilt next time
    return str(out)
