"""A benchmark that can fail silently is a check that cannot fail: every script in bench/ ends with
`require_measured`, which exits non-zero (SystemExit with a message on stderr) when a side measured nothing, a figure
is NaN / None / missing, or the run it wraps failed, quoting that run's error (the tail of its log or traceback).

    from _checks import require_measured  # bench/ is on sys.path when a script runs
    require_measured("vs_trl", {"dspo_step_s": report["dspo_step_s"]}, errors={"dspo_nofilter": tail})
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

TAIL_CHARS = 3000  # of each side's error: enough for a traceback's last frames


def missing(value: Any) -> str | None:
    """Why `value` is not a measurement (None, NaN, inf, an empty collection, a non-number), or None when it is one."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return None if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple | dict | set | str):
        return None if value else "empty"
    return None


def flatten(figures: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested results checked figure by figure."""
    flat: dict[str, Any] = {}
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def failures(figures: Mapping[str, Any], errors: Mapping[str, Any] | None = None) -> list[str]:
    """One line per figure that is not a measurement and per side that reported an error."""
    lines = [f"{name} = {why}" for name, value in flatten(figures).items() if (why := missing(value))]
    for side, error in (errors or {}).items():
        if error:
            text = str(error).strip()
            lines.append(f"{side} failed:\n    " + text[-TAIL_CHARS:].replace("\n", "\n    "))
    return lines


def require_measured(
    bench: str, figures: Mapping[str, Any], errors: Mapping[str, Any] | None = None, hint: str = ""
) -> None:
    """Exit non-zero naming every figure of `figures` (nested mappings are walked) that is None, NaN, inf or empty,
    and every side of `errors` whose error is set (its text, tail first cut). Returns quietly when all is measured."""
    found = failures(figures, errors)
    if not found:
        return
    what = hint or "read the error above, fix the code the benchmark runs (or its wrapper in bench/), and rerun"
    raise SystemExit(
        f"bench/{bench}.py FAILED: measured nothing for\n  " + "\n  ".join(found) + f"\nWhat to do: {what}"
    )
