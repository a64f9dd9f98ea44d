"""LoRA (`model.lora`): low-rank adapters trained on a frozen base model, with the `peft` library (issue 44).

The adapters are injected in place (`peft.inject_adapter_in_model`): the policy keeps its Hugging Face class and its
module names, so FSDP's per-layer wrapping, gradient checkpointing and `save_pretrained` see the model they know. An
adapted projection `M` holds `M.base_layer.weight` (frozen), `M.lora_A.default.weight` [r, in] and
`M.lora_B.default.weight` [out, r] (zero at the start, so the first push is the base model).

- The KL reference is the policy with its adapters switched off (`adapters_disabled`): no second model.
- The engine gets merged weights, `M.weight = W + (alpha / r) * B @ A` (`merge_adapters`), under the names of the
  Hugging Face checkpoint it loaded; nothing in the engine knows about LoRA.
- Checkpoints hold the adapters (and, through the optimizer, their AdamW state) only (`is_adapter_key`): the frozen
  base is reloaded from `model.path` on resume, which is refused when `model.path` holds other weights than the base
  the adapters were trained on (`base_digest`, `check_same_base`).
- The final export is a plain merged model, with the adapter folder beside it (`save_adapter`, peft's format).
- Only `nn.Linear` targets (weight [out, in]) merge: a Conv1D target (peft's `fan_in_fan_out`) is refused in
  `add_adapters`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspo.models.names import clean_parameter_name

log = logging.getLogger(__name__)

ADAPTER = "default"  # peft's name of the one adapter dspo trains
# Qwen2's attention and MLP projections (Llama, Mistral and Qwen3 name theirs the same)
QWEN2_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_SUFFIX = "_adapter"  # the adapter folder beside an exported model: `model` -> `model_adapter`
# the files of a model folder whose bytes `base_digest` samples (safetensors, or PyTorch's pickles)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
DIGEST_BLOCKS, DIGEST_BLOCK = 64, 4096


@dataclass
class LoraConfig:
    """`model.lora`: rank `r`, `alpha` (the update is scaled by alpha / r), `dropout` on the adapters' input, and the
    module names to adapt (`target_modules`, matched against the end of each module's name, as peft does)."""

    r: int = 16
    alpha: float = 32.0
    # > 0 makes the trainer's logprobs random and no longer the engine's (mismatch/* shows it): 0, as TRL's RL default
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(QWEN2_TARGETS))

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"model.lora.r must be an integer >= 1 (the adapters' rank), got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"model.lora.alpha must be > 0 (the update is scaled by alpha / r), got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(
                f"model.lora.target_modules must be a non-empty list of module names, e.g. [q_proj, v_proj]; "
                f"got {targets!r}"
            )
        self.target_modules = list(targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def lora_config(value: Any) -> LoraConfig | None:
    """`model.lora` as Hydra or a checkpoint's hyperparameters hand it over (None, a mapping, a LoraConfig); None
    (full fine-tuning) also for a mapping whose `r` is null, as conf/model/ writes it so that `model.lora.r=8` can
    turn LoRA on from the command line (Hydra cannot set a key under a null node)."""
    if value is None or isinstance(value, LoraConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"model.lora must be null (full fine-tuning) or a mapping such as {{r: 8}}, got {value!r}")
    known = {f.name for f in fields(LoraConfig)}
    unknown = sorted(set(value) - known - {"_target_"})
    if unknown:
        raise ValueError(f"model.lora: unknown keys {unknown}; use {sorted(known)}")
    if value.get("r") is None:
        return None
    return LoraConfig(**{k: v for k, v in value.items() if k in known})


def check_same_lora(saved: LoraConfig | None, current: LoraConfig | None) -> None:
    """A checkpoint resumes only into the same kind of training: its adapters (or its full weights) would otherwise be
    left out of a non-strict load, and training would go on from the base model without a word."""

    def shape(cfg: LoraConfig | None) -> tuple | None:  # the dropout may change; the adapters' shape and scale not
        return None if cfg is None else (cfg.r, cfg.alpha, sorted(cfg.target_modules))

    if shape(saved) == shape(current):
        return

    def name(cfg: LoraConfig | None) -> str:
        return "full fine-tuning (model.lora=null)" if cfg is None else f"model.lora={cfg}"

    raise ValueError(
        f"ckpt_path: the checkpoint was trained with {name(saved)}, this run is set to {name(current)}; resume with "
        "the checkpoint's model.lora (or start a new run)"
    )


def base_digest(model_dir: str | Path) -> str:
    """A cheap fingerprint of the weights in `model_dir`: sha256 over each weight file's name, size and
    `DIGEST_BLOCKS` blocks of `DIGEST_BLOCK` bytes spread evenly over it (the whole file when it is smaller). Reads
    about 256 KiB a file, so it is taken at every checkpoint; any retraining of the base changes the sampled bytes."""
    digest = hashlib.sha256()
    files = sorted(p for p in Path(model_dir).expanduser().iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size};".encode())
        with path.open("rb") as handle:
            if size <= DIGEST_BLOCKS * DIGEST_BLOCK:
                digest.update(handle.read())
                continue
            for i in range(DIGEST_BLOCKS):
                handle.seek(i * (size - DIGEST_BLOCK) // (DIGEST_BLOCKS - 1))
                digest.update(handle.read(DIGEST_BLOCK))
    return digest.hexdigest()


def check_same_base(saved: Mapping[str, Any], model_path: str) -> None:
    """A LoRA checkpoint resumes only on the base it was trained on (`saved`: the checkpoint's `dspo` entry, with
    `model_dir` and `base_digest`): its adapters mean nothing on other weights, and the KL reference (the base with the
    adapters off) would be another model. The digest decides; a moved copy of the same base resumes."""
    saved_dir, digest = saved.get("model_dir"), saved.get("base_digest")
    if digest is None:  # a checkpoint from before digests were stored: only the path can be compared
        if saved_dir is not None and Path(saved_dir).expanduser().resolve() != Path(model_path).expanduser().resolve():
            log.warning(
                "ckpt_path: this LoRA checkpoint was trained on the base model at %s and resumes on model.path=%s; "
                "it has no weight digest, so nothing checks that they are the same weights",
                saved_dir,
                model_path,
            )
        return
    current = base_digest(model_path)
    if current != digest:
        raise ValueError(
            f"ckpt_path: this LoRA checkpoint's adapters were trained on the base model at {saved_dir} (weights "
            f"{digest[:12]}), but model.path={model_path} holds other weights ({current[:12]}): the adapters, and the "
            f"KL reference (the base with them off), would belong to another model. Resume with "
            f"model.path={saved_dir} (or a copy of that folder), or start a new run on this base (ckpt_path=null)"
        )


def add_adapters(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Inject LoRA adapters into `model` in place and freeze everything else; returns `model`."""
    import peft

    peft_cfg = peft.LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules), bias="none"
    )
    try:
        peft.inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
    except ValueError as error:  # peft: "Target modules ... not found in the base model"
        raise ValueError(
            f"model.lora.target_modules={cfg.target_modules}: {error}. Name the model's linear layers (for Qwen2: "
            f"{list(QWEN2_TARGETS)})"
        ) from error
    # peft adapts a GPT-2 style Conv1D (weight [in, out]) with fan_in_fan_out; merge_adapters writes W + s * B @ A in
    # nn.Linear's [out, in] layout, which for a square weight would be the transposed update, with no error
    transposed = sorted(name for name, m in model.named_modules() if getattr(m, "fan_in_fan_out", False) is True)
    if transposed:
        raise ValueError(
            f"model.lora.target_modules={cfg.target_modules} matches {transposed}, which store their weight as "
            "[in, out] (a Conv1D, peft's fan_in_fan_out): dspo merges adapters into nn.Linear layers only. Name "
            "nn.Linear modules in model.lora.target_modules, or train this model without LoRA (model.lora=null)"
        )
    for name, param in model.named_parameters():  # over a bf16 base: fp32 adapters, or AdamW's steps round away
        if is_adapter_key(name) and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA (model.lora): %s trained parameters of %s (%.2f %%)", f"{trained:,}", f"{total:,}", 100 * trained / total
    )
    return model


def adapter_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def has_adapters(model: nn.Module | None) -> bool:
    return model is not None and bool(adapter_layers(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's forward while inside: every LoRA layer computes only its frozen base layer.

    peft's public `enable_adapters(False)` also flips the adapters' `requires_grad`, which DDP's reducer and FSDP2's
    parameter groups fixed at setup; only the forward's switch (`_disable_adapters`, what `disable_adapters` reads) is
    set here (tests/models/test_lora.py checks that the result is the base model's)."""
    layers = [layer for layer in adapter_layers(model) if not layer.disable_adapters]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def is_adapter_key(name: str) -> bool:
    return ".lora_" in name


def lora_scalings(root: nn.Module, prefix: str = "") -> dict[str, float]:
    """{adapted module's clean name without `prefix`: alpha / r} for the modules of `root` (any wrapper)."""
    out = {}
    for name, module in root.named_modules():
        scaling = getattr(module, "scaling", None)
        clean = clean_parameter_name(name + ".")
        if isinstance(scaling, dict) and ADAPTER in scaling and clean.startswith(prefix):
            out[clean[len(prefix) : -1]] = float(scaling[ADAPTER])
    return out


def _split(name: str) -> tuple[str, str] | None:
    """`M.base_layer.weight` -> (M, "base.weight"); `M.lora_A.default.weight` -> (M, "A"); else None."""
    for marker, part in (
        (".base_layer.", "base."),
        (f".lora_A.{ADAPTER}.weight", "A"),
        (f".lora_B.{ADAPTER}.weight", "B"),
    ):
        if marker in name:
            module, _, rest = name.partition(marker)
            return module, part + rest
    return None


def merge_adapters(
    weights: Iterable[tuple[str, torch.Tensor]], scalings: Mapping[str, float]
) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face names and merged tensors: `M.weight = W + s * B @ A` (computed in float32, stored in W's dtype),
    `M.base_layer.bias` -> `M.bias`; other tensors pass unchanged, in order. Identity without adapter keys."""
    weights = list(weights)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        split = _split(name)
        if split is not None:
            parts.setdefault(split[0], {})[split[1]] = tensor
    if not parts:
        return weights
    out = []
    for name, tensor in weights:
        split = _split(name)
        if split is None:
            out.append((name, tensor))
            continue
        module, part = split
        if part == "base.weight":
            found = parts[module]
            if "A" not in found or "B" not in found or module not in scalings:
                raise ValueError(
                    f"LoRA weights of {module} are incomplete: found {sorted(found)}, scaling known: "
                    f"{module in scalings}"
                )
            delta = found["B"].float() @ found["A"].float()
            if delta.shape != tensor.shape:  # add_adapters refuses the layouts that would get here
                raise ValueError(
                    f"LoRA weights of {module}: B @ A is {list(delta.shape)}, the base weight {list(tensor.shape)}; "
                    "only nn.Linear layers ([out, in]) can be merged"
                )
            out.append((f"{module}.weight", (tensor.float() + scalings[module] * delta).to(tensor.dtype)))
        elif part.startswith("base."):
            out.append((f"{module}.{part.removeprefix('base.')}", tensor))
    return out


def merge_into_base(
    base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """A base model's Hugging Face weights with `adapters` (`M.lora_A.default.weight`, ...; a LoRA checkpoint's
    policy) merged in: what `merge_adapters` gives for the trained policy, from the base on disk."""
    modules = {name.partition(".lora_")[0] for name in adapters if is_adapter_key(name)}
    named = []
    for name, tensor in base.items():
        module, _, leaf = name.rpartition(".")
        named.append((f"{module}.base_layer.{leaf}" if module in modules else name, tensor))
    named += [(name, tensor) for name, tensor in adapters.items() if is_adapter_key(name)]
    return dict(merge_adapters(named, dict.fromkeys(modules, scaling)))


def adapter_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapters under peft's saved names: `M.lora_A.default.weight` -> `base_model.model.M.lora_A.weight`."""
    return {
        f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}": tensor.detach().contiguous()
        for name, tensor in weights
        if is_adapter_key(name)
    }


def adapter_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    return path.with_name(path.name + ADAPTER_SUFFIX)


def save_adapter(
    folder: str | Path, cfg: LoraConfig, weights: Iterable[tuple[str, torch.Tensor]], base_model: str
) -> Path:
    """A peft adapter folder (adapter_config.json, adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(base, folder)` loads."""
    from safetensors.torch import save_file

    tensors = adapter_weights(weights)
    if not tensors:
        raise ValueError("save_adapter: the weights hold no LoRA adapter (no '.lora_' key)")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules),
        "bias": "none",
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
