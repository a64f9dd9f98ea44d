"""QA datasets → `QAItem`s, through Hugging Face `datasets`.

Three row schemas are recognised from a file's columns:

- **FlashRAG** (`id`, `question`, `golden_answers`): the seven evaluation benchmarks and the NQ / HotpotQA train splits.
- **Search-R1** (`prompt` chat list or string, `reward_model.ground_truth.target`, `data_source`): the parquet files of
  Search-R1's `scripts/data_process/*.py`. Those keep FlashRAG's `question` column when it exists; otherwise the
  question is recovered from the prompt's text after its last `Question:`.
- **plain** (`question` + `answer` or `answers`).

A source is a local file (`.jsonl`, `.json`, `.parquet`), a local folder holding `<split>.jsonl|json|parquet`, or a
Hugging Face hub dataset written `owner/name` or `owner/name:config` (e.g. `RUC-NLPIR/FlashRAG_datasets:nq`): fetched
when the machine is online, or read from `$DSPO_HUB_MIRROR/owner/name` when that local snapshot of the hub repository
exists (offline clusters; the tests use it with files in the hub repositories' own layouts). The benchmark of an item
is the `benchmark` argument, else the row's `data_source`, else the file's stem (the folder's name, the hub config).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dspo.types import QAItem

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_MIRROR_VAR = "DSPO_HUB_MIRROR"
log = logging.getLogger(__name__)


class QADataError(ValueError):
    """A QA source cannot be read or a row lacks a field; the message names the source, the row and the field."""


def load_qa(path: str, benchmark: str | None = None, limit: int | None = None, split: str = "train") -> list[QAItem]:
    """Load one QA source as `QAItem`s (the first `limit` rows when given).

    `split` selects the split of a hub dataset or the `<split>.*` file of a local folder; a single local file is read
    whole whatever `split` says.
    """
    if limit is not None and limit < 0:
        raise QADataError(f"limit must be >= 0 or None, got {limit} (source {path})")
    dataset, default_benchmark = _open(str(path), split)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    columns = set(dataset.column_names)
    schema = _detect_schema(columns, path)
    items = [_row_to_item(row, index, schema, path, benchmark, default_benchmark) for index, row in enumerate(dataset)]
    return _drop_blank_golds(items, path)


def _drop_blank_golds(items: list[QAItem], source: str) -> list[QAItem]:
    """Gold answers that normalize to the empty string (`*`, `---`) never match (`dspo.metrics`): drop them, and the
    questions left without a gold, so that neither reward nor evaluation ever scores against them; say how many."""
    from dspo.metrics import normalize_answer

    kept, dropped_golds, dropped_items = [], 0, 0
    for item in items:
        golds = [gold for gold in item.golden_answers if normalize_answer(gold)]
        dropped_golds += len(item.golden_answers) - len(golds)
        if not golds:
            dropped_items += 1
            continue
        item.golden_answers = golds
        kept.append(item)
    if dropped_golds:
        log.warning(
            "%s: dropped %d gold answer(s) that normalize to the empty string (e.g. '*') and skipped %d question(s) "
            "left without a gold answer; %d questions kept",
            source,
            dropped_golds,
            dropped_items,
            len(kept),
        )
    return kept


def load_benchmarks(
    files: Mapping[str, str] | None = None,
    limit: int | None = None,
    path: str | None = None,
    benchmark: str | None = None,
    root: str | None = None,
) -> dict[str, list[QAItem]]:
    """Evaluation sets keyed by benchmark name, each cut to its first `limit` items.

    `files` maps a benchmark name to its source (the name overrides any `data_source` in the rows); relative file
    names resolve against `root` when given (e.g. root=data/nq_hotpotqa/test, files={nq: nq.jsonl}). `path` instead
    loads one source and groups its items by benchmark (file stem, or each row's `data_source` for a Search-R1 test
    file holding several benchmarks); `path` wins over `files` so that `dspo-eval data.path=FILE` needs nothing else.
    """
    if path:
        items = load_qa(path, benchmark=benchmark)
        grouped: dict[str, list[QAItem]] = {}
        for item in items:
            grouped.setdefault(item.benchmark, []).append(item)
        if limit is not None:
            grouped = {name: group[:limit] for name, group in grouped.items()}
        return grouped
    if not files:
        raise QADataError(
            "load_benchmarks: give `files` ({benchmark: path}) or `path` (config key data.files/data.path)"
        )
    base = Path(root).expanduser() if root else None
    return {
        name: load_qa(str(base / source) if base is not None else source, benchmark=name, limit=limit)
        for name, source in files.items()
    }


def _open(source: str, split: str) -> tuple[Any, str]:
    """(datasets.Dataset, default benchmark name) for a local file, a local folder or a hub name."""
    import datasets  # imported lazily: `datasets` costs ~1 s at import and most callers never need it

    local = Path(source).expanduser()
    if local.is_dir():
        local = _split_file(local, split)
    if local.is_file():
        builder = _BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise QADataError(f"{local}: unsupported file type {local.suffix!r}; use one of {sorted(_BUILDERS)}")
        bars_were_on = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # one "Generating train split" bar per small file is noise
        try:
            dataset = datasets.load_dataset(builder, data_files=str(local), split="train")
        except Exception as error:  # datasets raises many types (ArrowInvalid, DatasetGenerationError, ...)
            raise QADataError(f"{local}: could not read as {builder}: {type(error).__name__}: {error}") from error
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
        name = local.parent.name if local.stem in ("train", "test", "dev", "validation") else local.stem
        return dataset, name
    return _open_hub(source, split)


def _split_file(folder: Path, split: str) -> Path:
    for suffix in _BUILDERS:
        candidate = folder / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    raise QADataError(f"{folder}: folder has no {split}.jsonl, {split}.json or {split}.parquet (split={split!r})")


def _open_hub(source: str, split: str) -> tuple[Any, str]:
    """Hub dataset `owner/name[:config]`; refused with a clear message when it cannot be a hub name or when offline."""
    import datasets

    name, _, config = source.partition(":")
    looks_like_hub = name.count("/") == 1 and not Path(name).suffix and not name.startswith((".", "/", "~"))
    if not looks_like_hub:
        raise QADataError(
            f"{source}: no such file or folder (relative paths resolve against {Path.cwd()}); "
            "give a .jsonl/.json/.parquet file, a folder with <split>.* files, or a hub name owner/name[:config]"
        )
    location = _hub_location(name)
    offline = any(os.environ.get(var, "0").lower() in ("1", "true", "yes") for var in _OFFLINE_VARS)
    if offline and location == name:
        raise QADataError(
            f"{source}: looks like a Hugging Face hub dataset, but the machine is offline "
            f"({'/'.join(_OFFLINE_VARS)} set); download it elsewhere and pass the local file, or set "
            f"{_MIRROR_VAR}=DIR to a folder holding {name}/ as downloaded from the hub"
        )
    try:
        # One call for the hub and a mirror: `datasets` reads a repository's README `configs:` the same way in both.
        dataset = datasets.load_dataset(location, config or None, split=split)
    except Exception as error:
        raise QADataError(f"{source}: could not load hub dataset from {location} (split={split!r}): {error}") from error
    return dataset, config or name.split("/")[-1]


def _hub_location(name: str) -> str:
    """`$DSPO_HUB_MIRROR/owner/name` when that folder exists (a hub snapshot, e.g. `hf download --repo-type dataset
    owner/name --local-dir MIRROR/owner/name` on a machine that has network), else the hub name itself."""
    mirror = os.environ.get(_MIRROR_VAR)
    if mirror:
        local = Path(mirror).expanduser() / name
        if local.is_dir():
            return str(local)
    return name


def _detect_schema(columns: set[str], source: str) -> str:
    if "golden_answers" in columns and "question" in columns:
        return "flashrag"
    if "reward_model" in columns and ("prompt" in columns or "question" in columns):
        return "search_r1"
    if "question" in columns and ({"answer", "answers"} & columns):
        return "plain"
    raise QADataError(
        f"{source}: cannot tell the schema from columns {sorted(columns)}; expected FlashRAG (id, question, "
        "golden_answers), Search-R1 (prompt, reward_model.ground_truth.target, data_source) or plain "
        "(question, answer|answers)"
    )


def _row_to_item(
    row: dict, index: int, schema: str, source: str, benchmark: str | None, default_benchmark: str
) -> QAItem:
    where = f"{source} row {index}"
    if schema == "search_r1":
        question = row.get("question") or _question_from_prompt(row.get("prompt"), where)
        golds = _search_r1_target(row.get("reward_model"), where)
    else:
        question = row.get("question")
        golds = row.get("golden_answers") if schema == "flashrag" else _first_present(row, ("answers", "answer"))
        golds = _as_answers(golds, where, "golden_answers" if schema == "flashrag" else "answer(s)")
    if not isinstance(question, str) or not question.strip():
        raise QADataError(f"{where}: missing or empty field 'question'")
    name = benchmark or row.get("data_source") or default_benchmark
    item_id = row.get("id")
    if item_id is None:
        extra = row.get("extra_info") or {}
        item_id = f"{name}_{extra.get('index', index) if isinstance(extra, dict) else index}"
    metadata = dict(row["metadata"]) if isinstance(row.get("metadata"), dict) else {}
    if isinstance(row.get("extra_info"), dict):
        metadata.setdefault("extra_info", row["extra_info"])
    return QAItem(
        id=str(item_id), question=question.strip(), golden_answers=golds, benchmark=str(name), metadata=metadata
    )


def _first_present(row: dict, keys: Sequence[str]) -> Any:
    return next((row[key] for key in keys if row.get(key) is not None), None)


def _as_answers(value: Any, where: str, field: str) -> list[str]:
    """A gold answer or list of them → non-empty list of strings (numbers become strings, blanks are dropped)."""
    if value is None:
        raise QADataError(f"{where}: missing field '{field}'")
    values = [value] if isinstance(value, str | int | float) else list(value)
    answers = [str(v).strip() for v in values if v is not None and str(v).strip()]
    if not answers:
        raise QADataError(f"{where}: field '{field}' has no non-empty answer ({value!r})")
    return answers


def _search_r1_target(reward_model: Any, where: str) -> list[str]:
    field = "reward_model.ground_truth.target"
    if not isinstance(reward_model, dict) or not isinstance(reward_model.get("ground_truth"), dict):
        raise QADataError(f"{where}: missing field '{field}'")
    return _as_answers(reward_model["ground_truth"].get("target"), where, field)


def _question_from_prompt(prompt: Any, where: str) -> str:
    """The user's text of a Search-R1 prompt, cut after its last `Question:` (Search-R1 prefixes an instruction)."""
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt:
        user = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        text = user[-1] if user else ""
    else:
        raise QADataError(f"{where}: missing field 'prompt' (and no 'question' column)")
    return text.rpartition("Question:")[2].strip()
