"""The memory plan of a run: what one device holds while it generates, updates and pushes weights (`dspo-plan`).

Pure arithmetic over typed inputs (`ModelShape`, `PlanSettings`); `dspo.training.plan_config` reads them from a
composed config and `dspo.plan` is the command. Every term says how it was computed;
docs/memory.md#the-memory-plan-dspo-plan holds the derivations and the measurements that check them
(`bench/plan_check.py`).

Why this departs from docs/scaling.md's hand-computed tables (written before this module):
- The residual stream stays in the master weights' dtype under autocast (Qwen2's RMSNorm and residual adds run in
  float32 with float32 weights), so checkpointed layer inputs cost 4 B per value, not 2.
- The LM head keeps `p` ([k, V] float32) of *every* chunk until the backward (`dspo.models.logprobs.HeadLogprobs`
  saves it per chunk): the chunk size bounds the transient logits, not what is kept, which grows with the trained
  positions of a micro-batch. The tables counted three chunks.
- The trained head's weight gradient is formed per chunk as a `[V, H]` product (in the compute dtype, then cast),
  a transient the size of the head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts and sizes of a causal LM, from its config.json (built on the meta device: exact counts)."""

    parameters: int  # all, tied weights once
    embedding: int  # the input embedding
    lm_head: int  # 0 when tied to the embedding
    per_layer: int  # one decoder layer
    layers: int
    hidden: int
    intermediate: int
    attention_width: int  # query heads x head dim
    kv_heads: int
    head_dim: int
    vocab: int
    largest_tensor: int  # elements of the largest single weight (the push gathers one at a time)
    lora_parameters: int = 0  # adapters at the config's rank (0: full fine-tuning)

    @property
    def root_unit(self) -> int:
        """Parameters outside the decoder layers: embedding, LM head, final norm (FSDP2's root unit)."""
        return self.parameters - self.layers * self.per_layer

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of one token in every layer: 2 x layers x KV heads x head dim x dtype."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class EngineSettings:
    """A generation engine whose memory lands on the planned device (`rollout.engine`, or env=planner's answerer)."""

    name: str  # "policy engine (vLLM)", ...
    kind: str  # vllm | hf
    shape: ModelShape
    dtype_bytes: int
    max_model_len: int
    gpu_memory_utilization: float | None = None  # vLLM on a GPU: its share of the device
    kv_cache_bytes: int | None = None  # vLLM on the CPU: kv_cache_space_gb
    tensor_parallel_size: int = 1
    batch_sequences: int = 0  # HF engine: sequences per generate batch
    sleeps_during_update: bool = False
    max_num_batched_tokens: int = 8192  # vLLM's profile run (its scheduler's default budget)


@dataclass(frozen=True)
class PlanSettings:
    """What a config decides about memory (dspo.training.plan_config.plan_settings reads it)."""

    device: str  # "GPU: NVIDIA H100 80GB HBM3 (detected)", "GPU: 80GB (plan.gpu)", "CPU: host memory"
    device_bytes: int
    on_gpu: bool
    shards: int  # FSDP2 data-parallel size (1 = replicated)
    fsdp: bool
    ddp: bool
    master_bytes: int  # model.dtype
    compute_bytes: int  # activations: 2 under bf16-mixed, else the master dtype
    lora: bool
    reference: bool  # a separate frozen reference model (kl_coef > 0, no LoRA)
    gradient_checkpointing: bool
    micro_tokens: int  # padded tokens of one forward: sequences x the longest (micro_batch_size or _tokens)
    sequence_tokens: int  # the longest trajectory (rollout.agent.max_total_tokens)
    trained_tokens: int  # trained positions of one micro-batch, at most
    head_chunk_rows: int  # algorithm.logprob_chunk_size
    reserve_bytes: int  # CUDA context, allocator slack / the process's own baseline on a CPU
    engines: tuple[EngineSettings, ...] = ()


@dataclass(frozen=True)
class Term:
    name: str
    how: str
    bytes: int
    phases: frozenset[str]  # of PHASES


PHASES = ("generation", "update", "weight push")


@dataclass
class MemoryPlan:
    shape: ModelShape  # the policy's
    settings: PlanSettings
    terms: list[Term] = field(default_factory=list)
    kv_tokens: dict[str, int] = field(default_factory=dict)  # engine name -> tokens its KV cache holds

    def phase_bytes(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if phase in t.phases)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_bytes)

    @property
    def peak(self) -> int:
        return self.phase_bytes(self.peak_phase)

    @property
    def margin(self) -> int:
        """Bytes left at the peak (negative: over by that much)."""
        return self.settings.device_bytes - self.peak

    def problems(self) -> list[str]:
        """Why it does not fit: over the device, or an engine whose KV cache cannot hold one sequence."""
        out = []
        if self.margin < 0:
            out.append(
                f"the {self.peak_phase} phase needs {self.peak / GB:.1f} GB of {self.settings.device_bytes / GB:.1f}"
            )
        for engine in self.settings.engines:
            tokens = self.kv_tokens.get(engine.name)
            if tokens is not None and tokens < engine.max_model_len:
                out.append(
                    f"the {engine.name}'s KV cache holds {max(tokens, 0):,} tokens, less than one sequence of "
                    f"max_model_len={engine.max_model_len:,} (vLLM refuses to start)"
                )
        return out

    @property
    def fits(self) -> bool:
        return not self.problems()

    def training_state_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.name in TRAINING_STATE)


TRAINING_STATE = ("parameters", "frozen base", "adapters", "gradients", "AdamW moments", "reference model")
ALL, UPDATE, PUSH = frozenset(PHASES), frozenset({"update"}), frozenset({"weight push"})


def memory_plan(shape: ModelShape, s: PlanSettings) -> MemoryPlan:
    """Per-device bytes of each term, and which phases hold it (docs/memory.md#the-memory-plan-dspo-plan)."""
    plan = MemoryPlan(shape, s)
    plan.terms += _state_terms(shape, s)
    plan.terms += _update_terms(shape, s)
    plan.terms += _push_terms(shape, s)
    for engine in s.engines:
        terms, tokens = _engine_terms(engine, s)
        plan.terms += terms
        plan.kv_tokens[engine.name] = tokens
    if s.reserve_bytes:
        how = "CUDA context, allocator slack, collectives' buffers" if s.on_gpu else "Python, torch, vLLM imports"
        plan.terms.append(Term("reserve", how + " (plan.reserve_gb)", s.reserve_bytes, ALL))
    return plan


def _state_terms(shape: ModelShape, s: PlanSettings) -> list[Term]:
    """Weights, gradients, AdamW's two moments (torch keeps them in the parameters' dtype), the reference model."""
    w, shard = s.shards, f" / {s.shards} (FSDP2 shards)" if s.shards > 1 else ""
    terms = []
    if s.lora:
        base, adapters = shape.parameters, shape.lora_parameters
        terms.append(Term("frozen base", f"{_n(base)} x {s.master_bytes} B{shard}", base * s.master_bytes // w, ALL))
        terms.append(Term("adapters", f"{_n(adapters)} x 4 B (fp32){shard}", adapters * 4 // w, ALL))
        trained, trained_bytes = adapters, 4
    else:
        trained, trained_bytes = shape.parameters, s.master_bytes
        terms.append(Term("parameters", f"{_n(trained)} x {trained_bytes} B{shard}", trained * trained_bytes // w, ALL))
    grads = trained * trained_bytes // w
    terms.append(Term("gradients", f"{_n(trained)} x {trained_bytes} B{shard}", grads, UPDATE))
    if s.ddp:
        terms.append(
            Term("DDP gradient buckets", "a copy of the gradients (gradient_as_bucket_view off)", grads, UPDATE)
        )
    moments = 2 * trained * trained_bytes // w
    terms.append(Term("AdamW moments", f"2 x {_n(trained)} x {trained_bytes} B{shard}", moments, ALL))
    if s.reference and not s.lora:  # with LoRA the reference is the base, adapters off
        ref = shape.parameters * s.master_bytes // w
        terms.append(
            Term("reference model", f"{_n(shape.parameters)} x {s.master_bytes} B{shard} (kl_coef > 0)", ref, ALL)
        )
    return terms


def _update_terms(shape: ModelShape, s: PlanSettings) -> list[Term]:
    """Activations of one micro-batch (its longest sequences), the LM head's kept probabilities, FSDP2's gathers."""
    tokens, h, a, r = s.micro_tokens, shape.hidden, s.compute_bytes, s.master_bytes
    layer = tokens * layer_activation_bytes(shape, a, r, not s.lora)
    terms = []
    if s.gradient_checkpointing:
        saved = shape.layers * tokens * h * r
        terms.append(
            Term("checkpointed layer inputs", f"{shape.layers} x {tokens:,} tokens x {h} x {r} B", saved, UPDATE)
        )
        how = f"{tokens:,} tokens x {layer_activation_bytes(shape, a, r, not s.lora):,} B"
        terms.append(Term("one layer recomputed", how, layer, UPDATE))
    else:
        how = f"{shape.layers} layers x {tokens:,} tokens x {layer_activation_bytes(shape, a, r, not s.lora):,} B"
        terms.append(Term("activations", how, shape.layers * layer, UPDATE))
    mask = tokens * s.sequence_tokens  # a [sequences, 1, L, L] boolean mask
    streams = 3 * tokens * h * r  # the final norm's input and output, the hidden states' gradient
    how = f"{tokens:,} x {s.sequence_tokens:,} x 1 B + 3 x {tokens:,} x {h} x {r} B"
    terms.append(Term("attention mask, final norm, hidden gradient", how, mask + streams, UPDATE))
    terms += _head_terms(shape, s)
    if s.fsdp:
        gathered = (shape.root_unit + 2 * shape.per_layer) * r
        terms.append(
            Term("FSDP2 gathered units", f"root ({_n(shape.root_unit)}) + 2 layers, x {r} B", gathered, UPDATE)
        )
    return terms


def _head_terms(shape: ModelShape, s: PlanSettings) -> list[Term]:
    k, v, a, r = s.trained_tokens, shape.vocab, s.compute_bytes, s.master_bytes
    chunk = min(s.head_chunk_rows, max(k, 1))
    kept = k * v * 4 + k * shape.hidden * r
    transient = chunk * v * 4  # the last chunk's logits beside its probabilities (counted with every chunk's in `kept`)
    terms = [
        Term(
            "LM head: p kept for backward",
            f"{k:,} trained positions x {v:,} x 4 B (+ their hidden states)",
            kept,
            UPDATE,
        ),
        Term("LM head: one chunk's logits", f"{chunk:,} rows x {v:,} x 4 B", transient, UPDATE),
    ]
    if not s.lora:  # the head's weight gradient of a chunk: [V, H] in the compute dtype, cast to the master's
        grad = v * shape.hidden * (a + r if a != r else r)
        terms.append(
            Term(
                "LM head: weight gradient of a chunk",
                f"{v:,} x {shape.hidden} x {a + r if a != r else r} B",
                grad,
                UPDATE,
            )
        )
    return terms


def _push_terms(shape: ModelShape, s: PlanSettings) -> list[Term]:
    """The push gathers (FSDP2) or casts one tensor at a time on the device, then moves it to the host."""
    if not s.engines:
        return []
    nbytes = s.master_bytes if s.fsdp else min(s.master_bytes, s.engines[0].dtype_bytes)
    return [
        Term(
            "weight push: one tensor",
            f"largest weight {_n(shape.largest_tensor)} x {nbytes} B",
            shape.largest_tensor * nbytes,
            PUSH,
        )
    ]


def _engine_terms(e: EngineSettings, s: PlanSettings) -> tuple[list[Term], int]:
    """An engine's bytes on the device and the tokens its KV cache holds."""
    weights = e.shape.parameters * e.dtype_bytes // e.tensor_parallel_size
    per_token = e.shape.kv_bytes_per_token(e.dtype_bytes) // e.tensor_parallel_size
    phases = frozenset({"generation", "weight push"}) if e.sleeps_during_update else ALL
    if e.kind == "hf":
        cache = e.batch_sequences * e.max_model_len * per_token
        return [
            Term(f"{e.name}: weights", f"{_n(e.shape.parameters)} x {e.dtype_bytes} B", weights, ALL),
            Term(
                f"{e.name}: generate cache",
                f"{e.batch_sequences} sequences x {e.max_model_len:,} x {per_token:,} B",
                cache,
                ALL,
            ),
        ], e.batch_sequences * e.max_model_len
    if s.on_gpu:
        budget = int((e.gpu_memory_utilization or 0) * s.device_bytes)
        activations = engine_activation_bytes(e)
        kv = budget - weights - activations
        terms = [
            Term(f"{e.name}: weights", f"{_n(e.shape.parameters)} x {e.dtype_bytes} B", weights, phases),
            Term(
                f"{e.name}: activations (profile)", f"{e.max_num_batched_tokens:,} batched tokens", activations, phases
            ),
            Term(
                f"{e.name}: KV cache",
                f"gpu_memory_utilization {e.gpu_memory_utilization} x {s.device_bytes / GB:.1f} GB - the two above",
                max(kv, 0),
                phases,
            ),
        ]
        if e.sleeps_during_update:
            terms.append(Term(f"{e.name}: asleep", "what a sleeping engine keeps (estimate)", int(0.5 * GB), UPDATE))
        return terms, kv // per_token
    kv = e.kv_cache_bytes or 0
    return [
        Term(f"{e.name}: weights", f"{_n(e.shape.parameters)} x {e.dtype_bytes} B", weights, ALL),
        Term(f"{e.name}: KV cache", f"kv_cache_space_gb {kv / GIB:g} GiB", kv, ALL),
    ], kv // per_token


def layer_activation_bytes(
    shape: ModelShape, compute_bytes: int, residual_bytes: int, trained_norms: bool = True
) -> int:
    """Bytes autograd keeps per token for one Qwen2/Llama-style decoder layer (no checkpointing):
    - the layer input and the mid-layer residual (residual dtype);
    - each RMSNorm's fp32 normalized input when its weight is trained (autograd keeps a product's other factor only
      for a factor that needs a gradient: with LoRA the norms are frozen), and its output as the projections keep
      it: one shared tensor without autocast, one cast copy per projection under it (autocast caches casts of
      weights, not of activations): 3 for q/k/v, 2 for gate/up;
    - SDPA's query / repeated key / repeated value / output and o_proj's contiguous input (5 x heads x head dim);
    - the MLP's gate, SiLU, up and product (4 x intermediate)."""
    h, q, i, a, r = shape.hidden, shape.attention_width, shape.intermediate, compute_bytes, residual_bytes
    normalized = 2 * 4 * h if trained_norms else 0
    norm_outputs = (3 + 2) * a * h if a != r else 2 * a * h
    return 2 * r * h + normalized + norm_outputs + 5 * q * a + 4 * i * a


def engine_activation_bytes(e: EngineSettings) -> int:
    """vLLM's profile run: one forward of max_num_batched_tokens (MLP and attention buffers of one layer) plus the
    sampler's logits for 256 sequences (vLLM's default max_num_seqs). An estimate; vLLM measures it at start."""
    t, s = e.max_num_batched_tokens, e.shape
    return t * (3 * s.intermediate + 4 * s.hidden + 3 * s.attention_width) * e.dtype_bytes + 256 * s.vocab * 4


def kv_trajectories(plan: MemoryPlan, engine: EngineSettings) -> float:
    """How many trajectories of the engine's max_model_len its KV cache holds at once."""
    return max(plan.kv_tokens.get(engine.name, 0), 0) / engine.max_model_len


def _n(count: int) -> str:
    """1,234,567,890 -> '1.23 B'; 40,370,176 -> '40.4 M'."""
    if count >= 1e9:
        return f"{count / 1e9:.2f} B"
    if count >= 1e6:
        return f"{count / 1e6:.1f} M"
    return f"{count:,}"
