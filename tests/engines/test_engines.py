"""ScriptedEngine stop semantics and trajectory tracking; HFEngine sampling, stops, logprobs and weight push."""

from __future__ import annotations

import pytest
import torch

from dspo.engines import HFEngine, RolloutEngine, SamplingConfig
from dspo.engines.scripted import ScriptedEngine

STOPS = ["</tool_call>", "</answer>"]


def test_scripted_engine_cuts_at_first_stop_and_appends_eos(qwen_tokenizer):
    engine = ScriptedEngine(qwen_tokenizer, [["a</answer> trailing", "b</tool_call>c"], ["no stop"]])
    assert isinstance(engine, RolloutEngine)
    prompt = qwen_tokenizer.encode("hi")
    first, other = engine.generate([prompt, prompt], SamplingConfig(stop=STOPS))
    assert (first.text, first.stop_reason, first.finish_reason) == ("a</answer>", "</answer>", "stop")
    assert other.text == "no stop<|im_end|>" and other.stop_reason is None
    assert other.token_ids[-1] == qwen_tokenizer.eos_token_id and other.logprobs == [0.0] * len(other.token_ids)
    # Trajectory 0 continues (its history is a prefix of the new prompt); its turn 1 is played.
    (second,) = engine.generate([prompt + first.token_ids + [13]], SamplingConfig(stop=STOPS))
    assert second.text == "b</tool_call>"
    assert second.token_ids[-1] == qwen_tokenizer.convert_tokens_to_ids("</tool_call>")
    with pytest.raises(IndexError, match="trajectory 2, turn 0"):
        engine.generate([qwen_tokenizer.encode("new")], SamplingConfig(stop=STOPS))


def test_scripted_engine_callable_and_length_limit(qwen_tokenizer):
    seen = []

    def script(prompt_text: str, turn: int, index: int) -> str:
        seen.append((prompt_text, turn, index))
        return "one two three four five six"

    engine = ScriptedEngine(qwen_tokenizer, script)
    (gen,) = engine.generate([qwen_tokenizer.encode("Q")], SamplingConfig(max_new_tokens=3))
    assert gen.finish_reason == "length" and len(gen.token_ids) == 3 and gen.text == "one two three"
    assert seen == [("Q", 0, 0)]
    engine.push_weights(iter([("w", torch.zeros(1))]), version=5)
    assert engine.version == 5


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    torch.manual_seed(0)
    return HFEngine(model_path=tiny_model_dir, batch_size=2)


def teacher_forced_logprobs(model, prompt: list[int], generated: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(generated)[:, None]).squeeze(-1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_engine_logprobs_match_forward_pass_with_left_padding(hf_engine, qwen_tokenizer, temperature):
    prompts = [qwen_tokenizer.encode(t) for t in ("a", "a much longer prompt than the first", "mid size prompt")]
    gens = hf_engine.generate(prompts, SamplingConfig(temperature=temperature, max_new_tokens=6, seed=3))
    for prompt, gen in zip(prompts, gens):
        assert len(gen.token_ids) == len(gen.logprobs) == 6 and gen.finish_reason == "length"
        expected = teacher_forced_logprobs(hf_engine.model, prompt, gen.token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(gen.logprobs, expected)) < 1e-4
        assert gen.text == qwen_tokenizer.decode(gen.token_ids)
    again = hf_engine.generate(prompts, SamplingConfig(temperature=temperature, max_new_tokens=6, seed=3))
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]


@pytest.mark.slow
def test_hf_engine_stop_strings_and_weight_push(hf_engine, qwen_tokenizer):
    prompts = [qwen_tokenizer.encode("x")] * 4
    gens = hf_engine.generate(prompts, SamplingConfig(max_new_tokens=40, stop=["e"], seed=0))
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert stopped, "a random model should produce the letter 'e' within 40 tokens"
    for gen in stopped:
        assert gen.stop_reason == "e" and "e" in gen.text
        assert "e" not in qwen_tokenizer.decode(gen.token_ids[:-1])
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4)
    before = hf_engine.generate(prompts[:1], greedy)[0]
    state = {n: p + 0.5 * torch.randn_like(p) for n, p in hf_engine.model.named_parameters()}
    hf_engine.push_weights(state.items(), version=2)
    after = hf_engine.generate(prompts[:1], greedy)[0]
    assert hf_engine.version == 2 and after.token_ids != before.token_ids
    with pytest.raises(KeyError, match="not a parameter"):
        hf_engine.push_weights([("nope.weight", torch.zeros(1))], version=3)


def test_modules_that_crash_vllm_kernel_scan_are_hidden_while_it_starts():
    """vLLM 0.32 (CPU) calls vars(x).get on every module-level object; llvmlite's ffi.lib breaks that."""
    import sys
    import types

    from dspo.engines.vllm import _hide_modules_breaking_vllm

    class Weird:  # like llvmlite's _lib_wrapper: __dict__ is forwarded to something that is not a dict
        __slots__ = ()

        def __getattr__(self, name):
            return 42

    module = types.ModuleType("dspo_test_weird_module")
    module.lib = Weird()
    sys.modules[module.__name__] = module
    try:
        with _hide_modules_breaking_vllm():
            assert module.__name__ not in sys.modules and "dspo.engines.vllm" in sys.modules
        assert sys.modules[module.__name__] is module
    finally:
        del sys.modules[module.__name__]
