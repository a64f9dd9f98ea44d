"""The memory plan, told: the table `dspo-plan` prints, the overrides that would make a config fit (found by planning
each of them, not by rule of thumb), and `check_plan`, which every `dspo-train` run calls before it loads a model."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dspo.training.plan import GB, PHASES, MemoryPlan, kv_trajectories
from dspo.training.plan_config import DTYPE_BYTES, plan_of, setting, trains_on_gpu, visible_gpu

log = logging.getLogger("dspo.plan")
MAX_SUGGESTIONS = 2


class PlanDoesNotFit(ValueError):
    """A GPU run whose plan exceeds the device: refused before anything is loaded (plan.check=false goes on)."""


def with_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))


def _halvings(value: int, floor: int) -> list[int]:
    out = []
    while value // 2 >= floor:
        value //= 2
        out.append(value)
    return out


def override_families(cfg: DictConfig) -> list[list[list[str]]]:
    """Ways to lower the peak, each a family of alternatives from the smallest change to the largest; the first
    alternative of a family that fits is the one suggested. Order: what changes only speed, then the engine's share,
    then LoRA (which changes what is trained)."""
    families: list[list[list[str]]] = []
    if not setting(cfg, "model.gradient_checkpointing", False):
        families.append([["model.gradient_checkpointing=true"]])
    tokens = setting(cfg, "algorithm.micro_batch_tokens")
    sequence = int(setting(cfg, "rollout.agent.max_total_tokens", 2048))
    if tokens is None:
        sizes = _halvings(int(setting(cfg, "algorithm.micro_batch_size", 8)), 1)
        families.append([[f"algorithm.micro_batch_size={n}"] for n in sizes])
    else:
        families.append([[f"algorithm.micro_batch_tokens={n}"] for n in _halvings(int(tokens), sequence)])
    families.append(
        [
            [f"algorithm.logprob_chunk_size={n}"]
            for n in _halvings(int(setting(cfg, "algorithm.logprob_chunk_size", 2048)), 128)
        ]
    )
    if _vllm_on_gpu(cfg):
        families.append([[f"rollout.engine.gpu_memory_utilization={u:.2f}"] for u in _utilizations(cfg)])
        if not setting(cfg, "rollout.engine.sleep_during_update", False) and not setting(
            cfg, "rollout.max_staleness", 0
        ):
            families.append([["rollout.engine.sleep_during_update=true"]])
    if setting(cfg, "model.lora.r") is None:
        families.append([["model.lora.r=16", "model.dtype=bfloat16"]])
    return [f for f in families if f]


def _vllm_on_gpu(cfg: DictConfig) -> bool:
    return str(setting(cfg, "rollout.engine._target_", "")).endswith("VLLMEngine") and (
        trains_on_gpu(cfg) or setting(cfg, "plan.gpu") is not None
    )


def _utilizations(cfg: DictConfig) -> list[float]:
    """Engine shares to try: below the current one first (more room for the trainer), then above (more KV cache)."""
    now = float(setting(cfg, "rollout.engine.gpu_memory_utilization", 0.5))
    steps = [round(0.05 * i, 2) for i in range(2, 20)]
    return sorted((u for u in steps if u < now), reverse=True) + [u for u in steps if u > now]


def _fits(cfg: DictConfig, overrides: list[str]) -> MemoryPlan | None:
    try:
        plan = plan_of(with_overrides(cfg, overrides))
    except (ValueError, FileNotFoundError):
        return None
    return plan if plan.fits else None


def suggestions(cfg: DictConfig) -> list[tuple[list[str], MemoryPlan]]:
    """Up to MAX_SUGGESTIONS override sets that make the plan fit: single families first, then pairs."""
    families = override_families(cfg)
    found: list[tuple[list[str], MemoryPlan]] = []
    for group in itertools.chain(([f] for f in families), itertools.combinations(families, 2)):
        if len(found) >= MAX_SUGGESTIONS or (len(group) == 2 and found):
            break
        for combo in itertools.product(*group):
            overrides = [o for part in combo for o in part]
            plan = _fits(cfg, overrides)
            if plan is not None:
                found.append((overrides, plan))
                break
    return found


def engine_room(cfg: DictConfig, plan: MemoryPlan) -> tuple[float, MemoryPlan] | None:
    """The largest vLLM share that still fits, when it is above the config's (a larger KV cache for free)."""
    if not plan.fits or not _vllm_on_gpu(cfg):
        return None
    now = float(setting(cfg, "rollout.engine.gpu_memory_utilization", 0.5))
    for share in sorted((u for u in _utilizations(cfg) if u > now), reverse=True):
        bigger = _fits(cfg, [f"rollout.engine.gpu_memory_utilization={share:.2f}"])
        if bigger is not None:
            return share, bigger
    return None


def _gb(value: int) -> str:
    return f"{value / GB:.2f}"


def table(plan: MemoryPlan) -> Iterator[str]:
    width = max(len(t.name) for t in plan.terms)
    yield f"{'term':<{width}}  {'GB':>7}  {'gen':>3} {'upd':>3} {'push':>4}  how"
    for t in plan.terms:
        marks = " ".join(f"{'x' if p in t.phases else '.':>{n}}" for p, n in zip(PHASES, (3, 3, 4), strict=True))
        yield f"{t.name:<{width}}  {_gb(t.bytes):>7}  {marks}  {t.how}"


def summary(plan: MemoryPlan) -> str:
    s = plan.settings
    phases = ", ".join(f"{p} {_gb(plan.phase_bytes(p))}" for p in PHASES)
    verdict = (
        f"fits: {_gb(plan.margin)} GB to spare at the peak ({plan.peak_phase})"
        if plan.fits
        else "does NOT fit: " + "; ".join(plan.problems())
    )
    lines = [f"phases (GB): {phases}", f"{s.device}: {_gb(s.device_bytes)} GB; peak {_gb(plan.peak)} GB; {verdict}"]
    for engine in s.engines:
        tokens = plan.kv_tokens.get(engine.name, 0)
        lines.append(
            f"{engine.name} KV cache: {max(tokens, 0):,} tokens = {kv_trajectories(plan, engine):.1f} trajectories of "
            f"{engine.max_model_len:,} tokens"
        )
    return "\n".join(lines)


def report(cfg: DictConfig, plan: MemoryPlan | None = None) -> str:
    """The whole plan as `dspo-plan` prints it."""
    plan = plan or plan_of(cfg)
    s = plan.settings
    model = f"model {setting(cfg, 'model.path')} ({plan_model_line(plan, cfg)})"
    layout = (
        f"{s.shards} FSDP2 shards" if s.fsdp and s.shards > 1 else "DDP replicas" if s.ddp else "one process per device"
    )
    lines = [
        model,
        f"layout: {layout}; master weights {setting(cfg, 'model.dtype')} ({s.master_bytes} B), activations "
        f"{s.compute_bytes} B; micro-batch {s.micro_tokens:,} padded tokens, {s.trained_tokens:,} trained; gradient "
        f"checkpointing {'on' if s.gradient_checkpointing else 'off'}; GB = 10^9 bytes",
        *table(plan),
        summary(plan),
    ]
    lines += _advice(cfg, plan)
    return "\n".join(lines)


def plan_model_line(plan: MemoryPlan, cfg: DictConfig) -> str:
    shape = plan.shape
    lora = (
        f", LoRA r={setting(cfg, 'model.lora.r')}: {shape.lora_parameters / 1e6:.1f} M trained"
        if plan.settings.lora
        else ""
    )
    return f"{shape.parameters / 1e9:.2f} B parameters{lora}"


def _advice(cfg: DictConfig, plan: MemoryPlan) -> list[str]:
    if plan.fits:
        room = engine_room(cfg, plan)
        if room is None:
            return []
        share, bigger = room
        engine = bigger.settings.engines[0]
        return [
            f"room: rollout.engine.gpu_memory_utilization={share:.2f} still fits "
            f"({kv_trajectories(bigger, engine):.0f} trajectories in the KV cache)"
        ]
    found = suggestions(cfg)
    if not found:
        return [
            "no single override or pair of them makes it fit: more GPUs (trainer=fsdp trainer.devices=N) or a "
            "smaller model"
        ]
    return ["overrides that fit:"] + [
        f"  {' '.join(o)}   (peak {_gb(p.peak)} GB, {_gb(p.margin)} GB to spare)" for o, p in found
    ]


def as_json(cfg: DictConfig, plan: MemoryPlan | None = None) -> dict[str, Any]:
    plan = plan or plan_of(cfg)
    s = plan.settings
    return {
        "model": str(setting(cfg, "model.path")),
        "device": s.device,
        "device_bytes": s.device_bytes,
        "terms": [{"name": t.name, "how": t.how, "bytes": t.bytes, "phases": sorted(t.phases)} for t in plan.terms],
        "phases": {p: plan.phase_bytes(p) for p in PHASES},
        "peak_phase": plan.peak_phase,
        "peak_bytes": plan.peak,
        "margin_bytes": plan.margin,
        "fits": plan.fits,
        "problems": plan.problems(),
        "kv_cache_tokens": dict(plan.kv_tokens),
        "suggestions": [] if plan.fits else [o for o, _ in suggestions(cfg)],
    }


def warn_precision(cfg: DictConfig) -> None:
    """bf16 / fp16 master weights trained in full: an lr-1e-6 update is below bf16's resolution and rounds away."""
    dtype = str(setting(cfg, "model.dtype", "float32"))
    if DTYPE_BYTES.get(dtype, 4) < 4 and setting(cfg, "model.lora.r") is None:
        log.warning(
            "model.dtype=%s with full fine-tuning: AdamW then keeps %s weights and moments, and an update of lr %s is "
            "below %s's resolution (2^-8 relative), so most updates round to nothing. Use model.dtype=float32 "
            "(fp32 master weights; bf16 compute comes from trainer precision bf16-mixed) or LoRA (model.lora.r=16, "
            "where a %s frozen base is right)",
            dtype,
            dtype,
            setting(cfg, "optimizer.lr"),
            dtype,
            dtype,
        )


def check_plan(cfg: DictConfig) -> MemoryPlan | None:
    """Before a run loads its model: warnings for a config that wastes or misuses the hardware, and on a GPU the
    plan, refused when it cannot fit (with the overrides that would) unless plan.check=false."""
    warn_precision(cfg)
    if not trains_on_gpu(cfg):
        gpu = visible_gpu()
        if gpu is not None:
            log.warning(
                "a GPU is visible (%s) but trainer.accelerator=%s: this run trains on the CPU. trainer=gpu trains on "
                "the GPU (and rollout engines take device/dtype from their configs: docs/memory.md#one-gpu)",
                gpu[0],
                setting(cfg, "trainer.accelerator"),
            )
        return None
    plan = plan_of(cfg)
    if plan.fits:
        log.info("memory plan: %s", summary(plan).replace("\n", "; "))
        return plan
    if not setting(cfg, "plan.check", True):
        log.warning("plan.check=false: starting although the memory plan does not fit:\n%s", report(cfg, plan))
        return plan
    raise PlanDoesNotFit(
        f"the memory plan of this config does not fit the GPU (dspo-plan prints the same):\n{report(cfg, plan)}\n"
        "Refused before loading the model; plan.check=false starts anyway"
    )
