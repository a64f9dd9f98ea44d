"""`dspo-train`: compose -> prepare -> instantiate -> fit -> test -> return the sweep metric.

dspo-train                                          # the embedded toy default (CPU, minutes)
dspo-train algorithm=gspo trainer.max_steps=100     # any key is overridable
dspo-train -m algorithm=dspo,gspo,dapo,grpo seed=0,1,2   # ablation sweep, one run directory each
dspo-train ckpt_path=last                           # resume the newest run of this run_name in place
"""

from __future__ import annotations

import logging
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from dspo.process.runtime import run_command
from dspo.runs.resume import discard, move_into_run, resolve_ckpt_path
from dspo.runs.trust import import_modules
from dspo.sweeps import job as sweep_job
from dspo.sweeps.status import finished_result
from dspo.training.combinations import check_combinations

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
log = logging.getLogger("dspo.train")


def check_round_alignment(cfg: DictConfig) -> None:
    """Validation runs between optimizer steps, so an interval that is not a multiple of the steps per round would
    score the policy in the middle of a round (and the step-0 + every-k-steps curves would not line up with rounds)."""
    steps = int(OmegaConf.select(cfg, "algorithm.num_minibatches", default=1) or 1)
    interval = OmegaConf.select(cfg, "trainer.val_check_interval", default=None)
    if isinstance(interval, int) and not isinstance(interval, bool) and interval % steps:
        fit = steps * max(1, round(interval / steps))
        raise ValueError(
            f"trainer.val_check_interval={interval} is not a multiple of algorithm.num_minibatches={steps} (optimizer "
            f"steps per round): validation would fall mid-round. Use e.g. trainer.val_check_interval={fit}"
        )


def prepare(cfg: DictConfig) -> None:
    """Run the `prepare` steps (build the toy world, tokenizer, warm-started model, ...): each is cached.

    Every rank runs this (Lightning's launcher re-runs the command for ranks 1..n). The steps lock each folder they
    build (`dspo.cachedir.build_lock`, not one lock around this loop: the BM25 index is also built outside `prepare`,
    by whichever process loads it first), so one process builds a folder and the others adopt it."""
    for name, step in (cfg.get("prepare") or {}).items():
        if "_target_" not in step:  # an environment's tuning of a step this run lacks (env=goal_reflect's toy warm
            log.info("prepare: %s names no _target_ (prepare=none here): skipped", name)  # start under prepare=none)
            continue
        log.info("prepare: %s", name)
        hydra.utils.instantiate(step)


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate datamodule, module, callbacks, logger and trainer from the composed config."""
    import lightning.pytorch as pl

    from dspo.runs.record import run_record
    from dspo.training.loggers import LogRunConfig, build_loggers, run_hyperparameters

    datamodule = hydra.utils.instantiate(cfg.data)
    module = hydra.utils.instantiate(cfg.module, _convert_="all")  # plain containers: checkpoints load weights_only
    module.run_record = run_record(cfg)  # in every checkpoint and the exported model: what dspo-eval adopts
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if OmegaConf.select(cfg, "trainer.enable_checkpointing", default=True) is False:
        callbacks = _without_checkpoints(callbacks)
    loggers = build_loggers(cfg.get("logger"))
    if (
        loggers
    ):  # every logger gets the whole resolved config, once (dspo.training.loggers); checkpoints keep module hparams
        callbacks.append(LogRunConfig(run_hyperparameters(cfg)))
    trainer: pl.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return {"datamodule": datamodule, "module": module, "callbacks": callbacks, "trainer": trainer}


def _without_checkpoints(callbacks: list) -> list:
    """trainer.enable_checkpointing=false means no checkpoint at all: the callbacks that write one (round, preemption,
    best) are left out, with a line naming them, rather than Lightning refusing the whole run."""
    from lightning.pytorch.callbacks import Checkpoint

    dropped = [type(c).__name__ for c in callbacks if isinstance(c, Checkpoint)]
    if dropped:
        log.info("trainer.enable_checkpointing=false: %s left out (they write checkpoints)", ", ".join(dropped))
    return [c for c in callbacks if not isinstance(c, Checkpoint)]


def fit_or_checkpoint(trainer, module, datamodule, ckpt_path: str | None) -> None:
    """`trainer.fit`; if it fails (retriever unreachable after its retries, engine error, sampling exhausted, ...),
    save `checkpoints/failure.ckpt` first, then re-raise: the run stops cleanly and can be resumed from there."""
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)  # no arbitrary unpickling
    except Exception as error:
        if trainer.global_step > 0:
            path = Path(trainer.default_root_dir) / "checkpoints" / "failure.ckpt"
            try:
                trainer.save_checkpoint(str(path), weights_only=False)  # full: optimizer + loops
                log.error("training failed (%s); checkpoint saved to %s (resume with ckpt_path=%s)", error, path, path)
            except Exception as save_error:  # the original error matters more than a failed save
                log.error("training failed (%s); saving a checkpoint failed too (%s)", error, save_error)
        raise


def local_processes(cfg: DictConfig) -> int | None:
    """Processes of this run on this node, when the config says: `trainer.devices` of a CPU run (Lightning starts
    that many). None otherwise (GPUs, "auto"): dspo.process.runtime.thread_count then asks LOCAL_WORLD_SIZE and
    SLURM."""
    devices = OmegaConf.select(cfg, "trainer.devices", default=None)
    if OmegaConf.select(cfg, "trainer.accelerator", default=None) != "cpu" or isinstance(devices, bool):
        return None
    return devices if isinstance(devices, int) and devices > 0 else None


def train(cfg: DictConfig) -> float | None:
    """The run, inside dspo.process.runtime.process_settings: its environment defaults and warning filters end with it.
    With `trial_seeds` (a list), one run per seed and the mean of their sweep metrics (`dspo.sweeps.job`)."""
    from dspo.process.runtime import configure_threads, process_settings

    if cfg.get("trial_seeds"):
        return sweep_job.mean_over_seeds(cfg, train)
    if sweep_job.in_sweep() and cfg.ckpt_path == "auto":
        done, metric = finished_result(str(cfg.output_dir), OmegaConf.select(cfg, "trainer.max_steps", default=None))
        if done:  # a resumed sweep: this job finished before, its result stands (docs/sweeps.md#a-sweep-on-slurm)
            log.warning(
                "%s finished before (status.json): not run again; %s = %s", cfg.output_dir, cfg.sweep_metric, metric
            )
            return metric
    with process_settings(accelerator=OmegaConf.select(cfg, "trainer.accelerator", default=None)):
        configure_threads(local_processes=local_processes(cfg))
        start = _start_job()
        try:
            return _train(cfg)
        except sweep_job.RunPreempted as error:  # its status.json says preempted already
            _drop_locals_in_sweep(error)
            raise
        except BaseException as error:  # the sweep's report names the failed job with this line (dspo.sweeps.status)
            sweep_job.write_end(cfg, "failed", error=sweep_job.error_line(error))
            _drop_locals_in_sweep(error)
            raise
        finally:
            _end_job(cfg, start)


def _start_job() -> tuple[float | None, bool]:
    """(resident GiB at the job's start: what earlier jobs of this process left, whether the peak is now the job's
    own): the kernel's peak is reset here (dspo.process.runtime.reset_peak_rss)."""
    from dspo.process.runtime import reset_peak_rss, rss_gib

    own_peak = reset_peak_rss()
    return rss_gib(), own_peak


def _drop_locals_in_sweep(error: BaseException) -> None:
    """A sweep's launcher keeps a failed or preempted job's exception until the sweep ends, and with its traceback the
    run's frames and their locals (trainer, module, engine): cleared here, so that the job's end frees them. A single
    run keeps them for a post-mortem debugger (its process ends with it)."""
    if sweep_job.in_sweep():
        traceback.clear_frames(error.__traceback__)  # skips the frames still running (this one's callers)


def _end_job(cfg: DictConfig, start: tuple[float | None, bool]) -> None:
    """Free what the run left in this process, so that the next job of a sweep starts where this one did (issue 76:
    dspo.process.runtime.release_job_memory), and add the job's memory to its status.json: `rss_start_gib` (what the
    process held when the job began) and `rss_peak_gib` (the job's peak). Never hides the run's own outcome."""
    from dspo.callbacks.status import record_job_memory
    from dspo.process.runtime import release_job_memory, rss_gib

    start_gib, own_peak = start
    try:
        peak_gib = rss_gib("VmHWM") if own_peak else None
        if _work_follows_in_this_process():
            release_job_memory((train.__code__, _train.__code__))
        record_job_memory(str(cfg.output_dir), rss_start_gib=start_gib, rss_peak_gib=peak_gib)
    except Exception as error:  # e.g. output_dir unresolvable outside Hydra
        log.warning("could not release or record the run's memory (%s)", error)


def _work_follows_in_this_process() -> bool:
    """A sweep's next job (Hydra's basic launcher), or whatever a caller of `train()` does next (a notebook, a script,
    a test). Not after a single `dspo-train` run: its process ends with it, and freeing takes seconds (1-2 s after a
    toy run here: collecting what vLLM froze, then the trim)."""
    from dspo.process.runtime import process_ends_with_its_command

    return sweep_job.in_sweep() or not process_ends_with_its_command()


def _train(cfg: DictConfig) -> float | None:
    import lightning.pytorch as pl

    from dspo.callbacks.checkpoints import preempted
    from dspo.process.console import one_lightning_console
    from dspo.process.progress_log import route_progress_lines
    from dspo.training.plan_report import check_plan

    one_lightning_console()
    route_progress_lines()  # progress lines: train.log always, the console when it is no terminal (redirected)

    import_modules(cfg.get("imports"))  # first: user objectives and modes exist for the checks
    check_round_alignment(cfg)
    check_combinations(cfg)
    ckpt_path = _resume_in_place(cfg)
    pl.seed_everything(cfg.seed, workers=True)
    prepare(cfg)
    check_plan(cfg)  # on a GPU: the memory plan, refused before the model loads if it cannot fit (dspo-plan)
    objects = build(cfg)
    trainer, module, datamodule = objects["trainer"], objects["module"], objects["datamodule"]
    fit_or_checkpoint(trainer, module, datamodule, ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    saved = preempted(trainer)
    if saved:
        log.warning(
            "stopped by a preemption signal at step %d; resume with ckpt_path=last (%s)", trainer.global_step, saved
        )
        sweep_job.write_end(cfg, "preempted", step=trainer.global_step, max_steps=trainer.max_steps, checkpoint=saved)
        if sweep_job.in_sweep():  # a partial metric is no result: the sweeper must not score or report it finished
            raise sweep_job.RunPreempted(
                f"{cfg.output_dir}: preempted at step {trainer.global_step}/{trainer.max_steps} after saving {saved}; "
                "run the sweep command again to resume it (its jobs continue with ckpt_path=auto)"
            )
        return metrics.get(cfg.sweep_metric)
    if cfg.run_test and datamodule.test_files:
        for result in trainer.test(module, datamodule=datamodule, verbose=False):
            metrics.update({k: float(v) for k, v in result.items()})
    _report(cfg, trainer, metrics)
    result = metrics.get(cfg.sweep_metric)
    sweep_job.write_end(cfg, "finished", step=trainer.global_step, max_steps=trainer.max_steps, metric=result)
    return result


def _hydra_dir() -> str | None:
    """The folder Hydra made for this command (None outside `hydra.main`, e.g. in tests that compose configs)."""
    from hydra.core.hydra_config import HydraConfig

    return str(Path(HydraConfig.get().runtime.output_dir).resolve()) if HydraConfig.initialized() else None


def _resume_in_place(cfg: DictConfig) -> str | None:
    """`resolve_ckpt_path`; a resumed run continues in its own folder, so this command's fresh Hydra folder moves into
    it (or is removed when the command is refused before doing anything): dspo.runs.resume."""
    fresh = _hydra_dir()
    try:  # a sweep job resumes only its own folder: another sweep's or a single run's of the same name is not it
        ckpt_path = resolve_ckpt_path(cfg, own_folder_only=sweep_job.in_sweep())
    except (ValueError, FileNotFoundError):
        if fresh is not None:
            discard(Path(fresh))
        raise
    target = Path(str(cfg.output_dir)).resolve()
    # a run inside this command's folder (trial_seeds' seed<k>/) is a part of it, not a run resumed elsewhere
    if fresh is not None and target != Path(fresh) and not target.is_relative_to(fresh):
        move_into_run(Path(fresh), target)
    return ckpt_path


def _report(cfg: DictConfig, trainer, metrics: dict[str, float]) -> None:
    from dspo.training.loggers import describe

    if not trainer.is_global_zero:
        return
    out = Path(cfg.output_dir)
    shown = {k: round(v, 4) for k, v in sorted(metrics.items()) if k.startswith(("test/", "val/"))}
    lines = [
        f"run directory : {out}",
        f"checkpoints   : {out / 'checkpoints'} (resume: dspo-train ckpt_path=last run_name={cfg.run_name})",
        f"exported model: {out / 'model'} (loadable by transformers and vLLM)",
        *[describe(logger) for logger in trainer.loggers],
        f"test results  : {out / 'test'} (results.json, results.md, predictions.jsonl)",
        f"metrics       : {shown}",
    ]
    print("\n".join(["", "dspo-train finished", *lines]), flush=True)
    path = out / "metrics.yaml"
    # a resumed run merges into what the run logged before (the analysis reads its val/train keys)
    previous = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}
    path.write_text(OmegaConf.to_yaml(OmegaConf.create({**previous, **metrics})))


EXAMPLE = "dspo-train algorithm=gspo trainer.max_steps=100   (docs/training.md)"


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from dspo.process.errors import user_errors

    with user_errors("dspo-train", EXAMPLE):
        return train(cfg)


# the `dspo-train` command: `main`, then the process ends without the interpreter's teardown (call `main` to stay)
cli = partial(run_command, main)


if __name__ == "__main__":
    cli()
