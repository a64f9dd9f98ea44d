"""The passages of an index, read from disk on demand: `passages.jsonl` plus a byte-offset table.

A 21M-passage corpus is ~14 GB of text, ~40 GB as Python objects: an index at that scale cannot hold its passages in
memory. `PassageStore` memory-maps `passages.jsonl` (one `{"id", "title", "text"}` object per line, written by dspo)
and `passages.offsets.npy` (int64 [N + 1], the byte where line i starts; the last entry is the file size), so
fetching the top-k hits of a query reads k lines, and several server processes share the same page cache.
Indexes written before the offset table existed get it computed on load (one pass over the file, 64 MiB at a time).
"""

from __future__ import annotations

import hashlib
import json
import mmap
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from dspo.types import Passage

PASSAGES = "passages.jsonl"
OFFSETS = "passages.offsets.npy"
_SCAN_BYTES = 64 * 2**20


def passage_line(p: Passage) -> bytes:
    """The canonical stored form of one passage (also what the corpus digest hashes)."""
    return (json.dumps({"id": p.id, "title": p.title, "text": p.text}, ensure_ascii=False) + "\n").encode("utf-8")


class PassageWriter:
    """Appends passages to `passages.jsonl`, recording line offsets and a running SHA-256 of the bytes written."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._handle: BinaryIO = (directory / PASSAGES).open("wb")
        self._offsets = array("q", [0])  # 8 bytes a passage (a list of ints would cost ~36)
        self._position = 0
        self.sha256 = hashlib.sha256()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def write(self, p: Passage) -> None:
        line = passage_line(p)
        self._handle.write(line)
        self.sha256.update(line)
        self._position += len(line)
        self._offsets.append(self._position)

    def close(self) -> str:
        """Flush the file and the offset table; returns the hex digest of the passages' bytes."""
        self._handle.close()
        np.save(self.directory / OFFSETS, np.frombuffer(self._offsets, dtype=np.int64))
        return self.sha256.hexdigest()


def write_passages(directory: Path, passages: Iterable[Passage]) -> str:
    """Write all `passages` to `directory`; returns the SHA-256 of `passages.jsonl`."""
    writer = PassageWriter(directory)
    for p in passages:
        writer.write(p)
    return writer.close()


def scan_offsets(path: Path) -> tuple[np.ndarray, str]:
    """Line offsets [N + 1] and SHA-256 of an existing `passages.jsonl` (for indexes that predate the table)."""
    ends: list[np.ndarray] = []
    digest, position = hashlib.sha256(), 0
    with path.open("rb") as handle:
        while block := handle.read(_SCAN_BYTES):
            digest.update(block)
            ends.append(np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10) + position + 1)
            position += len(block)
    offsets = np.concatenate([np.zeros(1, dtype=np.int64), *[e.astype(np.int64) for e in ends]])
    return offsets, digest.hexdigest()


class PassageStore:
    """Read-only, random-access passages of an index directory; `store[i]` is the i-th passage (score 0)."""

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        self.path = path / PASSAGES
        if (path / OFFSETS).is_file():
            self.offsets = np.load(path / OFFSETS, mmap_mode="r")
            self._sha256: str | None = None
        else:
            self.offsets, self._sha256 = scan_offsets(self.path)
        size = self.path.stat().st_size
        if int(self.offsets[-1]) != size:
            raise ValueError(f"{path / OFFSETS} ends at byte {self.offsets[-1]}, {self.path} has {size}; rebuild")
        self._file = self.path.open("rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int | slice) -> Passage | list[Passage]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"passage {i} out of range (index has {len(self)})")
        i %= len(self)
        rec = json.loads(self._map[int(self.offsets[i]) : int(self.offsets[i + 1])])
        return Passage(rec["id"], rec["title"], rec["text"])

    def __iter__(self) -> Iterator[Passage]:
        for i in range(len(self)):
            yield self[i]

    def __getstate__(self) -> dict:
        return {"directory": str(self.path.parent)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"])

    def sha256(self) -> str:
        """SHA-256 of `passages.jsonl` (computed once; cheap only for indexes that did not store it)."""
        if self._sha256 is None:
            self._sha256 = scan_offsets(self.path)[1]
        return self._sha256
