"""`HFEngine`: a transformers model behind the `RolloutEngine` protocol (`dspo.engines.base`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from dspo.engines.base import SamplingConfig, _eos_ids, _single_token_stops
from dspo.types import Generation


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
