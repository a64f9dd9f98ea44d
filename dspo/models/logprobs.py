"""Token logprobs of a causal LM at the trained positions only.

Why not `model(input_ids).logits.log_softmax(-1)`: with a 151k vocabulary the `[B, L, vocab]` float32 tensor (and
its log-softmax copy) dominates memory and time of an RL step, although only the model-generated tokens are trained.
Here the decoder runs once, the hidden states of the positions that predict a trained token are gathered first
(`[K, H]`, K = number of trained tokens), and the LM head + log-softmax run on those in chunks of `chunk_size` rows.
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


def masked_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 2048,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logπ(token_t | tokens_<t) for every t with loss_mask[:, t] = 1; 0 elsewhere.

    Args:
        input_ids, attention_mask, loss_mask: [N, L]; loss_mask[:, 0] must be 0 (nothing predicts the first token).
        temperature: the sampling temperature of the rollouts; logits are divided by it so that logπ here is the
            distribution the engine sampled from (as verl does).
        chunk_size: rows of the LM head computed at once (memory knob).
        with_entropy: also return the entropy of each trained position's distribution (detached).

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
    token_logprobs, token_entropy = [], []
    for start in range(0, selected.shape[0], chunk_size):
        logits = head(selected[start : start + chunk_size]).float() / temperature  # [k, V]
        log_probs = torch.log_softmax(logits, dim=-1)
        token_logprobs.append(log_probs.gather(1, targets[start : start + chunk_size, None]).squeeze(1))
        if with_entropy:
            with torch.no_grad():
                token_entropy.append(-(log_probs.exp() * log_probs).sum(-1))
    out = torch.zeros(loss_mask.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(out) if with_entropy else None
    if token_logprobs:
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
