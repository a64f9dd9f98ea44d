"""QA datasets → `QAItem`s, through Hugging Face `datasets`.

Three row schemas are recognised from a file's columns:

- **FlashRAG** (`id`, `question`, `golden_answers`): the seven evaluation benchmarks and the NQ / HotpotQA train splits.
- **Search-R1** (`prompt` chat list or string, `reward_model.ground_truth.target`, `data_source`): the parquet files of
  Search-R1's `scripts/data_process/*.py`. Those keep FlashRAG's `question` column when it exists; otherwise the
  question is recovered from the prompt's text after its last `Question:`.
- **plain** (`question` + `answer` or `answers`).

A source is a local file (`.jsonl`, `.json`, `.parquet`), a local folder holding `<split>.jsonl|json|parquet`, or a
Hugging Face hub dataset written `owner/name` or `owner/name:config` (e.g. `RUC-NLPIR/FlashRAG_datasets:nq`): fetched
when the machine is online, or, when `$DSPO_HUB_MIRROR` is set, read from the local snapshot of the hub repository at
`$DSPO_HUB_MIRROR/owner/name` and nowhere else (offline clusters; the tests use it with files in the hub repositories'
own layouts). The benchmark of an item is the `benchmark` argument, else the row's `data_source`, else the file's stem
(the folder's name, the hub config).

A source that does not exist locally is a hub name only when it cannot be a path (`looks_like_path`); a missing path,
a missing mirror and an unreachable hub are each reported at once, before `datasets` starts its network retries.
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
# Suffixes that make a name a file, never a hub repository (hub names may hold dots, e.g. `owner/squad_v1.1`)
_FILE_SUFFIXES = {*_BUILDERS, ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip", ".tar"}
_HUB_CHECK_TIMEOUT_S = 5.0  # one request, no retries: an unreachable hub answers in this time, not in ~30 s


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
    check_source(source)  # a missing path or mirror is known without `datasets` and without the network
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


def looks_like_path(source: str) -> bool:
    """Whether a source that does not exist locally can only have meant a local path, never a hub name.

    A path: starts with `.`, `/` or `~`; ends in a file suffix (`.jsonl`, `.parquet`, ...); has no `/` or more than one;
    or its first component is a local folder (`raw/nq` when `./raw/` exists). Otherwise (`owner/name[:config]` with no
    local `owner/`) it is a hub name.
    """
    name = source.partition(":")[0]
    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") != 1:
        return True
    owner, _, repo = name.partition("/")
    return not owner or not repo or Path(name).suffix.lower() in _FILE_SUFFIXES or Path(owner).is_dir()


def check_source(source: str) -> None:
    """Raise QADataError at once when `source` is a local path that does not exist, or a hub name that
    `$DSPO_HUB_MIRROR` (when set) cannot hold; `dspo-prepare-data` checks every source this way before reading any."""
    if Path(source).expanduser().exists():
        return
    if looks_like_path(source):
        raise QADataError(_not_found(source))
    _hub_location(source.partition(":")[0], source)


def _not_found(source: str) -> str:
    path = Path(source).expanduser().absolute()
    # What the folder above holds, when it exists: the usual mistake is a misspelled or not yet downloaded name
    held = sorted(p.name for p in path.parent.iterdir())[:8] if path.parent.is_dir() else []
    listing = f"; {path.parent} holds: {', '.join(held) or 'nothing'}" if path.parent.is_dir() else ""
    return (
        f"not found: {path} (source {source!r}, relative to {Path.cwd()}){listing}. Give a .jsonl/.json/.parquet file, "
        "a folder with <split>.* files, or a hub name owner/name[:config]"
    )


def _open_hub(source: str, split: str) -> tuple[Any, str]:
    """Hub dataset `owner/name[:config]`, from `$DSPO_HUB_MIRROR` when set, else from the hub after one quick check
    that it answers and has the dataset."""
    import datasets

    name, _, config = source.partition(":")
    location = _hub_location(name, source)
    if location == name:
        _check_hub(name, source)
    try:
        # One call for the hub and a mirror: `datasets` reads a repository's README `configs:` the same way in both.
        dataset = datasets.load_dataset(location, config or None, split=split)
    except Exception as error:
        raise QADataError(f"{source}: could not load hub dataset from {location} (split={split!r}): {error}") from error
    return dataset, config or name.split("/")[-1]


def _hub_location(name: str, source: str) -> str:
    """`$DSPO_HUB_MIRROR/owner/name` when the variable is set (a hub snapshot, e.g. `hf download --repo-type dataset
    owner/name --local-dir MIRROR/owner/name` on a machine that has network), else the hub name itself. A set mirror
    is the only place looked at: a missing mirror or snapshot is an error, not a reason to try the network."""
    mirror = os.environ.get(_MIRROR_VAR)
    if not mirror:
        return name
    root = Path(mirror).expanduser().absolute()
    if not root.is_dir():
        raise QADataError(
            f"{source}: {_MIRROR_VAR}={mirror} does not exist ({root} is not a folder); point it at the folder that "
            f"holds owner/name/ hub snapshots, or unset it to use the hub. {_no_local_path(name)}"
        )
    local = root / name
    if not local.is_dir():
        raise QADataError(
            f"{source}: {_MIRROR_VAR} has no snapshot of {name} (looked for the folder {local}); download it there "
            f"with `hf download --repo-type dataset {name} --local-dir {local}`. {_no_local_path(name)}"
        )
    return str(local)


def _no_local_path(name: str) -> str:
    return f"No local path {Path(name).absolute()} exists either (a local folder is written ./{name})."


def _check_hub(name: str, source: str) -> None:
    """Refuse a hub name when offline, when the hub does not answer, or when it has no such dataset: one request with
    a short timeout, where `datasets` would retry for ~30 s and then name neither the path nor the mirror."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    mirror_hint = f"or set {_MIRROR_VAR}=DIR to a folder holding {name}/ as downloaded from the hub"
    # the variables as they are now, and huggingface_hub's own flag (read once, when it was imported)
    offline = any(os.environ.get(var, "0").lower() in ("1", "true", "yes") for var in _OFFLINE_VARS)
    if offline or getattr(constants, "HF_HUB_OFFLINE", False):
        raise QADataError(
            f"{source}: looks like a Hugging Face hub dataset, but the machine is offline ({'/'.join(_OFFLINE_VARS)} "
            f"set). {_no_local_path(name)} Download it elsewhere and pass the local file, {mirror_hint}"
        )
    try:
        HfApi().dataset_info(name, timeout=_HUB_CHECK_TIMEOUT_S)
    except GatedRepoError:
        return  # it exists; `datasets` says what access it needs
    except OfflineModeIsEnabled as error:
        raise QADataError(f"{source}: the hub is in offline mode ({error}). {_no_local_path(name)}") from error
    except RepositoryNotFoundError as error:
        raise QADataError(
            f"{source}: the Hugging Face hub has no dataset {name} (or it is private: log in with `hf auth login`). "
            f"{_no_local_path(name)}"
        ) from error
    except HfHubHTTPError:
        return  # the hub answered (e.g. a 5xx): leave it to `datasets` and its retries
    except Exception as error:  # DNS, refused connection, timeout: the hub cannot be reached
        raise QADataError(
            f"{source}: the Hugging Face hub ({constants.ENDPOINT}) cannot be reached "
            f"({type(error).__name__}: {error}). {_no_local_path(name)} Pass a local file or folder, {mirror_hint}"
        ) from error


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
