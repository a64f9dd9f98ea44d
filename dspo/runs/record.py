"""What a trained model carries: the settings of the run that trained it, and their adoption by the other commands.

A policy is only as good as the environment it learned: the tag format of its tool calls, its turn and token limits,
the top-k and the index it learned to search, the questions it was tested on. A model evaluated with other settings
scores as if it had learned nothing (a Search-R1-tagged toy model under the default Qwen tool-call prompt never
searches: 0.0). So `dspo-train` writes the resolved config sections of the run (not the YAML files: every
interpolation resolved, paths absolute) into every checkpoint (`checkpoint["dspo"]["run"]`) and into the exported
model folder (`dspo_run.json`), and `dspo-eval` / `dspo-rollout` adopt them when given such a model or checkpoint:

- `rollout.agent`: the record's agent; a key given on the command line (`rollout.agent.max_turns=5`) is applied on top
  of it, with a warning that names the key and the trained value;
- `rollout.engine`: the record's engine, unless the command line picks another (`rollout=hf`); its keys likewise;
- `env`: the record's environment, unless the command line picks another (`env=ikea`); its keys likewise, at any
  depth (`env.tools.search.topk=3`, with a warning). It is recorded resolved but for its `${retriever...}`, so its
  search tool follows the retriever the command ends up with;
- `retriever`, `data`: the record's, unless the command line touches the group or any key of it (then the command
  line's whole section: `retriever=remote retriever.url=...`, `data=file data.path=...`);
- the evaluation batch size, unless `eval.batch_size` is given (it only changes numerics, not which questions).

Records of older dspo versions are read in today's terms (`translated`): moved targets renamed, the agent's old tool
limits (`rollout.agent.topk`, ...) put where the environment read them.

A model folder without `dspo_run.json` (any Hugging Face model) keeps the command's own defaults.

A record is data, never code (`dspo.runs.trust`): it may name only the `_target_`s dspo ships (or those of the command
line's `imports=`), anything else is refused before anything is built; its `trust_remote_code: true` is not adopted.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

RECORD_FILE = "dspo_run.json"
FORMAT = 1
# The agent settings a model is trained for: an override that changes one is warned about by name.
AGENT_KEYS_THAT_MATTER = (
    "tag_format",
    "max_turns",
    "max_new_tokens_per_turn",
    "max_obs_tokens",
    "max_total_tokens",
    "system_prompt",
    "overflow",
)
# Targets that moved, as older records name them (issue 41: the agent loop and the engines left dspo.rollout).
MOVED_TARGETS = {
    "dspo.rollout.agent.AgentConfig": "dspo.agent.tool_calling.ToolCallingAgent",
    "dspo.rollout.agent.SearchAgent": "dspo.agent.tool_calling.ToolCallingAgent",
    "dspo.rollout.engine.VLLMEngine": "dspo.engines.VLLMEngine",
    "dspo.rollout.engine.HFEngine": "dspo.engines.HFEngine",
    "dspo.rollout.scripted.ScriptedEngine": "dspo.engines.ScriptedEngine",
    # the package split into subsystem folders (issue 71; docs/architecture.md has the old -> new table)
    "dspo.module.DSPOModule": "dspo.training.module.DSPOModule",
    "dspo.module.OptimizerConfig": "dspo.training.module.OptimizerConfig",
    "dspo.strategies.FSDP2Strategy": "dspo.training.strategies.FSDP2Strategy",
    "dspo.loggers.mlflow_logger": "dspo.training.loggers.mlflow_logger",
    "dspo.checkpointing.AtomicCheckpointIO": "dspo.training.checkpoint_io.AtomicCheckpointIO",
}

log = logging.getLogger(__name__)


def _section(cfg: DictConfig, key: str, resolve: bool = True) -> Any:
    node = OmegaConf.select(cfg, key, default=None)
    return OmegaConf.to_container(node, resolve=resolve) if isinstance(node, DictConfig) else node


def run_record(cfg: DictConfig) -> dict[str, Any]:
    """The record of a training run's composed config `cfg` (plain containers: checkpoints load weights_only)."""
    from dspo import __version__

    return {
        "format": FORMAT,
        "dspo_version": __version__,
        "run_dir": str(Path(str(cfg.output_dir)).resolve()),
        "run_name": str(cfg.get("run_name", "")),
        "config": {
            "rollout": _section(cfg, "rollout"),
            "retriever": _section(cfg, "retriever"),
            # resolved but for its `${retriever...}`, which then follows what the evaluating command adopted or was
            # given (retriever=remote ... reaches the adopted environment's search tool)
            "env": env_section(cfg),
            "data": _section(cfg, "data"),
            "eval_batch_size": OmegaConf.select(cfg, "callbacks.rollout.eval_batch_size", default=None),
            "algorithm": {
                "name": OmegaConf.select(cfg, "algorithm.name", default=None),
                "temperature": OmegaConf.select(cfg, "algorithm.temperature", default=None),
            },
            "model": {"path": OmegaConf.select(cfg, "model.path", default=None)},
        },
    }


def env_section(cfg: DictConfig) -> Any:
    """The `env` node with every value resolved except the interpolations of the retriever (`${retriever}`,
    `${retriever.corpus}`): the run's tool limits (the toy's `toy.topk`, ...) are recorded as they were."""
    node = OmegaConf.select(cfg, "env", default=None)
    if not isinstance(node, DictConfig):
        return node
    written = OmegaConf.to_container(node, resolve=False)

    def resolved(value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {key: resolved(inner, f"{path}.{key}") for key, inner in value.items()}
        if isinstance(value, list):
            return [resolved(inner, f"{path}[{index}]") for index, inner in enumerate(value)]
        if isinstance(value, str) and "${" in value and "${retriever" not in value:
            found = OmegaConf.select(cfg, path, throw_on_missing=False)
            return OmegaConf.to_container(found, resolve=True) if OmegaConf.is_config(found) else found
        return value

    return resolved(written, "env")


def with_index(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record plus `index`: the identity (digest, path, backend, size) of the in-process index its retriever
    names, read from that index's manifest; unchanged for a remote retriever or an index without a digest (built
    before digests existed). Added when a checkpoint or model is written: the index may be built on first use."""
    retriever = (record.get("config") or {}).get("retriever")
    path = retriever.get("index") if isinstance(retriever, Mapping) else None
    if record.get("index") or not isinstance(path, str):
        return dict(record)
    from dspo.search.bm25 import read_manifest

    manifest = read_manifest(path) or {}
    if "digest" not in manifest:
        return dict(record)
    keys = ("digest", "backend", "num_passages", "k1", "b")
    return {**record, "index": {"path": str(Path(path).resolve()), **{key: manifest.get(key) for key in keys}}}


def index_mismatch(record: Mapping[str, Any] | None, retriever: object) -> str | None:
    """A warning when `retriever` is not the index the recorded run trained with (None when they match or either
    side cannot tell: no record, a record without an index, a remote retriever)."""
    trained = (record or {}).get("index") or {}
    used = getattr(retriever, "digest", None)
    if not trained.get("digest") or used is None or used == trained["digest"]:
        return None
    return (
        f"the model was trained with the index {trained['digest']} ({trained.get('path')}, {trained.get('backend')}, "
        f"{trained.get('num_passages')} passages) but is evaluated on {used}: another corpus, analyzer, k1/b or "
        "backend, so its scores are not comparable with the training run's (set retriever.index to the trained one)"
    )


def write_record(model_dir: str | Path, record: Mapping[str, Any], step: int | None = None) -> Path:
    """`dspo_run.json` in an exported model folder (with the training step it was exported at)."""
    path = Path(model_dir) / RECORD_FILE
    path.write_text(json.dumps({**with_index(record), "step": step}, indent=1) + "\n", encoding="utf-8")
    return path


def read_model_record(model_dir: str | Path) -> dict[str, Any] | None:
    """The record of a model folder, None for a folder without one (a plain Hugging Face model)."""
    path = Path(model_dir).expanduser() / RECORD_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable dspo run record ({error}); delete it to use the defaults") from error
    return _checked(record, str(path))


def checkpoint_record(checkpoint: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """The record a dspo checkpoint carries (`checkpoint["dspo"]["run"]`), None for older or foreign checkpoints."""
    record = (checkpoint.get("dspo") or {}).get("run")
    return None if record is None else _checked(record, where)


def _checked(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ValueError(f"{where}: not a dspo run record (no 'config' mapping)")
    if int(record.get("format", 0)) > FORMAT:
        raise ValueError(f"{where}: record format {record.get('format')} is newer than this dspo reads ({FORMAT})")
    return {**record, "config": translated(record["config"])}


def translated(config: dict[str, Any]) -> dict[str, Any]:
    """A record's config in today's terms: moved `_target_`s renamed (`MOVED_TARGETS`), and an agent of the days
    when it held the tool limits (`rollout.agent.topk`, ...) split: its limits stay the agent's, the moved ones
    replace the environment's `${rollout.agent.<key>}` interpolations (as the run resolved them)."""
    from dspo.agent.config import MOVED_TO_ENV

    config = renamed_targets(copy.deepcopy(config))
    agent = (config.get("rollout") or {}).get("agent")
    if not isinstance(agent, dict):
        return config
    moved = {key: agent.pop(key) for key in list(agent) if key in MOVED_TO_ENV}
    if agent.get("_target_") == MOVED_TARGETS["dspo.rollout.agent.AgentConfig"]:
        agent["_partial_"] = True  # a constructor now, completed with the engine, tokenizer and environment
    if moved and config.get("env") is not None:
        config["env"] = _substituted(config["env"], {f"${{rollout.agent.{k}}}": v for k, v in moved.items()})
    return config


def renamed_targets(value: Any) -> Any:
    """`value` with every `_target_` that moved (`MOVED_TARGETS`) named as today, at any depth."""
    if isinstance(value, dict):
        return {
            key: MOVED_TARGETS.get(inner, inner) if key == "_target_" else renamed_targets(inner)
            for key, inner in value.items()
        }
    if isinstance(value, list):
        return [renamed_targets(inner) for inner in value]
    return value


def _substituted(value: Any, values: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        return {key: _substituted(inner, values) for key, inner in value.items()}
    if isinstance(value, list):
        return [_substituted(inner, values) for inner in value]
    return values.get(value, value) if isinstance(value, str) else value


def override_keys(overrides: Iterable[str]) -> list[str]:
    """The config keys or groups a Hydra command line sets (`retriever=remote` -> `retriever`, `+a.b=1` -> `a.b`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))]


def _touched(keys: list[str], prefix: str) -> list[str]:
    return [k for k in keys if k == prefix or k.startswith(prefix + ".")]


def adopt(
    cfg: DictConfig,
    record: Mapping[str, Any],
    overrides: Iterable[str],
    source: str,
    sections: Iterable[str],
    imports: Sequence[str] = (),
) -> list[str]:
    """Put the record's `sections` (of rollout.agent, rollout.engine, retriever, data, eval.batch_size) into `cfg`,
    following the rules of the module docstring; returns the lines to show the user (what came from where, and a
    warning per agent setting that differs from the trained one). A section naming a target that neither dspo nor the
    modules `imports` ship is refused (`dspo.runs.trust.UntrustedRecordError`) before `cfg` changes."""
    keys, trained, sections = override_keys(overrides), copy.deepcopy(record["config"]), list(sections)
    warnings = _guard(trained, sections, keys, source, imports)
    adopted, kept = [], []
    with open_dict(cfg):
        for section in sections:
            if section == "rollout.agent":
                warnings += _adopt_agent(cfg, trained.get("rollout", {}).get("agent"), keys, adopted)
            elif section == "rollout.engine":
                _adopt_engine(cfg, trained.get("rollout", {}).get("engine"), keys, adopted, kept)
            elif section == "env" and trained.get("env") is not None and "env" not in keys:
                warnings += _adopt_env(cfg, trained["env"], keys, adopted)
            elif section == "eval.batch_size":
                if trained.get("eval_batch_size") and not _touched(keys, "eval.batch_size"):
                    cfg.eval.batch_size = int(trained["eval_batch_size"])
                    adopted.append(f"eval.batch_size={cfg.eval.batch_size}")
            elif trained.get(section) is not None:
                if _touched(keys, section):
                    kept.append(f"{section} (set on the command line: {', '.join(_touched(keys, section))})")
                else:
                    OmegaConf.update(cfg, section, trained[section], merge=False)
                    adopted.append(f"{section} ({describe(section, trained[section])})")
    lines = [f"adopted from {source} (the run that trained this model): " + "; ".join(adopted)] if adopted else []
    if kept:
        lines.append("kept from the command line: " + "; ".join(kept))
    return lines + warnings


def _guard(trained: dict, sections: list[str], keys: list[str], source: str, imports: Sequence[str]) -> list[str]:
    """Check every section `adopt` would take from the record (`dspo.runs.trust`), and drop its `trust_remote_code`."""
    from dspo.runs.trust import check_targets, drop_remote_code

    lines = []
    for section in sections:
        if section == "eval.batch_size" or (section == "rollout.engine" and "rollout" in keys):
            continue
        if section == "env" and "env" in keys:
            continue  # env=... on the command line: its own environment, not the record's
        if section not in ("rollout.agent", "rollout.engine", "env") and _touched(keys, section):
            continue  # the command line's own section, not the record's
        # the agent and engine are merged key by key: the record's keys are adopted except the top-level ones the
        # command line sets (`_adopt_agent`), so only those are the user's (not `rollout.agent=...` as a whole); the
        # environment likewise, at any depth (`env.tools.search.topk=3`)
        users = [k for k in keys if k.startswith(section + ".") and k.count(".") == section.count(".") + 1]
        if section == "env":
            users = [k for k in keys if k.startswith("env.")]

        def overridden(key: str, users: list[str] = users) -> bool:
            return any(key == k or key.startswith(k + ".") for k in users)

        parent, _, name = section.rpartition(".")
        holder = trained.get(parent) if parent else trained
        if isinstance(holder, dict) and holder.get(name) is not None:
            check_targets(holder[name], section, imports, overridden, source)
            lines += drop_remote_code(holder[name], section, overridden, source)
    return lines


def _adopt_agent(cfg: DictConfig, agent: Mapping | None, keys: list[str], adopted: list[str]) -> list[str]:
    if agent is None:
        return []
    user = {k.split(".", 2)[2]: OmegaConf.select(cfg, k) for k in _touched(keys, "rollout.agent") if k.count(".") >= 2}
    OmegaConf.update(cfg, "rollout.agent", {**agent, **user}, merge=False)
    adopted.append(f"rollout.agent ({describe('rollout.agent', agent)})")
    return [
        f"WARNING: rollout.agent.{key}={value!r} differs from the trained agent's {key}={agent.get(key)!r}: the model "
        "was trained with the latter; expect lower scores"
        for key, value in user.items()
        if key in AGENT_KEYS_THAT_MATTER and value != agent.get(key)
    ]


def _adopt_env(cfg: DictConfig, env: Mapping, keys: list[str], adopted: list[str]) -> list[str]:
    """The record's environment with the command line's `env.*` keys on top (a warning for each that differs)."""
    user = {}
    for key in _touched(keys, "env"):
        value = OmegaConf.select(cfg, key, default=None)
        user[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    OmegaConf.update(cfg, "env", env, merge=False)
    trained = OmegaConf.create(env)
    warnings = []
    for key, value in user.items():
        before = OmegaConf.select(trained, key.removeprefix("env."), default=None, throw_on_resolution_failure=False)
        OmegaConf.update(cfg, key, value, merge=False)
        if value != before:
            warnings.append(
                f"WARNING: {key}={value!r} differs from the trained environment's {before!r}: the model was trained "
                "with the latter; expect other scores"
            )
    adopted.append(f"env ({describe('env', env)})")
    return warnings


def _adopt_engine(cfg: DictConfig, engine: Mapping | None, keys: list[str], adopted: list[str], kept: list[str]):
    if engine is None:
        return
    if "rollout" in keys:  # `rollout=hf`: another engine on purpose
        kept.append("rollout.engine (rollout= on the command line)")
        return
    user = {k.split(".", 2)[2]: OmegaConf.select(cfg, k) for k in _touched(keys, "rollout.engine") if k.count(".") >= 2}
    OmegaConf.update(cfg, "rollout.engine", {**engine, **user}, merge=False)
    adopted.append(f"rollout.engine ({describe('rollout.engine', engine)})")


def describe(section: str, value: Mapping[str, Any]) -> str:
    """A short description of an adopted section for the first lines of a command."""
    target = str(value.get("_target_", "")).rsplit(".", 1)[-1]
    if section == "rollout.agent":
        shown = [f"{k}={value[k]}" for k in AGENT_KEYS_THAT_MATTER[:6] if k in value]
        return ", ".join(shown)
    if section == "rollout.engine":
        return ", ".join(x for x in (target, f"dtype={value.get('dtype')}" if "dtype" in value else "") if x)
    if section == "retriever":
        where = value.get("index") or value.get("url") or ""
        return f"{target} {where}".strip()
    if section == "env":
        tools = ", ".join(value.get("tools") or {}) or "no tools"
        reward = str((value.get("reward") or {}).get("_target_", "")).rsplit(".", 1)[-1]
        return f"tools {tools}; reward {reward}"
    if section == "data":
        files = value.get("test_files") or value.get("files") or {}
        limit = value.get("test_limit", value.get("limit"))
        names = ", ".join(files) if isinstance(files, Mapping) else str(value.get("path", ""))
        return f"test sets {names}" + (f", first {limit} each" if limit else "")
    return target
