"""Where a benchmark writes its JSON: the user's `outputs/bench/` (relative to the working directory, like
`dspo-train`'s `outputs/`), never the repository's tracked `bench/results/` unless asked with `--update-shipped`
(those files are the numbers bench/README.md and the README quote)."""

from __future__ import annotations

import argparse
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_DIR = Path("outputs") / "bench"


def add_output_arguments(parser: argparse.ArgumentParser, name: str, flag: str = "--out") -> None:
    """`flag` (a JSON path) and `--update-shipped` (write bench/results/`name`, the tracked result)."""
    parser.add_argument(
        flag, type=Path, default=None, help=f"JSON to write (default: {DEFAULT_DIR / name} in the working directory)"
    )
    parser.add_argument(
        "--update-shipped",
        action="store_true",
        help=f"write bench/results/{name}, the tracked numbers the READMEs quote (only when re-measuring them)",
    )


def output_path(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str, flag: str = "--out") -> Path:
    """The JSON path the parsed `args` ask for; an explicit path and `--update-shipped` together are refused."""
    given = getattr(args, flag.lstrip("-").replace("-", "_"))
    if args.update_shipped and given is not None:
        parser.error(f"{flag} and --update-shipped both name the output; give one")
    if args.update_shipped:
        return SHIPPED_DIR / name
    return Path(given) if given is not None else DEFAULT_DIR / name


def provenance() -> dict:
    """What a measurement was taken on: the commit, the files that differed from it (bench/results/ and outputs/ aside:
    a re-measurement writes there) and whether any of them is source (documentation, *.md, does not count), when, and
    the machine's load just before (a busy machine skews timings). The cited-numbers test
    (tests/bench/test_cited_numbers.py) refuses a quoted figure whose file lacks this or was measured on changed
    source."""
    import datetime
    import os
    import subprocess

    root = SHIPPED_DIR.parents[1]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", ".", ":(exclude)bench/results", ":(exclude)outputs")
    changed = None if status is None else [line[3:] for line in status.splitlines() if line.strip()]
    return {
        "commit": (git("rev-parse", "HEAD") or "").strip() or None,
        "changed_paths": changed,
        "source_changed": None if changed is None else any(not path.endswith(".md") for path in changed),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
