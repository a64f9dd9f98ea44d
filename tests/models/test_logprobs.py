import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dspo.models.logprobs import masked_token_logprobs


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config).eval()


def _reference(model, ids, attention, mask, temperature=1.0):
    logits = model(input_ids=ids, attention_mask=attention).logits.float() / temperature
    full = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
    out = torch.zeros(mask.shape)
    out[:, 1:] = full * mask[:, 1:]
    return out


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_full_log_softmax_at_masked_positions(model, chunk_size, temperature):
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (3, 9))
    attention = torch.ones_like(ids)
    attention[2, 6:] = 0  # right padding
    mask = torch.zeros(3, 9)
    mask[0, 4:] = 1
    mask[1, 2:5] = 1
    mask[1, 7] = 1
    mask[2, 3:6] = 1
    got, entropy = masked_token_logprobs(model, ids, attention, mask, temperature, chunk_size, with_entropy=True)
    want = _reference(model, ids, attention, mask, temperature)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[mask == 0] == 0).all()
    assert (entropy[mask == 1] > 0).all() and (entropy[mask == 0] == 0).all()


def test_gradients_flow_only_through_masked_tokens(model):
    ids = torch.randint(0, 97, (2, 6))
    mask = torch.zeros(2, 6)
    mask[:, 3:] = 1
    model.zero_grad()
    got, _ = masked_token_logprobs(model, ids, torch.ones_like(ids), mask)
    got.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_empty_mask_and_first_token_rule(model):
    ids = torch.randint(0, 97, (2, 5))
    got, _ = masked_token_logprobs(model, ids, torch.ones_like(ids), torch.zeros(2, 5))
    assert got.shape == (2, 5) and (got == 0).all()
    bad = torch.zeros(2, 5)
    bad[0, 0] = 1
    with pytest.raises(ValueError, match="first token"):
        masked_token_logprobs(model, ids, torch.ones_like(ids), bad)


def _grads(model, ids, attention, mask, weights, **kwargs):
    model.zero_grad()
    logprobs, entropy = masked_token_logprobs(model, ids, attention, mask, **kwargs)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_size", [2, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_head_equals_autograd_values_entropy_and_every_gradient(tied, chunk_size, temperature):
    """HeadLogprobs' hand-written backward against autograd's log_softmax path: same logprobs, entropy and gradient of
    every parameter (LM head, embeddings, decoder), for a weighted sum of the logprobs (signs differ per token, as
    advantages do), tied and untied heads, several chunks, and a temperature."""
    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, 61, (3, 8))
    attention = torch.ones_like(ids)
    attention[1, 6:] = 0
    mask = torch.zeros(3, 8)
    mask[0, 2:] = 1
    mask[1, 3:6] = 1
    mask[2, 5:] = 1
    weights = torch.randn(3, 8)
    kwargs = {"temperature": temperature, "chunk_size": chunk_size, "with_entropy": True}
    fused = _grads(model, ids, attention, mask, weights, **kwargs)
    reference = _grads(model, ids, attention, mask, weights, fallback=True, **kwargs)
    torch.testing.assert_close(fused[0], reference[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused[1], reference[1], atol=1e-5, rtol=1e-5)
    assert fused[2].keys() == reference[2].keys()
    for name, grad in reference[2].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(fused[2][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_fused_head_with_a_bias_and_without_entropy():
    from dspo.models.logprobs import HeadLogprobs

    torch.manual_seed(4)
    head = torch.nn.Linear(16, 40, bias=True)
    hidden = torch.randn(5, 16, requires_grad=True)
    targets = torch.randint(0, 40, (5,))
    upstream = torch.randn(5)
    logprobs, entropy = HeadLogprobs.apply(hidden, head.weight, head.bias, targets, 0.8, False)
    (logprobs * upstream).sum().backward()
    got = (logprobs.detach(), hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    assert entropy.numel() == 0
    hidden.grad, head.weight.grad, head.bias.grad = None, None, None
    want = torch.log_softmax(head(hidden) / 0.8, -1).gather(1, targets[:, None]).squeeze(1)
    (want * upstream).sum().backward()
    for a, b in zip(got, (want.detach(), hidden.grad, head.weight.grad, head.bias.grad), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_fused_head_under_no_grad_gives_the_same_values(model):
    """Old and reference logprobs run under no_grad: the head then keeps nothing for a backward, same values."""
    ids = torch.randint(0, 97, (2, 7))
    mask = torch.zeros(2, 7)
    mask[:, 2:] = 1
    with_grad, entropy = masked_token_logprobs(model, ids, torch.ones_like(ids), mask, 0.9, 4, with_entropy=True)
    with torch.no_grad():
        plain, no_entropy = masked_token_logprobs(model, ids, torch.ones_like(ids), mask, 0.9, 4)
        with_entropy = masked_token_logprobs(model, ids, torch.ones_like(ids), mask, 0.9, 4, with_entropy=True)
    assert not plain.requires_grad and no_entropy is None
    torch.testing.assert_close(plain, with_grad.detach(), atol=0, rtol=0)
    torch.testing.assert_close(with_entropy[1], entropy, atol=0, rtol=0)
