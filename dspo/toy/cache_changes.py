"""Why the toy warm start is rebuilt, and for how long: the line a run prints before a rebuild.

Why: the warm start (`dspo.toy.warmstart`) is cached by a key of its config, world and tokenizer, and the config's
`agent` keys follow the run's own `rollout.agent.*` and `env.tools.search.topk` (experiment=toy), so that
demonstrations look like rollouts. An innocent override (`rollout.agent.max_turns=4`) therefore changes the key and
starts a ~10 minute SFT on a 2-core CPU, which used to be announced by one line that named neither the cause nor the
cost. Every build's manifest records its inputs (`config`: every field; `key`: the world and tokenizer digests) and
its timings (`stats`), so the new config can be compared with what the cached and the shipped builds were made
from: the nearest of them (fewest differences) names the keys that changed, and its timings give the expected
duration.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

CONFIG_KEY = "prepare.toyworld.config"  # where the warm start's config lies in every conf/prepare/toyworld*.yaml
# cores the shipped builds' timings were measured on (their manifests predate `stats.cores`): the 2-core CPU
SHIPPED_CORES = 2
IGNORED = ("torch_threads",)  # speed only: not in the key (dspo.toy.warmstart.config_key)


def read_manifest(folder: str | Path | None, name: str) -> dict | None:
    """`folder/name` as a dict; None when there is none or it is not readable JSON (then nothing is compared)."""
    if folder is None:
        return None
    path = Path(folder) / name
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: node}


def config_changes(wanted: dict, recorded: dict, defaults: dict[str, Any]) -> list[str]:
    """`prepare.toyworld.config.<key> (old -> new)` for each config value that differs; `defaults` stands in for a
    field the recorded build predates."""
    new, old = _flat(wanted), _flat({**defaults, **recorded})
    keys = sorted(k for k in set(new) | set(old) if k.split(".")[0] not in IGNORED)
    missing = object()
    return [
        f"{CONFIG_KEY}.{key} ({old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r})"
        for key in keys
        if new.get(key, missing) != old.get(key, missing)
    ]


def key_changes(wanted: dict, config: dict, manifest: dict, defaults: dict[str, Any]) -> list[str]:
    """What differs between the build `wanted` (its key) from `config` and the one `manifest` records."""
    recorded_key = manifest.get("key") or {}
    changes = config_changes(config, manifest.get("config") or {}, defaults)
    if not changes and wanted.get("config") != recorded_key.get("config"):
        changes.append(f"{CONFIG_KEY}.init_model's weights (or dspo's warm-start recipe)")
    if wanted.get("world") != recorded_key.get("world"):
        changes.append("the toy world's files (prepare.toyworld.world_config)")
    if wanted.get("tokenizer") != recorded_key.get("tokenizer"):
        changes.append("the tokenizer (prepare.toyworld.vocab_size, or the world)")
    return changes


def sft_steps(config: dict) -> int:
    """The SFT steps a warm-start config trains: every recall drill stage's, then the demonstrations'."""
    return sum(int(steps) for _, steps in config.get("recall_curriculum") or []) + int(config.get("steps") or 0)


def expected_seconds(manifest: dict, config: dict) -> tuple[float, int] | None:
    """(seconds, cores) a build of `config` should take: what the recorded build took (rendering + SFT), its SFT part
    scaled by the ratio of SFT steps. None when the manifest has no timings."""
    stats = manifest.get("stats") or {}
    render, train = stats.get("render_seconds"), stats.get("train_seconds")
    recorded_steps = sft_steps(manifest.get("config") or {})
    if render is None or train is None or not recorded_steps:
        return None
    seconds = float(render) + float(train) * sft_steps(config) / recorded_steps
    return seconds, int(stats.get("cores") or SHIPPED_CORES)


def rebuild_notice(
    wanted: dict, config: dict, candidates: dict[str, dict | None], defaults: dict[str, Any]
) -> tuple[str, float | None]:
    """(the line said before a rebuild, the expected seconds or None): the nearest recorded build of `candidates`
    (label -> manifest) and the keys this build differs from it in, with the expected duration."""
    compared = {label: key_changes(wanted, config, m, defaults) for label, m in candidates.items() if m}
    if not compared:
        return "no earlier build recorded to compare with (a new cache)", None
    label = min(compared, key=lambda name: len(compared[name]))
    changes = compared[label]
    text = f"it differs from {label} in " + ", ".join(changes)
    if any(f"{CONFIG_KEY}.agent." in change for change in changes):
        text += " (the warm start's agent keys follow rollout.agent.* and env.tools.search.topk: experiment=toy)"
    expected = expected_seconds(candidates[label], config)
    if expected is None:
        return text, None
    seconds, cores = expected
    return f"about {math.ceil(seconds / 60)} min on a {cores}-core CPU: {text}", seconds
