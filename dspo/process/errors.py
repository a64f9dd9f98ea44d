"""User mistakes end a command with one or two lines, not a traceback (every dspo CLI).

A wrong path, a missing config value, a refused setting or a file that exists already is the user's to fix, and the
message dspo raises already says what and where; a 25-line Hydra traceback above it hides that line. `user_errors`
turns such an error into `<command>: error: <message>` plus an example of a right call on stderr, exit status 2.
What counts as a user mistake (everything else is a bug, in dspo or in a plug-in, and keeps its stack, which names
the line to fix):

- `ValueError`, `TypeError`, `FileNotFoundError`, `FileExistsError`, `NotADirectoryError`, `KeyError`,
  `ImportError` that dspo's own code raises with a `raise` statement (its validation errors, which name the key or
  file). The same types raised by an expression in dspo (`mapping[key]`, `int(text)`), or inside torch or another
  library, are bugs;
- missing or unresolvable config values (OmegaConf's errors, which name the full key) and Hydra's own configuration
  errors (composition, overrides);
- while Hydra builds objects (`InstantiationException`): a target that cannot be found (a module or name that does
  not exist), arguments the target does not take (a `TypeError` raised by the call itself, not inside the target),
  Hydra's own config errors, and the user mistakes above raised by the target. Any other exception of a constructor,
  an `AttributeError` in a plug-in's `__init__` say, is a bug and keeps its stack;
- dspo's run-stopping faults whose message says what to do (`SamplingExhausted`, `RetrieverUnavailableError`,
  `NonFiniteTraining`).

`DSPO_VERBOSE=1` or Hydra's `HYDRA_FULL_ERROR=1` shows the full stack instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep
_HYDRA = str(Path(importlib.util.find_spec("hydra").origin).parent) + os.sep
_DSPO_TYPES = (ValueError, TypeError, FileNotFoundError, FileExistsError, NotADirectoryError, KeyError, ImportError)
_DSPO_FAULTS = ("SamplingExhausted", "RetrieverUnavailableError", "NonFiniteTraining")


def _show_stack() -> bool:
    return any(os.environ.get(var, "0") not in ("", "0") for var in ("DSPO_VERBOSE", "HYDRA_FULL_ERROR"))


def _last_frame(error: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(error.__traceback__)
    return frames[-1] if frames else None


def _raised_by_dspo(error: BaseException) -> bool:
    """Raised by a `raise` statement of dspo's code: its validation, not a failing expression."""
    frame = _last_frame(error)
    return frame is not None and frame.filename.startswith(_PACKAGE) and (frame.line or "").startswith("raise")


def _raised_by_hydra(error: BaseException) -> bool:
    """Raised by Hydra's instantiation code itself or by the import machinery it calls (not inside a target)."""
    frame = _last_frame(error)
    return frame is not None and (frame.filename.startswith(_HYDRA) or frame.filename.startswith("<frozen importlib"))


def _root(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _instantiation_message(error: BaseException) -> str | None:
    """The message of a Hydra instantiation error that is a configuration mistake (module docstring), else None."""
    cause = error.__cause__
    if cause is None:  # Hydra's own check of the config (no callable target, a bad _args_, ...)
        return str(error).strip()
    if str(error).startswith("Error locating target"):  # a name that does not exist, or a module that fails
        root = _root(cause)
        missing_name = isinstance(root, AttributeError) and _raised_by_hydra(root)
        return str(cause).strip() if isinstance(root, ModuleNotFoundError) or missing_name else None
    inner = user_message(cause)
    if inner is not None:
        return inner
    if isinstance(cause, TypeError) and _raised_by_hydra(cause):  # the call's own arguments: an unknown/missing key
        return str(error).strip()
    return None


def user_message(error: BaseException) -> str | None:
    """The one-paragraph message of a user mistake, None when `error` is not one (a bug: keep its stack)."""
    from hydra.errors import HydraException, InstantiationException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    if isinstance(error, InstantiationException):
        return _instantiation_message(error)
    if isinstance(error, MissingMandatoryValue):
        key = getattr(error, "full_key", None) or "a value"
        return f"{key} is not set (it is ??? in the config): pass {key}=..."
    if isinstance(error, OmegaConfBaseException):
        key = getattr(error, "full_key", None)
        first = str(error).strip().splitlines()[0]
        return f"{first} (config key {key})" if key and key not in first else first
    if isinstance(error, HydraException):  # composition and override errors: the config's, named by Hydra
        return str(error).strip()
    if type(error).__name__ in _DSPO_FAULTS or (isinstance(error, _DSPO_TYPES) and _raised_by_dspo(error)):
        text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        return str(text).strip()
    return None


def _unwrapped(error: BaseException) -> BaseException:
    """The exception a target raised, out of Hydra's `InstantiationException`: Hydra prints that wrapper as one line
    (its message holds only the inner exception's repr), so the line of the bug would be lost. The wrapper's message
    (the target and config key) becomes a note."""
    from hydra.errors import InstantiationException

    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        lines = [line.strip() for line in str(error).splitlines() if line.startswith(("Error", "full_key"))]
        inner = error.__cause__
        inner.add_note(f"(raised while Hydra built an object: {' '.join(lines)})")
        inner.__suppress_context__ = True  # re-raised inside the handler: the wrapper is not the context to show
        error = inner
    return error


@contextlib.contextmanager
def user_errors(command: str, example: str) -> Iterator[None]:
    """Run a command's body; a user mistake (module docstring) prints `command: error: ...` and an example call on
    stderr and exits with status 2. Other exceptions propagate with their stack."""
    try:
        yield
    except Exception as error:
        message = None if _show_stack() else user_message(error)
        if message is None:
            bug = _unwrapped(error)
            if bug is error:
                raise
            raise bug  # noqa: B904  the wrapper is noted on it; its traceback is what to read
        print(f"{command}: error: {message}", file=sys.stderr)
        print(f"  e.g. {example}   (DSPO_VERBOSE=1 shows the stack)", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
