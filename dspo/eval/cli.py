"""`dspo-eval`: greedy multi-turn search rollouts on QA benchmarks → per-benchmark subEM / EM / F1.

    dspo-eval model.path=DIR retriever.index=INDEX_DIR [data.root=DIR | data.path=FILE] [eval.limit=N]
    dspo-eval ckpt_path=RUN/checkpoints/last.ckpt retriever.index=INDEX_DIR

Scoring is `dspo.eval.pipeline` (the code validation during training runs), so the numbers of both agree. Outputs, in
the Hydra run directory: results.json (with `pinned`: what decides the scores, `dspo.eval.pinned`), results.md,
predictions.jsonl, and TensorBoard scalars `test/<benchmark>/*`. `dspo-eval --compare A B [--force]` compares two
reports (`dspo.eval.compare`).

A dspo training checkpoint holds the policy's weights under `policy.` in its `state_dict`; they are written, with
the architecture and tokenizer files of the model they were trained from (`model.path`, else the checkpoint's
`dspo.model_dir`, else its `hyper_parameters.model.path`), to a Hugging Face folder the rollout engine loads.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dspo.eval.pinned import collect, config_sections, model_identity
from dspo.eval.pipeline import (
    AVERAGE,
    log_tensorboard,
    macro_average,
    markdown_table,
    predict,
    score,
    write_results,
)
from dspo.process.runtime import run_command
from dspo.types import QAItem

log = logging.getLogger(__name__)

_LOAD_BENCHMARKS = "dspo.data.qa.load_benchmarks"


class CheckpointError(ValueError):
    """A training checkpoint cannot be turned into a model folder; the message says why and what to pass."""


# ------------------------------------------------------------------------------------------------ checkpoints
def read_checkpoint(ckpt_path: str, allow_foreign: bool = False) -> dict[str, Any]:
    """`torch.load(weights_only=True)`, memory-mapped: only the policy's tensors are read from disk later. A folder
    (distributed) checkpoint is read only when it is the user's own, or with `allow_foreign`, and always as data:
    its pickles with torch's weights-only unpickler (`dspo.runs.trust.folder_checkpoint_as_data`)."""
    from dspo.runs.trust import check_checkpoint_owner

    path = Path(ckpt_path).expanduser()
    if path.is_dir():
        check_checkpoint_owner(path, "ckpt_path", allow_foreign)
        return _read_distributed_checkpoint(path, ckpt_path)
    if not path.is_file():
        raise CheckpointError(f"ckpt_path={ckpt_path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # pickle refusals and zip errors come in many types
        raise CheckpointError(
            f"ckpt_path={ckpt_path}: cannot be read with torch.load(weights_only=True) ({type(error).__name__}: "
            f"{error}). dspo checkpoints hold only tensors and plain containers; re-save foreign ones as a state_dict."
        ) from error


def _read_distributed_checkpoint(path: Path, ckpt_path: str) -> dict[str, Any]:
    """A `trainer=fsdp` checkpoint folder (torch.distributed.checkpoint shards + Lightning's `meta.pt`), read in this
    one process: Lightning's metadata plus the whole `state_dict` (model weights only, not the optimizer states)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from dspo.runs.checkpoint_files import checkpoint_problem
    from dspo.runs.trust import folder_checkpoint_as_data

    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"ckpt_path={ckpt_path}: {problem}")
    checkpoint = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    state: dict[str, Any] = {}
    reader, planner = FileSystemReader(str(path)), _EmptyStateDictLoadPlanner(keys={"state_dict"})
    with folder_checkpoint_as_data("ckpt_path"):  # torch's reader unpickles `.metadata` and the non-tensor items
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    checkpoint["state_dict"] = state["state_dict"]
    return checkpoint


def checkpoint_model_dir(checkpoint: Mapping[str, Any], model_path: str | None) -> str:
    """The base model folder whose architecture and tokenizer the checkpoint's policy has."""
    hparams_model = (checkpoint.get("hyper_parameters") or {}).get("model") or {}
    candidates = [model_path, (checkpoint.get("dspo") or {}).get("model_dir"), hparams_model.get("path")]
    for candidate in candidates:
        if candidate and (Path(candidate).expanduser() / "config.json").is_file():
            return str(Path(candidate).expanduser())
    raise CheckpointError(
        f"cannot find the base model of this checkpoint (tried model.path, dspo.model_dir, hyper_parameters.model.path"
        f" = {candidates}); pass model.path=DIR of the model it was trained from (config.json + tokenizer)"
    )


def policy_state_dict(checkpoint: Mapping[str, Any], prefix: str = "policy.") -> dict[str, torch.Tensor]:
    """The policy's tensors with Hugging Face names (prefix and FSDP/compile wrapper names removed)."""
    from dspo.models.weights import select_prefixed

    state = checkpoint.get("state_dict")
    if not isinstance(state, Mapping):
        raise CheckpointError("checkpoint has no `state_dict`: not a Lightning checkpoint of dspo")
    weights = dict(select_prefixed(state, prefix))
    if not weights:
        some = sorted(state)[:5]
        raise CheckpointError(f"checkpoint state_dict has no key starting with {prefix!r} (first keys: {some})")
    return weights


def _lora_adapters(checkpoint: Mapping[str, Any], weights: Mapping[str, torch.Tensor], ckpt_path: str):
    """({name: adapter tensor}, LoraConfig) of a LoRA checkpoint (`model.lora`), else ({}, None)."""
    from dspo.models.lora import is_adapter_key, lora_config

    adapters = {name: tensor for name, tensor in weights.items() if is_adapter_key(name)}
    if not adapters:
        return {}, None
    lora = lora_config(((checkpoint.get("hyper_parameters") or {}).get("model") or {}).get("lora"))
    if lora is None:
        raise CheckpointError(
            f"ckpt_path={ckpt_path} holds LoRA adapters but no hyper_parameters.model.lora (their rank and alpha): "
            "not a checkpoint written by dspo-train"
        )
    return adapters, lora


def export_checkpoint(
    ckpt_path: str, output_dir: str, model_path: str | None = None, allow_foreign: bool = False
) -> tuple[str, int]:
    """Write the checkpoint's policy as a Hugging Face model folder (`dspo.models.export`, as the end of training
    writes one); returns (folder, training step).

    Tensor names are checked against the base architecture (built on the meta device, no memory), so a checkpoint
    of another model fails here with the names that differ rather than inside the engine.
    """
    from transformers import AutoConfig

    from dspo.models.export import Adapter, BaseModelFolder, export_model
    from dspo.runs.record import checkpoint_record

    checkpoint = read_checkpoint(ckpt_path, allow_foreign)
    base = checkpoint_model_dir(checkpoint, model_path)
    weights = policy_state_dict(checkpoint)
    adapters, lora = _lora_adapters(checkpoint, weights, ckpt_path)
    if adapters:  # a LoRA checkpoint holds the adapters only: merged into the base model it was trained from
        weights = _merged_into_base(checkpoint, base, adapters, lora)
    config = AutoConfig.from_pretrained(base)
    if getattr(config, "tie_word_embeddings", False):  # one tensor on disk, as Hugging Face saves tied models
        weights.pop("lm_head.weight", None)
    _check_architecture(weights, config, base, ckpt_path)
    step = int(checkpoint.get("global_step", 0) or 0)
    exported = export_model(
        output_dir,
        weights,
        BaseModelFolder(base),
        record=checkpoint_record(checkpoint, ckpt_path),  # the folder then describes itself, as a trained model's
        step=step,
        adapter=Adapter(lora, list(adapters.items()), base) if adapters else None,
    )
    if exported.adapter is not None:
        log.info("wrote the LoRA adapter beside the merged model: %s", exported.adapter)
    return str(exported.folder), step


def _merged_into_base(
    checkpoint: Mapping[str, Any], base: str, adapters: Mapping[str, torch.Tensor], lora: Any
) -> dict[str, torch.Tensor]:
    """The base model's weights (in the checkpoint's `model.dtype`) with the checkpoint's LoRA `adapters` merged in."""
    from transformers import AutoModelForCausalLM

    from dspo.models.lora import merge_into_base

    dtype = ((checkpoint.get("hyper_parameters") or {}).get("model") or {}).get("dtype", "float32")
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    return merge_into_base(base_model.state_dict(), adapters, lora.scaling)


def _check_architecture(weights: Mapping[str, torch.Tensor], config: Any, base: str, ckpt_path: str) -> None:
    """`weights` are exactly the tensors of the architecture `config` describes (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        expected = set(AutoModelForCausalLM.from_config(config).state_dict())
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"ckpt_path={ckpt_path} does not match the architecture of {base}: missing {missing[:5]} "
            f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}); pass the right model.path"
        )


# ------------------------------------------------------------------------------------------------ data + agent
def load_eval_sets(data_cfg: Any, limit: int | None) -> dict[str, list[QAItem]]:
    """Benchmarks from the `data` config: a `load_benchmarks` call (benchmarks.yaml, file.yaml) or a training
    data module's `test_files` (e.g. data=nq_hotpotqa). `limit` (eval.limit) overrides the config's own limit."""
    from hydra.utils import instantiate

    from dspo.data.qa import load_benchmarks

    target = data_cfg.get("_target_")
    if target == _LOAD_BENCHMARKS:
        overrides = {} if limit is None else {"limit": limit}
        sets = instantiate(data_cfg, **overrides)
    elif data_cfg.get("test_files"):
        sets = load_benchmarks(
            dict(data_cfg.test_files), limit=limit if limit is not None else data_cfg.get("test_limit")
        )
    else:
        raise ValueError(
            f"data config ({target}) names no evaluation sets: use data=benchmarks, data=file data.path=FILE, "
            "or a data module config with test_files"
        )
    empty = [name for name, items in sets.items() if not items]
    if empty or not sets:
        raise ValueError(f"no questions to evaluate for {empty or 'any benchmark'} (check data.* and eval.limit)")
    return sets


def build_engine_and_agent(rollout_cfg: Any, model_path: str, env: Any) -> Any:
    """Engine (`rollout.engine`, a partial taking model_path) + a built environment (`env`: tools + reward) +
    `rollout.agent` → agent.

    The environment is built first by the caller (a missing index fails in a second, not after the engine's start);
    the engine hides what breaks vLLM's kernel scan (`dspo.engines.vllm._hide_modules_breaking_vllm`)."""
    from hydra.utils import instantiate

    from dspo.agent import build_agent, check_agent_settings

    agent = instantiate(rollout_cfg.agent)
    check_agent_settings(agent)  # before the engine starts
    engine = instantiate(rollout_cfg.engine, model_path=model_path)
    if isinstance(engine, functools.partial):
        engine = engine()
    return build_agent(agent, engine=engine, tokenizer=engine.tokenizer, env=env)


# ------------------------------------------------------------------------------------------------ run
EXAMPLE = "dspo-eval model.path=outputs/train/RUN/model   (a dspo run's model: its agent, retriever and test sets)"


def check_model_source(cfg: Any) -> None:
    """`model.path` (a Hugging Face folder) or `ckpt_path` (a dspo checkpoint) given and present: checked first."""
    model_path, ckpt = cfg.model.get("path"), cfg.get("ckpt_path")
    if ckpt:
        if not Path(str(ckpt)).expanduser().exists():
            raise FileNotFoundError(f"ckpt_path={ckpt}: no such checkpoint file or folder")
        return
    if not model_path:
        raise ValueError("pass model.path=DIR (a Hugging Face model folder) or ckpt_path=FILE.ckpt (a dspo checkpoint)")
    if not (Path(str(model_path)).expanduser() / "config.json").is_file():
        raise FileNotFoundError(f"model.path={model_path}: no config.json there; point it at a Hugging Face model")


def read_run_record(cfg: Any) -> tuple[dict[str, Any] | None, str]:
    """(the record of the run that trained the model, where it was read); None for a plain model."""
    from dspo.runs.record import RECORD_FILE, checkpoint_record, read_model_record

    if cfg.get("ckpt_path"):
        source = str(cfg.ckpt_path)
        return checkpoint_record(read_checkpoint(source, bool(cfg.get("allow_foreign_checkpoint"))), source), source
    return read_model_record(cfg.model.path), str(Path(str(cfg.model.path)).expanduser() / RECORD_FILE)


def adopt_run_record(
    cfg: Any,
    overrides: list[str],
    imports: list[str] | tuple[str, ...] = (),
    found: tuple[dict[str, Any] | None, str] | None = None,
) -> list[str]:
    """Adopt the settings of the run that trained the model (`dspo.runs.record`; it may name the targets of dspo and of
    the `imports` modules only); the lines to show first. `found`: `read_run_record(cfg)` if already read."""
    from dspo.runs.record import adopt

    record, source = found or read_run_record(cfg)
    if record is None:
        return [
            f"no dspo run record in {source}: a plain model, evaluated with conf/eval.yaml's agent (Qwen tool-call "
            "tags, 4 turns, top-3) and the retriever and data given here"
        ]
    sections = ("rollout.agent", "rollout.engine", "retriever", "env", "data", "eval.batch_size")
    return adopt(cfg, record, overrides, source, sections, imports)


def check_settings(cfg: Any) -> None:
    """Values the command cannot run without, named before anything slow starts."""
    from omegaconf import OmegaConf

    missing = sorted(  # missing_keys() of each section gives full keys; the `hydra` node resolves only under Hydra
        inner for key, node in cfg.items() if key != "hydra" and OmegaConf.is_config(node)
        for inner in OmegaConf.missing_keys(node)
    )  # fmt: skip
    if "retriever.index" in missing:
        raise ValueError(
            "retriever.index is not set: the BM25 index to search (built by dspo-index), e.g. "
            "retriever.index=INDEX_DIR [retriever.corpus=CORPUS.jsonl to build it], or a running service with "
            "retriever=remote retriever.url=http://127.0.0.1:8000/retrieve"
        )
    if missing:
        raise ValueError(f"{', '.join(missing)} not set (??? in the config): pass {missing[0]}=...")


def log_adoption(lines: list[str]) -> None:
    for line in lines:
        (log.warning if line.startswith("WARNING") else log.info)(line.removeprefix("WARNING: "))


def resolve_model(cfg: Any, workdir: Path) -> tuple[str, int]:
    """(model folder for the engine, training step for logging) from `model.path` and/or `ckpt_path`."""
    model_path = cfg.model.get("path")
    if cfg.get("ckpt_path"):
        export_dir = cfg.eval.get("export_dir") or str(workdir / "exported_model")
        log.info("exporting the policy of %s to %s", cfg.ckpt_path, export_dir)
        return export_checkpoint(str(cfg.ckpt_path), export_dir, model_path, bool(cfg.get("allow_foreign_checkpoint")))
    check_model_source(cfg)
    return str(Path(model_path).expanduser()), 0


def run(cfg: Any, output_dir: str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Evaluate and write the result files into `output_dir`; returns results.json's content. `overrides` are the
    command line's (they win over the settings a trained model records)."""

    from dspo.env.build import build_environment
    from dspo.runs.record import index_mismatch
    from dspo.runs.trust import import_modules

    out = Path(output_dir)
    check_model_source(cfg)
    imports = import_modules(cfg.get("imports"))  # the user's plug-ins: a record may name their targets
    found = read_run_record(cfg)
    log_adoption(adopt_run_record(cfg, list(overrides), imports, found))
    check_settings(cfg)
    sets = load_eval_sets(cfg.data, cfg.eval.get("limit"))
    log.info("benchmarks: %s", {name: len(items) for name, items in sets.items()})
    env = build_environment(cfg.env)  # tools (the search tool's retriever) + reward, before the model loads
    mismatch = index_mismatch(found[0], getattr(env.tools.get("search"), "retriever", None))
    if mismatch:
        log.warning(mismatch)
    with tempfile.TemporaryDirectory(prefix="dspo-eval-") as scratch:
        model_path, step = resolve_model(cfg, Path(scratch))
        model, chat_template = model_identity(model_path)  # pinned: the weights and template the engine loads
        agent = build_engine_and_agent(cfg.rollout, model_path, env)
        predictions = []
        for name, items in sets.items():
            predictions += predict(
                agent, items, cfg.eval.batch_size, policy_version=step, progress=cfg.eval.progress, description=name
            )
        del agent  # free the engine before the temporary model folder disappears
    results = score(predictions)
    pinned = collect(config_sections(cfg), predictions, model, chat_template, getattr(env, "reward", None))
    write_results(out, results, predictions, pinned)
    table = dict(results)
    if len(results) > 1:
        table[AVERAGE] = macro_average(results)
    if cfg.eval.get("tensorboard", True):
        log_tensorboard(out / "tensorboard", table, step)
    print(markdown_table(table))
    print(f"results written to {out.resolve()}")
    return table


def main() -> None:
    """Hydra entry point `dspo-eval` (config: conf/eval.yaml); `dspo-eval --compare A B` compares two reports
    (`dspo.eval.compare`, before Hydra: its arguments are files, not overrides)."""
    import sys

    if "--compare" in sys.argv[1:]:
        from dspo.eval.compare import main as compare

        sys.exit(compare(sys.argv[1:]))
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    conf_dir = str(Path(__file__).resolve().parents[2] / "conf")

    @hydra.main(config_path=conf_dir, config_name="eval", version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        from dspo.process.console import quiet_console
        from dspo.process.errors import user_errors

        quiet_console()
        hydra_cfg = HydraConfig.get()
        with user_errors("dspo-eval", EXAMPLE):
            run(cfg, cfg.eval.get("output_dir") or hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task))

    _main()


# the `dspo-eval` command: `main`, then the process ends without the interpreter's teardown (call `main` to stay)
cli = functools.partial(run_command, main)


if __name__ == "__main__":
    cli()
