"""Which checkpoint `dspo-train ckpt_path=...` resumes, refused when that would be unsafe, in the run's own folder.

`ckpt_path=last` (and `auto`, for requeued jobs) looks for the newest loadable checkpoint of the runs named
`run_name` under `paths.outputs/train/`, and then continues that run in its own directory. Three ways that went wrong
quietly before (issue 32), and what happens now:

- several runs share a `run_name` (the docs' examples all kept `dspo_seed0`) with different settings: resuming "the
  newest" could pick another experiment. Refused, naming the runs and how their settings differ, unless they differ
  only in keys that do not change what is trained (`RESUME_FREE_KEYS`, `RESUME_FREE_SECTIONS`).
- `trainer.max_steps` at or below the checkpoint's step: nothing would be trained, the test rerun and `metrics.yaml`
  rewritten. Refused before anything is written, except for a run that trained all `trainer.max_steps` and then
  stopped before it finished (preempted in its last round, killed during its test pass: its `status.json` is not
  `finished`): that run is finished, with no training (the model exported, the test pass run, the status written), so
  a job preempted at any step ends as an uninterrupted one does.
- Hydra makes a fresh run folder for every command; when the run continues in its old folder, the fresh one would
  stay behind, empty but for Hydra's files. Its `.hydra/` moves into the resumed run (`.hydra/resume-<time>/`, the
  record of what this command changed), its log goes on in the run's `train.log`, and the folder is removed.

A resumed run whose settings differ from the run's own (other than `RESUME_FREE_KEYS`) is allowed, with a warning
naming each key: changing the learning rate on resume is legitimate, silently switching retrievers is not.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger("dspo.train")

# Keys that only say how far or what else this command runs, not what is trained.
RESUME_FREE_KEYS = ("trainer.max_steps", "ckpt_path", "allow_foreign_checkpoint", "run_test", "output_dir")
# whether checkpoints store in-flight rounds: what a save holds, not what is trained (its own warning says what a
# resume without them changes)
RESUME_FREE_KEYS += ("checkpointing.in_flight", "callbacks.rollout.in_flight")
# whole sections that only report progress or check before a start (the memory plan): a run started before one
# existed resumes without a warning about it
RESUME_FREE_SECTIONS = ("callbacks.round_lines.", "plan.")


def flat_config(cfg: Any) -> dict[str, Any]:
    """{dotted key: value} of a config as composed (interpolations not resolved: they compare as written)."""
    container = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = node

    walk(container, "")
    return {
        k: v
        for k, v in flat.items()
        if not k.startswith(("hydra", *RESUME_FREE_SECTIONS)) and k not in RESUME_FREE_KEYS
    }


def config_differences(a: Any, b: Any) -> list[str]:
    """`key: a -> b` for every key whose value differs (RESUME_FREE_KEYS ignored)."""
    fa, fb = flat_config(a), flat_config(b)
    missing = object()
    return [
        f"{key}: {fa.get(key, '<unset>')!r} -> {fb.get(key, '<unset>')!r}"
        for key in sorted(set(fa) | set(fb))
        if fa.get(key, missing) != fb.get(key, missing)
    ]


def run_config(run_dir: Path) -> DictConfig | None:
    """The run's composed config (`.hydra/config.yaml`) with its `_target_`s named as today: a run started before a
    class moved resumes without a changed-settings warning (dspo.runs.record.MOVED_TARGETS)."""
    from dspo.runs.record import renamed_targets

    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    return OmegaConf.create(renamed_targets(OmegaConf.to_container(OmegaConf.load(path), resolve=False)))


def checkpoint_step(path: str) -> int:
    """The global step a checkpoint (file, or the folder of a distributed one) was saved at."""
    target = Path(path) / "meta.pt" if Path(path).is_dir() else Path(path)
    return int(torch.load(target, map_location="cpu", weights_only=True, mmap=True).get("global_step", 0))


def _refuse_ambiguous_runs(runs: list[Path], run_name: str) -> None:
    """Several runs named `run_name`: refused when their settings differ in anything that changes training."""
    configs = {run: run_config(run) for run in runs}
    newest = max(runs, key=os.path.getmtime)
    differing = {
        run: config_differences(configs[newest], configs[run])
        for run in runs
        if run != newest and configs[run] is not None and configs[newest] is not None
    }
    differing = {run: diff for run, diff in differing.items() if diff}
    if not differing:
        return
    lines = [f"  {newest} (newest)"]
    for run, diff in differing.items():
        shown = "; ".join(diff[:4]) + (f"; ... ({len(diff)} keys)" if len(diff) > 4 else "")
        lines.append(f"  {run}: {shown}")
    raise ValueError(
        f"ckpt_path=last: {len(runs)} runs are named run_name={run_name} and their settings differ, so 'last' is "
        "ambiguous:\n" + "\n".join(lines) + f"\nResume one with ckpt_path={newest / 'checkpoints' / 'last.ckpt'} "
        "(or another run's), or give each experiment its own run_name"
    )


def resolve_ckpt_path(cfg: DictConfig, own_folder_only: bool = False) -> str | None:
    """The checkpoint to resume (None: a fresh start); with `last`/`auto` the run then continues in its folder
    (`cfg.output_dir` is moved there). Refuses, before anything is written, what the module docstring lists.
    `own_folder_only` (a sweep's job): `last`/`auto` look in `cfg.output_dir` only, not in `paths.outputs/train/`."""
    from dspo.runs.checkpoint_files import ERROR_CHECKPOINTS, newest_loadable
    from dspo.runs.trust import check_checkpoint_owner

    if cfg.ckpt_path in (None, ""):
        return None
    if cfg.ckpt_path not in ("last", "auto"):
        path = Path(cfg.ckpt_path).expanduser()
        if not path.exists():  # a file, or a folder (distributed checkpoint of trainer=fsdp)
            raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path}: no such checkpoint file or folder")
        check_checkpoint_owner(path, "ckpt_path", bool(cfg.get("allow_foreign_checkpoint")))
        _refuse_nothing_to_train(cfg, str(path))
        return str(path)
    own = str(Path(cfg.output_dir) / "checkpoints" / "*.ckpt")
    pattern = (
        own
        if own_folder_only
        else os.path.join(cfg.paths.outputs, "train", f"{cfg.run_name}_*", "checkpoints", "*.ckpt")
    )
    found = {*glob.glob(pattern), *glob.glob(own)}
    candidates = [c for c in found if Path(c).name not in ERROR_CHECKPOINTS]
    if not candidates and cfg.ckpt_path == "auto":
        log.info("ckpt_path=auto: no checkpoint of run_name=%s yet; starting a new run", cfg.run_name)
        return None
    if not candidates:
        raise FileNotFoundError(
            f"ckpt_path=last: no checkpoint matches {pattern}. Check run_name (now '{cfg.run_name}') and "
            "paths.outputs, or pass ckpt_path=/path/to/file.ckpt"
        )
    runs = sorted({Path(c).parents[1] for c in candidates})
    if len(runs) > 1:
        _refuse_ambiguous_runs(runs, str(cfg.run_name))
    ckpt = newest_loadable(candidates)
    if ckpt is None:
        raise FileNotFoundError(
            f"ckpt_path=last: none of the {len(candidates)} checkpoints matching {pattern} can be loaded (the "
            "warnings above say why); pass ckpt_path=/path/to/file.ckpt or start a new run_name"
        )
    run_dir = Path(ckpt).parents[1]
    check_checkpoint_owner(ckpt, "ckpt_path", bool(cfg.get("allow_foreign_checkpoint")))
    step = _refuse_nothing_to_train(cfg, ckpt)
    log.info("ckpt_path=%s: resuming run %s from %s (step %d)", cfg.ckpt_path, run_dir, Path(ckpt).name, step)
    _warn_changed_settings(cfg, run_dir)
    with open_dict(cfg):
        cfg.output_dir = str(run_dir)
    return ckpt


def unfinished_at_end(ckpt: str, max_steps: int) -> bool:
    """Whether `ckpt` is at exactly `max_steps` of a run that stopped before it finished (its run folder's
    `status.json` says preempted, failed or running): resuming it finishes that run without training."""
    from dspo.sweeps.status import read_status

    path = Path(ckpt)
    if path.parent.name != "checkpoints" or checkpoint_step(ckpt) != max_steps:
        return False
    status = read_status(path.parents[1])
    return status is not None and status.get("state") in ("preempted", "failed", "running")


def _refuse_nothing_to_train(cfg: DictConfig, ckpt: str) -> int:
    step = checkpoint_step(ckpt)
    max_steps = OmegaConf.select(cfg, "trainer.max_steps", default=-1)
    if max_steps is not None and 0 <= int(max_steps) <= step and unfinished_at_end(ckpt, int(max_steps)):
        log.warning(
            "ckpt_path=%s: %s is at trainer.max_steps=%d and its run stopped before it finished; finishing it: no "
            "training, the model exported and the test pass run",
            cfg.ckpt_path,
            ckpt,
            step,
        )
        return step
    if max_steps is not None and 0 <= int(max_steps) <= step:
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path}: {ckpt} is at step {step} and trainer.max_steps={max_steps}, so nothing would "
            f"be trained (nothing was written). Continue it with trainer.max_steps={max(2 * step, step + 1)} (any "
            f"value above {step}), or evaluate it: dspo-eval ckpt_path={ckpt}"
        )
    return step


def _warn_changed_settings(cfg: DictConfig, run_dir: Path) -> None:
    previous = run_config(run_dir)
    if previous is None:
        return
    diff = config_differences(previous, cfg)
    if diff:
        log.warning(
            "resuming %s with settings that differ from the run's own (%d key(s)): %s",
            run_dir,
            len(diff),
            "; ".join(diff[:8]) + (" ..." if len(diff) > 8 else ""),
        )


def move_into_run(fresh_dir: Path, run_dir: Path) -> None:
    """Hydra's fresh folder for this command -> the resumed run's folder (module docstring), then removed. Only a
    folder holding nothing but Hydra's `.hydra/` and log files is removed."""
    fresh_dir, run_dir = Path(fresh_dir).resolve(), Path(run_dir).resolve()
    if fresh_dir == run_dir or not fresh_dir.is_dir():
        return
    run_dir.mkdir(parents=True, exist_ok=True)  # `output_dir=NEW` names a folder that does not exist yet
    _reopen_logs(fresh_dir, run_dir)
    if (fresh_dir / ".hydra").is_dir():
        target = run_dir / ".hydra" / f"resume-{fresh_dir.name.rsplit('_', 1)[-1]}"
        shutil.copytree(fresh_dir / ".hydra", target, dirs_exist_ok=True)
    leftovers = [p for p in fresh_dir.iterdir() if p.name != ".hydra" and p.suffix != ".log"]
    if leftovers:
        log.warning("left %s in place: it holds %s", fresh_dir, ", ".join(p.name for p in leftovers))
        return
    shutil.rmtree(fresh_dir, ignore_errors=True)


def discard(fresh_dir: Path) -> None:
    """Remove Hydra's fresh folder of a command that was refused before it did anything (same safety rule)."""
    fresh_dir = Path(fresh_dir)
    if fresh_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in fresh_dir.iterdir()):
        shutil.rmtree(fresh_dir, ignore_errors=True)


def _reopen_logs(fresh_dir: Path, run_dir: Path) -> None:
    """Point file log handlers writing into `fresh_dir` at the same file name in `run_dir` (appending)."""
    for handler in [h for logger in _all_loggers() for h in logger.handlers]:
        if not isinstance(handler, logging.FileHandler) or Path(handler.baseFilename).parent != fresh_dir:
            continue
        handler.acquire()
        try:
            handler.close()
            old = Path(handler.baseFilename)
            new = run_dir / old.name
            with open(new, "a", encoding="utf-8") as target:
                if old.is_file():
                    target.write(old.read_text(encoding="utf-8", errors="replace"))
            handler.baseFilename, handler.mode = str(new), "a"
            handler.stream = handler._open()
        finally:
            handler.release()


def _all_loggers() -> list[logging.Logger]:
    manager = logging.Logger.manager
    named = [obj for obj in manager.loggerDict.values() if isinstance(obj, logging.Logger)]
    return [logging.getLogger(), *named]
