"""Token logprobs of a causal LM at the trained positions only.

Why not `model(input_ids).logits.log_softmax(-1)`: with a 151k vocabulary the `[B, L, vocab]` float32 tensor (and
its log-softmax copy) dominates memory and time of an RL step, although only the model-generated tokens are trained.
Here the decoder runs once, the hidden states of the positions that predict a trained token are gathered first
(`[K, H]`, K = number of trained tokens), and the LM head + log-softmax run on those in chunks of `chunk_size` rows.

Why a hand-written backward for the head (`HeadLogprobs`): autograd's path (linear, temperature division,
log_softmax, gather, entropy) makes about 20 passes over each `[k, vocab]` chunk and allocates several copies of it;
at a 151k vocabulary those memory-bound passes cost more than the head's matmuls on CPU (bench/README.md, profile).
The gradient of logπ(t) with respect to the logits is onehot(t) - p, so the forward keeps p (the one `[k, V]` tensor
autograd would keep too), and the backward scales it in place and runs the two matmuls. Heads that are not an
`nn.Linear` take the autograd path (`_autograd_head_logprobs`), which is also the reference the tests compare with.

Why a workspace (`HeadWorkspace`, CPU float32 only): each chunk needs two `[k, V]` float32 buffers (the logits, then
the log-probabilities), 0.6 GB each at k = 1,000 and a 151k vocabulary. PyTorch's CPU allocator hands such sizes to
glibc's `posix_memalign`, which maps fresh pages for each one by default and, on the heap that
`dspo.process.runtime.configure_allocator` keeps, often cannot hand a freed block back for the same size (the aligned
request is larger than the block it freed; glibc 2.36): either way chunks paid the kernel's page faults and zeroing
again (the update's lost time in issue 40's profile). The workspace keeps freed buffers for
the next chunk: the matmul and the log-softmax write into them (`out=`, the same kernels as `F.linear` and
`log_softmax`, so the results are bit-identical), and the buffer the backward keeps is returned when the backward has
used it. New buffers get 512 rows of headroom, so a slightly longer batch reuses them too. Between steps the workspace
holds at most two buffers, `(rows + 512) x V` floats each, rows <= `algorithm.logprob_chunk_size` (the memory the
step's peak needed anyway; `WORKSPACE.clear()` frees them). CUDA's caching allocator already reuses memory, so GPUs
take the plain path.
"""

from __future__ import annotations

import torch
from torch import nn


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None:
        raise TypeError(
            f"{type(model).__name__} exposes no get_decoder()/get_output_embeddings(); dspo needs a Hugging Face "
            "causal LM (AutoModelForCausalLM) whose decoder returns hidden states"
        )
    return decoder, head


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on this device type now, None when autocast is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class HeadWorkspace:
    """Free float32 CPU buffers for the head's `[k, V]` tensors, reused across chunks and calls (module docstring).
    Holds at most `keep` buffers (2: a chunk's logits and log-probabilities), the largest ones."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.free: list[torch.Tensor] = []

    def take(self, rows: int, cols: int) -> torch.Tensor:
        """A `[rows, cols]` float32 CPU tensor: the smallest free buffer that holds it, else a new one."""
        need = rows * cols
        fitting = [i for i, b in enumerate(self.free) if b.numel() >= need]
        if not fitting:  # room for 512 rows more: a slightly longer batch later reuses it rather than faulting anew
            return torch.empty((rows + 512) * cols, dtype=torch.float32)[:need].view(rows, cols)
        buffer = self.free.pop(min(fitting, key=lambda i: self.free[i].numel()))
        return buffer[:need].view(rows, cols)

    def give(self, tensor: torch.Tensor) -> None:
        """Return a tensor taken from `take` (its whole buffer) for reuse."""
        root = tensor._base if tensor._base is not None else tensor  # the whole (contiguous) allocation
        self.free.append(root.view(-1))
        self.free.sort(key=torch.Tensor.numel, reverse=True)
        del self.free[self.keep :]

    def clear(self) -> None:
        self.free.clear()


WORKSPACE = HeadWorkspace()


def _pooled(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype) -> bool:
    """Whether the head runs in the workspace: float32 on the CPU, outside autocast."""
    tensors = [hidden, weight] + ([bias] if bias is not None else [])
    return compute_dtype is None and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _logits_and_log_probs(hidden, weight, bias, temperature: float, pooled: bool):
    """logits [k, V] (float32; divided by the temperature) and their log-softmax [k, V], in workspace buffers when
    `pooled` (the same kernels either way)."""
    if pooled:
        logits = WORKSPACE.take(hidden.shape[0], weight.shape[0])
        if bias is None:
            torch.mm(hidden, weight.t(), out=logits)
        else:
            torch.addmm(bias, hidden, weight.t(), out=logits)
    else:
        logits = torch.nn.functional.linear(hidden, weight, bias).float()  # [k, V]
    if temperature != 1.0:
        logits.div_(temperature)
    if not pooled:
        return logits, torch.log_softmax(logits, dim=-1)
    log_probs = WORKSPACE.take(*logits.shape)
    torch.ops.aten._log_softmax.out(logits, -1, False, out=log_probs)
    return logits, log_probs


class HeadLogprobs(torch.autograd.Function):
    """logπ(targets) under softmax((hidden @ weightᵀ + bias) / temperature) for one chunk of rows, in float32; the
    entropy too when asked (no gradient). Inputs: hidden [k, H], weight [V, H], bias [V] or None, targets [k].
    Returns logprobs [k] and entropy [k] (an empty tensor when not asked).

    Mixed precision: under autocast (bf16-mixed) the forward's matmul runs in the autocast dtype, as `F.linear` does
    there; the backward's two matmuls run in that dtype too and cast their results back to the inputs' dtypes, which
    is what autograd does for an autocast matmul (a custom Function's backward runs outside autocast, so it is
    re-entered here by hand rather than with `torch.amp.custom_bwd`, whose device type is fixed at decoration)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, with_entropy: bool, for_backward: bool = True):
        ctx.compute_dtype = _autocast_dtype(hidden.device.type)
        ctx.pooled = pooled = _pooled(hidden, weight, bias, ctx.compute_dtype)
        logits, log_probs = _logits_and_log_probs(hidden, weight, bias, temperature, pooled)
        logprobs = log_probs.gather(1, targets[:, None]).squeeze(1)
        probs, entropy = None, logprobs.new_empty(0)
        if with_entropy:  # p goes into the logits' buffer: a fresh [k, V] tensor costs more than the exp (bench/README)
            probs = torch.exp(log_probs, out=logits)
            entropy = -torch.bmm(probs[:, None, :], log_probs[:, :, None]).view(-1)  # row dots, no [k, V] temporary
        elif for_backward:
            probs = log_probs.exp_()
        if pooled:  # what the backward does not keep goes back now
            for used in (logits, log_probs):
                if not for_backward or used.data_ptr() != probs.data_ptr():
                    WORKSPACE.give(used)
        del logits, log_probs
        if for_backward:  # (old / reference logprobs under no_grad keep nothing)
            ctx.save_for_backward(hidden, weight, probs, targets)
        ctx.has_bias, ctx.temperature = bias is not None, temperature
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, probs, targets = ctx.saved_tensors
        # d logπ(t) / d raw logits = (onehot(t) - p) / temperature; scaled by the incoming gradient, in place over p
        scale = (grad_logprobs.float() / ctx.temperature)[:, None]  # [k, 1]
        grad_logits = probs.mul_(-scale)
        grad_logits.scatter_add_(1, targets[:, None], scale)
        dtype = ctx.compute_dtype or weight.dtype
        grad_logits = grad_logits.to(dtype)
        grad_hidden = (grad_logits @ weight.to(dtype)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad_logits.t() @ hidden.to(dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad_logits.sum(0).to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if ctx.pooled:  # p was scaled in place into the gradient, used above: its buffer is free
            WORKSPACE.give(probs)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _autograd_head_logprobs(head: nn.Module, hidden, targets, temperature: float, with_entropy: bool):
    """The same as `HeadLogprobs` through autograd, for any head module (and as the tests' reference)."""
    log_probs = torch.log_softmax(head(hidden).float() / temperature, dim=-1)  # [k, V]
    logprobs = log_probs.gather(1, targets[:, None]).squeeze(1)
    if not with_entropy:
        return logprobs, logprobs.new_empty(0)
    with torch.no_grad():
        return logprobs, -(log_probs.exp() * log_probs).sum(-1)


def masked_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 2048,
    with_entropy: bool = False,
    fallback: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logπ(token_t | tokens_<t) for every t with loss_mask[:, t] = 1; 0 elsewhere.

    Args:
        input_ids, attention_mask, loss_mask: [N, L]; loss_mask[:, 0] must be 0 (nothing predicts the first token).
        temperature: the sampling temperature of the rollouts; logits are divided by it so that logπ here is the
            distribution the engine sampled from (as verl does).
        chunk_size: rows of the LM head computed at once (memory knob).
        with_entropy: also return the entropy of each trained position's distribution (detached).
        fallback: use autograd's path for the head even when it is an `nn.Linear` (the tests' reference).

    Returns:
        logprobs [N, L] (differentiable) and entropy [N, L] or None.
    """
    if loss_mask[:, 0].any():
        raise ValueError("loss_mask[:, 0] must be 0: the first token of a sequence has no prediction")
    decoder, head = _decoder_and_head(model)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [N, L, H]
    rows, cols = loss_mask[:, 1:].nonzero(as_tuple=True)  # trained token at cols+1, predicted from cols
    selected = hidden[rows, cols]  # [K, H]
    targets = input_ids[rows, cols + 1]  # [K]
    fused = isinstance(head, nn.Linear) and not fallback
    trainable = [selected, head.weight] + ([head.bias] if getattr(head, "bias", None) is not None else [])
    for_backward = torch.is_grad_enabled() and any(t.requires_grad for t in trainable)
    token_logprobs, token_entropy = [], []
    # At least one chunk, even with no trained token: the (empty) result is then still connected to the parameters,
    # so a micro-batch without trained tokens backpropagates zeros like any other, instead of a loss with no grad_fn
    # (and under DDP every rank joins the same gradient all-reduce).
    for start in range(0, max(selected.shape[0], 1), chunk_size):
        rows_k, targets_k = selected[start : start + chunk_size], targets[start : start + chunk_size]
        if fused:
            logprobs, entropy = HeadLogprobs.apply(
                rows_k, head.weight, head.bias, targets_k, temperature, with_entropy, for_backward
            )
        else:
            logprobs, entropy = _autograd_head_logprobs(head, rows_k, targets_k, temperature, with_entropy)
        token_logprobs.append(logprobs)
        token_entropy.append(entropy)
    out = torch.zeros(loss_mask.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(out) if with_entropy else None
    out = out.index_put((rows, cols + 1), torch.cat(token_logprobs))
    if with_entropy:
        entropy = entropy.index_put((rows, cols + 1), torch.cat(token_entropy))
    return out, entropy


class MaskedLogprobs(nn.Module):
    """`forward(...)` = `masked_token_logprobs(lm, ...)`, as a module.

    Why: `masked_token_logprobs` calls the decoder and the LM head separately, never the LM's own `forward`. Under
    FSDP2 the parameters of the root unit (embeddings, final norm, LM head) are gathered and their gradients
    reduce-scattered by hooks on the root module's forward; making this wrapper the root unit puts every one of
    those parameters (tied or not) under one forward. It owns no parameters of its own: keep it out of the
    LightningModule's module tree so that names stay `policy.*` (see `dspo.models.fsdp.shard_for_logprobs`).
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float = 1.0,
        chunk_size: int = 2048,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return masked_token_logprobs(
            self.lm, input_ids, attention_mask, loss_mask, temperature, chunk_size, with_entropy
        )
