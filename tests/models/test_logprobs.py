from types import SimpleNamespace

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


class _MatmulDtypes:
    """Records the dtypes of the matrix products run while active (aten mm/addmm/bmm), for the autocast test."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                    seen.append(args[-2].dtype if func.overloadpacket is torch.ops.aten.addmm else args[0].dtype)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def test_fused_head_under_bf16_autocast_matches_autograd_and_runs_its_backward_in_bf16():
    """Issue 29 (7): under bf16-mixed precision the head's backward must run its two [rows, V] x [V, H] matmuls in the
    autocast dtype, as autograd's path does, and give autograd's gradients."""
    from dspo.models.logprobs import HeadLogprobs, _autograd_head_logprobs

    torch.manual_seed(5)
    head = torch.nn.Linear(32, 300, bias=False)
    hidden = torch.randn(12, 32, requires_grad=True)
    targets = torch.randint(0, 300, (12,))
    upstream = torch.randn(12)
    results = {}
    for name in ("fused", "autograd"):
        hidden.grad, head.weight.grad = None, None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if name == "fused":
                logprobs, _ = HeadLogprobs.apply(hidden, head.weight, None, targets, 0.9, False)
            else:
                logprobs, _ = _autograd_head_logprobs(head, hidden, targets, 0.9, False)
        with _MatmulDtypes() as backward:
            (logprobs * upstream).sum().backward()
        results[name] = (logprobs.detach(), hidden.grad.clone(), head.weight.grad.clone(), backward.seen)
    fused, reference = results["fused"], results["autograd"]
    assert reference[3] and set(reference[3]) == {torch.bfloat16}  # what autograd does under autocast
    assert fused[3] and set(fused[3]) == {torch.bfloat16}
    torch.testing.assert_close(fused[0], reference[0], atol=0, rtol=0)  # the same bf16 logits, the same fp32 softmax
    for got, want in zip(fused[1:3], reference[1:3]):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-2)  # bf16 products, summed in another order


def test_fused_head_with_only_its_bias_trainable():
    """Issue 29 (12): a frozen decoder and head weight with a trainable bias (a bias-only fine-tune) must backward."""
    torch.manual_seed(6)
    head = torch.nn.Linear(16, 40, bias=True)
    head.weight.requires_grad_(False)
    hidden, targets, upstream = torch.randn(6, 16), torch.randint(0, 40, (5,)), torch.randn(5)

    class FrozenDecoderLM(torch.nn.Module):  # a decoder whose hidden states need no gradient
        def get_decoder(self):
            return lambda input_ids, attention_mask: SimpleNamespace(last_hidden_state=hidden[None])

        def get_output_embeddings(self):
            return head

    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), targets[None]], dim=1)  # [1, 6]: position t predicts t+1
    mask = torch.ones(1, 6)
    mask[0, 0] = 0
    logprobs, _ = masked_token_logprobs(FrozenDecoderLM(), ids, torch.ones_like(ids), mask)
    (logprobs[0, 1:] * upstream).sum().backward()
    got = head.bias.grad.clone()
    head.bias.grad = None
    want = torch.log_softmax(head(hidden[:5]), -1).gather(1, targets[:, None]).squeeze(1)
    (want * upstream).sum().backward()
    torch.testing.assert_close(got, head.bias.grad, atol=1e-6, rtol=1e-5)


def test_a_mask_without_trained_tokens_still_backpropagates(model):
    """Issue 29 (12): no trained token in a micro-batch gives logprobs connected to the graph (zeros), so the loss
    has a grad_fn and the backward gives zero gradients instead of raising."""
    ids = torch.randint(0, 97, (2, 5))
    model.zero_grad(set_to_none=True)
    got, _ = masked_token_logprobs(model, ids, torch.ones_like(ids), torch.zeros(2, 5))
    assert got.requires_grad and (got == 0).all()
    got.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and (g == 0).all() for g in grads)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_workspace_gives_bit_identical_values_and_gradients_and_reuses_its_buffers(with_entropy, bias):
    """The CPU workspace (`HeadWorkspace`) writes into reused buffers with the same kernels: values, entropy and every
    gradient equal the unpooled path's bit for bit, over several chunks and calls, and its buffers come back."""
    from dspo.models import logprobs as lp

    torch.manual_seed(5)
    head = torch.nn.Linear(16, 40, bias=bias)
    hidden = torch.randn(7, 16, requires_grad=True)
    targets = torch.randint(0, 40, (7,))
    upstream = torch.randn(7)

    def run(pooled: bool):
        original = lp._pooled
        lp._pooled = lambda *args: pooled and original(*args)
        try:
            hidden.grad, head.weight.grad = None, None
            chunks = [lp.HeadLogprobs.apply(hidden[i : i + 3], head.weight, head.bias, targets[i : i + 3], 0.9,
                                            with_entropy) for i in range(0, 7, 3)]  # fmt: skip
            logprobs = torch.cat([c[0] for c in chunks])
            (logprobs * upstream).sum().backward()
            with torch.no_grad():  # old / reference logprobs: nothing kept for a backward
                again = lp.HeadLogprobs.apply(hidden, head.weight, head.bias, targets, 0.9, with_entropy, False)[0]
            return logprobs.detach(), torch.cat([c[1] for c in chunks]), again, hidden.grad, head.weight.grad
        finally:
            lp._pooled = original

    lp.WORKSPACE.clear()
    plain = run(False)
    assert lp.WORKSPACE.free == []
    for _ in range(2):  # the second call runs on the first one's buffers
        pooled = run(True)
        for a, b in zip(pooled, plain, strict=True):
            assert torch.equal(a, b)
    lp.WORKSPACE.clear()

    def one_micro_batch():  # its forward and backward, as a training step runs them
        logprobs, _ = lp.HeadLogprobs.apply(hidden, head.weight, head.bias, targets, 0.9, with_entropy)
        (logprobs * upstream).sum().backward()

    one_micro_batch()
    kept = {b.data_ptr() for b in lp.WORKSPACE.free}
    assert len(kept) == 2 and all(b.numel() >= 7 * 40 for b in lp.WORKSPACE.free)
    one_micro_batch()
    assert {b.data_ptr() for b in lp.WORKSPACE.free} == kept  # reused, not reallocated
    lp.WORKSPACE.clear()
