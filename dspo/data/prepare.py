"""`dspo-prepare-data`: FlashRAG / Search-R1 sources → the JSON Lines files dspo trains and evaluates on.

Output (in `output_dir`):
- `train.jsonl`: the train splits of the training sources (NQ + HotpotQA, as in Search-R1 and the DSPO paper),
  merged and shuffled with `seed`;
- `test/<benchmark>.jsonl`: one file per evaluation benchmark (the seven of the paper), in source order.

Every row is FlashRAG-shaped (`id`, `question`, `golden_answers`) plus `data_source` (its benchmark), so each file
loads with `dspo.data.qa.load_qa` and keeps track of where a training question came from.

A source is anything `load_qa` reads: a local FlashRAG / Search-R1 / plain file, a folder of `<split>.*` files, or
a hub dataset `owner/name:config` (online, or from `$DSPO_HUB_MIRROR`). Every source is checked before any is read,
so a missing path or mirror stops the command in a second, naming it. `splits` lists the splits to try in order:
Search-R1's test merge takes `test` when a benchmark has one and falls back to `dev` (HotpotQA, 2Wiki, MuSiQue have no
public test answers).
A source holding several benchmarks (Search-R1's merged `test.parquet`, rows tagged `data_source`) is split by
benchmark.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from dspo.data.qa import QADataError, check_source, load_qa
from dspo.types import QAItem

PAPER_BENCHMARKS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")


def load_with_splits(source: str, splits: Sequence[str], limit: int | None = None) -> list[QAItem]:
    """`load_qa` on the first split of `splits` that exists for `source` (a single file ignores the split)."""
    errors = []
    for split in splits:
        try:
            return load_qa(source, limit=limit, split=split)
        except QADataError as error:
            errors.append(str(error))
            # Only a missing split is worth another try; a bad row or schema would fail the same way again.
            if not _is_missing_split(str(error)):
                raise
    raise QADataError(f"{source}: none of the splits {list(splits)} could be loaded: " + " | ".join(errors))


def _is_missing_split(message: str) -> bool:
    return "folder has no" in message or "could not load hub dataset" in message


def normalize_question(question: str, add_question_mark: bool) -> str:
    """Strip; optionally end with '?' as Search-R1's data scripts do for both train and test questions."""
    question = question.strip()
    if add_question_mark and not question.endswith("?"):
        question += "?"
    return question


def write_jsonl(path: Path, items: Sequence[QAItem], add_question_mark: bool) -> None:
    """FlashRAG JSON Lines with a `data_source` column (and `metadata` when an item has any)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for item in items:
            row = {
                "id": item.id,
                "question": normalize_question(item.question, add_question_mark),
                "golden_answers": item.golden_answers,
                "data_source": item.benchmark,
            }
            if item.metadata:
                row["metadata"] = item.metadata
            handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")


def prepare(
    output_dir: str,
    train_sources: Sequence[str],
    test_sources: Sequence[str],
    train_splits: Sequence[str] = ("train",),
    test_splits: Sequence[str] = ("test", "dev"),
    seed: int = 42,
    train_limit: int | None = None,
    test_limit: int | None = None,
    add_question_mark: bool = True,
    overwrite: bool = False,
) -> dict[str, int]:
    """Write `train.jsonl` and `test/<benchmark>.jsonl` under `output_dir`; return {relative file: row count}.

    Training items keep their benchmark in `data_source` and get ids made unique by prefixing it when two sources
    share an id (FlashRAG's NQ and HotpotQA both number rows `train_0`, ...).
    """
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; choose another output_dir or set overwrite=true")
    for source in dict.fromkeys([*train_sources, *test_sources]):  # all at once, before minutes of reading
        check_source(source)
    counts: dict[str, int] = {}
    if train_sources:
        train = [item for source in train_sources for item in load_with_splits(source, train_splits, train_limit)]
        _make_ids_unique(train)
        random.Random(seed).shuffle(train)
        write_jsonl(out / "train.jsonl", train, add_question_mark)
        counts["train.jsonl"] = len(train)
    tests: dict[str, list[QAItem]] = {}
    for source in test_sources:
        for item in load_with_splits(source, test_splits):
            tests.setdefault(item.benchmark, []).append(item)
    for name, items in tests.items():
        items = items if test_limit is None else items[:test_limit]
        write_jsonl(out / "test" / f"{name}.jsonl", items, add_question_mark)
        counts[f"test/{name}.jsonl"] = len(items)
    return counts


def _make_ids_unique(items: list[QAItem]) -> None:
    seen: dict[str, int] = {}
    for item in items:
        seen[item.id] = seen.get(item.id, 0) + 1
    for item in items:
        if seen[item.id] > 1:
            item.id = f"{item.benchmark}_{item.id}"
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        raise QADataError("training sources repeat ids within one benchmark; fix the sources' `id` fields")


def summary(output_dir: str, counts: dict[str, int]) -> str:
    """A printable table of the files written."""
    width = max((len(name) for name in counts), default=4)
    lines = [f"wrote {len(counts)} files to {Path(output_dir).resolve()}", f"{'file':<{width}}  rows"]
    lines += [f"{name:<{width}}  {count:>7,}" for name, count in counts.items()]
    return "\n".join(lines)


EXAMPLE = "dspo-prepare-data output_dir=data/mine 'train_sources=[./raw/nq]' 'test_sources=[./raw/nq]'"


def main() -> None:
    """Hydra entry point `dspo-prepare-data` (config: conf/prepare_data.yaml)."""
    import hydra
    from omegaconf import DictConfig, OmegaConf

    from dspo.process.errors import user_errors

    @hydra.main(
        config_path=str(Path(__file__).resolve().parents[2] / "conf"), config_name="prepare_data", version_base="1.3"
    )
    def _run(cfg: DictConfig) -> None:
        kwargs = OmegaConf.to_container(cfg, resolve=True)
        kwargs.pop("hub", None)  # only an interpolation helper for the source names
        with user_errors("dspo-prepare-data", EXAMPLE):
            counts = prepare(**kwargs)
        print(summary(cfg.output_dir, counts))

    _run()


if __name__ == "__main__":
    main()
