"""User mistakes end a command with one or two lines, not a traceback (every dspo CLI).

A wrong path, a missing config value, a refused setting or a file that exists already is the user's to fix, and the
message dspo raises already says what and where; a 25-line Hydra traceback above it hides that line. `user_errors`
turns such an error into `<command>: error: <message>` plus an example of a right call on stderr, exit status 2.
What counts as a user mistake:

- configuration errors raised while Hydra builds objects (`InstantiationException`: the cause's message, which names
  the key) and missing or unresolvable config values (OmegaConf's errors, which name the full key);
- `ValueError`, `FileNotFoundError`, `FileExistsError`, `NotADirectoryError`, `KeyError`, `ImportError` raised by
  dspo's own code (they are its validation errors; the same types raised inside torch or another library are bugs to
  report and keep their stack);
- dspo's run-stopping faults whose message says what to do (`SamplingExhausted`, `RetrieverUnavailableError`,
  `NonFiniteTraining`).

`DSPO_VERBOSE=1` or Hydra's `HYDRA_FULL_ERROR=1` shows the full stack instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent)
_DSPO_TYPES = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, KeyError, ImportError)
_DSPO_FAULTS = ("SamplingExhausted", "RetrieverUnavailableError", "NonFiniteTraining")


def _show_stack() -> bool:
    return any(os.environ.get(var, "0") not in ("", "0") for var in ("DSPO_VERBOSE", "HYDRA_FULL_ERROR"))


def _raised_in_dspo(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE)


def user_message(error: BaseException) -> str | None:
    """The one-paragraph message of a user mistake, None when `error` is not one (a bug: keep its stack)."""
    from hydra.errors import InstantiationException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    if isinstance(error, InstantiationException):
        cause = error.__cause__ or error.__context__
        inner = user_message(cause) if cause is not None else None
        return inner or str(cause or error).strip()
    if isinstance(error, MissingMandatoryValue):
        key = getattr(error, "full_key", None) or "a value"
        return f"{key} is not set (it is ??? in the config): pass {key}=..."
    if isinstance(error, OmegaConfBaseException):
        key = getattr(error, "full_key", None)
        first = str(error).strip().splitlines()[0]
        return f"{first} (config key {key})" if key and key not in first else first
    if type(error).__name__ in _DSPO_FAULTS or (isinstance(error, _DSPO_TYPES) and _raised_in_dspo(error)):
        text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        return str(text).strip()
    return None


@contextlib.contextmanager
def user_errors(command: str, example: str) -> Iterator[None]:
    """Run a command's body; a user mistake (module docstring) prints `command: error: ...` and an example call on
    stderr and exits with status 2. Other exceptions propagate with their stack."""
    try:
        yield
    except Exception as error:
        message = None if _show_stack() else user_message(error)
        if message is None:
            raise
        print(f"{command}: error: {message}", file=sys.stderr)
        print(f"  e.g. {example}   (DSPO_VERBOSE=1 shows the stack)", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
