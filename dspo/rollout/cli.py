"""`dspo-rollout`: run multi-turn search rollouts and write exactly what the model saw and what would be trained.

Config: conf/rollout_cli.yaml beside the package (groups `retriever` and `rollout`). One JSON line per trajectory.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import partial
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from dspo.env.build import build_environment
from dspo.process.runtime import run_command
from dspo.types import DEFAULT_ROLE, RolloutGroup

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")

RECORD_FIELDS = (
    "question",
    "golden_answers",
    "answer",
    "reward",
    "outcome",
    "step_rewards",
    "reward_components",
    "tool_calls",
    "num_turns",
    "num_tool_calls",
    "num_invalid_calls",
    "truncated",
    "policy_version",
    "prompt_ids",
    "response_ids",
    "response_mask",
    "engine_logprobs",
    "response_text",
)


def trajectory_records(groups: list[RolloutGroup]) -> list[dict]:
    """One JSON-ready dict per trajectory, with the item id, its group index and the trajectory's index in the group."""
    records = []
    roled = any(group.role != DEFAULT_ROLE for group in groups)  # an agent of several roles (dspo.agent.roles)
    for group in groups:
        for index, traj in enumerate(group.trajectories):
            data = asdict(traj)
            record = {"id": group.item.id, "prompt_index": group.prompt_index, "sample": index}
            if roled:  # un-roled records stay as they were
                record["role"] = group.role
            record.update({name: data[name] for name in RECORD_FIELDS})
            records.append(record)
    return records


def _require_path(value: str | None, key: str, kind: str) -> Path:
    if value is None or str(value) in ("", "???"):
        raise ValueError(f"{key} is not set: pass {key}=... (a {kind})")
    path = Path(str(value)).expanduser()
    exists = path.is_dir() if kind == "directory" else path.exists()
    if not exists:
        raise FileNotFoundError(f"dspo-rollout: {key}={value!r} is not an existing {kind}")
    return path


EXAMPLE = "dspo-rollout model.path=outputs/train/RUN/model n=8 output=rollouts.jsonl"


def adopt_run_record(cfg: DictConfig, overrides: list[str], imports: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The agent, engine and retriever of the run that trained `model.path` (`dspo.runs.record`), unless overridden;
    with no `data.path`, its first training file. The record may name the targets of dspo and of the `imports` modules
    only. Returns the lines to show first."""
    from omegaconf import OmegaConf, open_dict

    from dspo.runs.record import RECORD_FILE, adopt, read_model_record

    source = str(Path(str(cfg.model.path)).expanduser() / RECORD_FILE)
    record = read_model_record(cfg.model.path)
    if record is None:
        return [f"no dspo run record in {source}: a plain model, rolled out with conf/rollout_cli.yaml's settings"]
    lines = adopt(cfg, record, overrides, source, ("rollout.agent", "rollout.engine", "retriever", "env"), imports)
    train_files = (record["config"].get("data") or {}).get("train_files") or []
    if OmegaConf.is_missing(cfg.data, "path") and train_files:
        with open_dict(cfg):
            cfg.data.path = str(train_files[0])
        lines.append(f"data.path={cfg.data.path} (the run's first training file; pass data.path=FILE for another)")
    return lines


def run_rollout(cfg: DictConfig, overrides: list[str] | tuple[str, ...] = ()) -> Path:
    """Load data, retriever, engine and agent from `cfg`; roll out; write `cfg.output`; return its path. `overrides`
    (the command line's) win over the settings a dspo-trained model records."""
    from transformers import AutoTokenizer

    from dspo.agent import build_agent, check_agent_settings
    from dspo.data.qa import load_qa
    from dspo.runs.trust import import_modules

    model_path = _require_path(cfg.model.path, "model.path", "directory")
    imports = import_modules(cfg.get("imports"))  # the user's plug-ins: a record may name their targets
    for line in adopt_run_record(cfg, list(overrides), imports):
        print(f"dspo-rollout: {line}", flush=True)
    data_path = _require_path(cfg.data.path, "data.path", "file or directory")
    if cfg.n < 1 or cfg.group_size < 1:
        raise ValueError(f"dspo-rollout: n={cfg.n} and group_size={cfg.group_size} must be >= 1")
    items = load_qa(str(data_path), benchmark=cfg.data.benchmark, limit=cfg.n)
    tokenizer_path = cfg.model.tokenizer or model_path
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    env = build_environment(cfg.env)  # tools + reward (conf/env/), before the engine starts
    agent = instantiate(cfg.rollout.agent)
    check_agent_settings(agent)  # before the engine starts
    engine = instantiate(cfg.rollout.engine)(model_path=str(model_path))
    agent = build_agent(agent, engine=engine, tokenizer=tokenizer, env=env)
    result = agent.rollout(
        items, group_size=cfg.group_size, policy_version=cfg.policy_version, greedy=cfg.greedy, seed=cfg.seed
    )
    output = Path(str(cfg.output)).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as handle:
        for record in trajectory_records(result.groups):
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    stats = ", ".join(f"{k}={v:.3g}" for k, v in result.stats.items())
    print(f"dspo-rollout: wrote {len(items) * cfg.group_size} trajectories to {output}\n{stats}")
    return output


@hydra.main(config_path=CONF_DIR, config_name="rollout_cli", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from dspo.process.console import quiet_console
    from dspo.process.errors import user_errors

    quiet_console()
    with user_errors("dspo-rollout", EXAMPLE):
        run_rollout(cfg, list(HydraConfig.get().overrides.task))


# the `dspo-rollout` command: `main`, then the process ends without the interpreter's teardown (call `main` to stay)
cli = partial(run_command, main)


if __name__ == "__main__":
    cli()
