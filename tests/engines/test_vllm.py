"""VLLMEngine on CPU with a tiny random Qwen2 (Qwen2.5 vocabulary, head_dim 64): weight push → logprobs match
transformers to 1e-3; multi-turn rollouts run with exact masks. One engine for the whole module (startup ~20 s)."""

from __future__ import annotations

import os

import pytest
import torch

from dspo.agent import AgentConfig
from dspo.agent.prompts import SEARCH_TOOL_SCHEMA, build_messages
from dspo.agent.tool_calling import ToolCallingAgent
from dspo.engines.base import SamplingConfig
from dspo.toy.model import steer_tiny_model
from dspo.types import QAItem

pytestmark = pytest.mark.slow

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    pytest.importorskip("vllm")
    from dspo.engines import VLLMEngine

    return VLLMEngine(tiny_model_dir, dtype="float32", max_model_len=2048, kv_cache_space_gb=0.5, seed=0)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[L-1] logprob of token t given tokens < t, as the trainer computes it."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def vllm_prompt_logprobs(engine, ids: list[int]) -> torch.Tensor:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = engine.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return torch.tensor([step[tok].logprob for step, tok in zip(out[0].prompt_logprobs[1:], ids[1:])])


def test_weight_push_then_logprobs_match_transformers(engine, hf_model, qwen_tokenizer):
    ids = qwen_tokenizer.encode("The capital of France is Paris, and the capital of Germany is Berlin.")
    before = vllm_prompt_logprobs(engine, ids)
    assert (before - hf_logprobs(hf_model, ids)).abs().max() < 1e-3
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    engine.push_weights(hf_model.state_dict().items(), version=1)
    assert engine.version == 1
    after, expected = vllm_prompt_logprobs(engine, ids), hf_logprobs(hf_model, ids)
    assert (after - before).abs().max() > 0.05, "the push did not change vLLM's weights"
    assert (after - expected).abs().max() < 1e-3
    # Sampled-token logprobs (what the rollout records) agree with the trainer's too.
    (gen,) = engine.generate([ids], SamplingConfig(max_new_tokens=8, seed=0))
    assert len(gen.token_ids) == len(gen.logprobs) == 8 and gen.text == qwen_tokenizer.decode(gen.token_ids)
    full = hf_logprobs(hf_model, ids + gen.token_ids)[len(ids) - 1 :]
    assert (torch.tensor(gen.logprobs) - full).abs().max() < 1e-3


def test_multiturn_rollout_masks_and_logprobs(engine, hf_model, qwen_tokenizer, retriever):
    close = qwen_tokenizer.convert_tokens_to_ids("</tool_call>")
    steer_tiny_model(hf_model, {close: 0.2, qwen_tokenizer.eos_token_id: 0.02})
    engine.push_weights(hf_model.state_dict().items(), version=2)
    config = AgentConfig(max_turns=3, max_new_tokens_per_turn=24, max_obs_tokens=32, max_total_tokens=1024)
    agent = ToolCallingAgent(engine, qwen_tokenizer, retriever, config)
    items = [QAItem(id=str(i), question=q, golden_answers=["x"]) for i, q in enumerate(["Who?", "Where is it?"])]
    result = agent.rollout(items, group_size=3, policy_version=engine.version, seed=0)
    groups = result.groups
    trajectories = [t for g in groups for t in g.trajectories]
    assert [len(g.trajectories) for g in groups] == [3, 3] and {t.policy_version for t in trajectories} == {2}
    assert max(t.num_turns for t in trajectories) >= 2, "expected at least one multi-turn episode"
    assert result.stats["invalid_calls"] >= 1 and result.stats["tokens_per_s"] > 0
    prefix, suffix = agent.tool_turn.prefix_text, agent.tool_turn.suffix_text
    for traj, item in zip(trajectories, [i for i in items for _ in range(3)]):
        mask, ids = traj.response_mask, traj.response_ids
        assert len(ids) == len(mask) == len(traj.engine_logprobs) and mask[0] == 1
        # Rebuild the conversation from the mask runs and render it with the chat template: identical text.
        messages, start = build_messages(item.question, "qwen"), 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                text = qwen_tokenizer.decode(ids[start:i])
                if mask[start] == 1:
                    messages.append({"role": "assistant", "content": text})
                else:
                    assert text.startswith(prefix + "Error: ") and text.endswith(suffix)
                    assert ids[start - 1] == close
                    messages.append({"role": "tool", "content": text[len(prefix) : -len(suffix)]})
                start = i
        if traj.num_turns > 1:
            last = messages.pop()["content"]
            rendered = qwen_tokenizer.apply_chat_template(
                messages, tools=[SEARCH_TOOL_SCHEMA], add_generation_prompt=True, tokenize=False
            )
            assert qwen_tokenizer.decode(traj.prompt_ids + ids) == rendered + last
        # Engine logprobs on model tokens equal the trainer's; environment tokens carry 0.
        full = hf_logprobs(hf_model, traj.prompt_ids + ids)[len(traj.prompt_ids) - 1 :]
        trained = torch.tensor(mask, dtype=torch.bool)
        assert (torch.tensor(traj.engine_logprobs)[trained] - full[trained]).abs().max() < 1e-3
        assert all(lp == 0.0 for lp, m in zip(traj.engine_logprobs, mask) if m == 0)
