"""The warm-started toy model carried by the repository (`data/toy_warmstart/`), adopted instead of being rebuilt.

Why ship it: the SFT warm start is most of a first run's time on a 2-core CPU (minutes), and a stronger warm start
(one that solves a realistic share of unseen questions, as the paper's instruct models do) needs more SFT than a
15-minute default can spend. So the repository carries the output of `python -m dspo.toy.rebuild`: the toy tokenizer
and the warm-started model, each with the manifest `dspo.toy.warmstart` writes. Those manifests key their content by
digests of the world files and the configs (no paths), so a cached build and a shipped one are interchangeable:
`prepare_toy_default` copies a shipped folder in when its manifest key equals the one it would build, and builds
otherwise (any change to the world, vocabulary or warm-start config). `tests/toy/test_shipped.py` rebuilds the model
with the script and checks it scores like the shipped one.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from dspo.cachedir import staged_folder

log = logging.getLogger(__name__)


def adopt_shipped(
    shipped: str | Path | None, target: str | Path, manifest: str, matches: Callable[[dict], bool]
) -> bool:
    """Copy the folder `shipped` to `target` when `shipped/manifest` satisfies `matches`; True if it was adopted.

    The copy goes to a temporary sibling first and is swapped into place at `target` (`dspo.cachedir.staged_folder`),
    so an interrupted copy never leaves a folder whose manifest looks complete, and a process reading the old `target`
    never finds it missing. Callers hold `target`'s build lock (`dspo.cachedir.build_lock`)."""
    if shipped is None:
        return False
    source = Path(shipped)
    manifest_path = source / manifest
    if not manifest_path.is_file():
        return False
    try:
        recorded = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{manifest_path}: not valid JSON ({error}); restore it with git or rebuild it") from error
    if not matches(recorded):
        log.info("%s does not match this config; building instead", source)
        return False
    with staged_folder(target) as staging:
        shutil.copytree(source, staging, dirs_exist_ok=True)
    log.info("adopted %s into %s (shipped with the repository)", source, target)
    return True
