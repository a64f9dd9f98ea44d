"""The memory plan (dspo.training.plan, plan_config, plan_report; `dspo-plan`): hand-computed terms, docs/scaling.md's
tables recomputed, the recipes fit their GPUs, suggestions that fit, the check a GPU run makes, and properties over
generated shapes and settings (a plan that grows the wrong way with an input is wrong for every model)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspo.plan import main as plan_main
from dspo.testing import compose_config
from dspo.training.plan import GB, GIB, EngineSettings, ModelShape, PlanSettings, layer_activation_bytes, memory_plan
from dspo.training.plan_config import model_shape, parse_gpu, plan_of
from dspo.training.plan_report import PlanDoesNotFit, check_plan, suggestions

SHAPES = "data/model_configs"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def terms(plan) -> dict[str, int]:
    return {t.name: t.bytes for t in plan.terms}


def paper(size: str, *overrides: str):
    return compose_config(
        "train",
        [f"experiment=paper_qwen2.5_{size}", f"model.path={SHAPES}/qwen2.5-{size}", "plan.gpu=80GB", *overrides],
    )


# --- the model's counts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "parameters", "lora_r16"),
    [("7b", 7_615_616_512, 40_370_176), ("3b", 3_085_938_688, 29_933_568), ("0.5b", 494_032_768, 8_798_208)],
)
def test_shipped_shapes_count_as_the_published_models(size, parameters, lora_r16):
    shape = model_shape(f"{SHAPES}/qwen2.5-{size}", 16, TARGETS)
    assert shape.parameters == parameters
    assert shape.lora_parameters == lora_r16
    assert shape.layers * shape.per_layer + shape.root_unit == parameters


def test_missing_config_json_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path=.*no config.json"):
        model_shape(str(tmp_path))


# --- hand-computed terms --------------------------------------------------------------------------------------------

TOY = ModelShape(
    parameters=1000, embedding=200, lm_head=0, per_layer=350, layers=2, hidden=8, intermediate=16,
    attention_width=8, kv_heads=2, head_dim=4, vocab=25, largest_tensor=200,
)  # fmt: skip
CPU = PlanSettings(
    device="CPU", device_bytes=10**6, on_gpu=False, shards=1, fsdp=False, ddp=False, master_bytes=4, compute_bytes=4,
    lora=False, reference=False, gradient_checkpointing=False, micro_tokens=6, sequence_tokens=3, trained_tokens=4,
    head_chunk_rows=3, reserve_bytes=0,
)  # fmt: skip


def test_layer_activations_by_hand():
    # 2 x 4 x 8 (residuals) + 2 x 4 x 8 (normalized) + 2 x 4 x 8 (norm outputs) + 5 x 8 x 4 (attention) + 4 x 16 x 4
    assert layer_activation_bytes(TOY, 4, 4) == 64 + 64 + 64 + 160 + 256
    # bf16 compute over an fp32 residual: each of q/k/v/gate/up keeps its own bf16 cast (5 x 2 x 8)
    assert layer_activation_bytes(TOY, 2, 4) == 64 + 64 + 80 + 80 + 128
    # frozen norms (LoRA): no normalized input kept
    assert layer_activation_bytes(TOY, 4, 4, trained_norms=False) == 64 + 64 + 160 + 256


def test_full_fine_tuning_terms_by_hand():
    t = terms(memory_plan(TOY, CPU))
    assert (t["parameters"], t["gradients"], t["AdamW moments"]) == (4000, 4000, 8000)
    assert t["activations"] == 2 * 6 * 608
    assert t["attention mask, final norm, hidden gradient"] == 6 * 3 + 3 * 6 * 8 * 4
    assert t["LM head: p kept for backward"] == 4 * 25 * 4 + 4 * 8 * 4
    assert t["LM head: one chunk's logits"] == 3 * 25 * 4
    assert t["LM head: weight gradient of a chunk"] == 25 * 8 * 4
    assert "reference model" not in t and "FSDP2 gathered units" not in t


def test_sharding_reference_checkpointing_and_lora_by_hand():
    sharded = terms(memory_plan(TOY, replace(CPU, shards=4, fsdp=True, reference=True, gradient_checkpointing=True)))
    assert (sharded["parameters"], sharded["AdamW moments"], sharded["reference model"]) == (1000, 2000, 1000)
    assert sharded["checkpointed layer inputs"] == 2 * 6 * 8 * 4
    assert sharded["one layer recomputed"] == 6 * 608
    assert sharded["FSDP2 gathered units"] == (300 + 2 * 350) * 4
    lora = terms(memory_plan(replace(TOY, lora_parameters=40), replace(CPU, lora=True, master_bytes=2, reference=True)))
    assert (lora["frozen base"], lora["adapters"], lora["gradients"], lora["AdamW moments"]) == (2000, 160, 160, 320)
    assert "reference model" not in lora and "LM head: weight gradient of a chunk" not in lora


def test_vllm_engine_on_a_gpu_by_hand():
    engine = EngineSettings(
        name="e", kind="vllm", shape=TOY, dtype_bytes=2, max_model_len=10, gpu_memory_utilization=0.5,
        max_num_batched_tokens=4,
    )  # fmt: skip
    plan = memory_plan(TOY, replace(CPU, on_gpu=True, device_bytes=100_000, engines=(engine,)))
    t = terms(plan)
    activations = 4 * (3 * 16 + 4 * 8 + 3 * 8) * 2 + 256 * 25 * 4
    assert t["e: weights"] == 2000 and t["e: activations (profile)"] == activations
    assert t["e: KV cache"] == 50_000 - 2000 - activations
    assert plan.kv_tokens["e"] == (50_000 - 2000 - activations) // (2 * 2 * 2 * 4 * 2)


# --- docs/scaling.md's tables, now computed ---------------------------------------------------------------------


def test_the_eight_gpu_seven_b_training_state_of_docs_scaling():
    t = terms(plan_of(paper("7b", "trainer.devices=8")))
    assert [round(t[k] / GB, 2) for k in ("parameters", "gradients", "AdamW moments")] == [3.81, 3.81, 7.62]


@pytest.mark.parametrize(
    ("size", "lora", "expected"),
    [
        ("3b", False, [12.34, 12.34, 24.69]),
        ("3b", True, [6.29, 0.12, 0.24]),
        ("7b", False, [30.46, 30.46, 60.92]),
        ("7b", True, [15.39, 0.16, 0.32]),
    ],
)
def test_the_one_gpu_full_against_lora_table_of_docs_scaling(size, lora, expected):
    extra = ["trainer=gpu", "model.lora.r=16", "model.dtype=bfloat16"] if lora else ["trainer=gpu"]
    t = terms(plan_of(paper(size, *extra)))
    weights = t["frozen base"] + t["adapters"] if lora else t["parameters"]
    assert [round(x / GB, 2) for x in (weights, t["gradients"], t["AdamW moments"])] == expected


# --- recipes, suggestions, the command -----------------------------------------------------------------------------

RECIPES = [
    ("one_gpu_qwen2.5_7b_lora", "7b", "80GB", []),
    ("one_gpu_qwen2.5_3b_lora", "3b", "80GB", []),
    ("one_gpu_qwen2.5_3b", "3b", "80GB", []),
    ("gpu24_qwen2.5_3b_lora", "3b", "24GB", []),
    ("paper_qwen2.5_7b", "7b", "80GB", ["trainer.devices=8"]),
    ("paper_qwen2.5_3b", "3b", "80GB", ["trainer.devices=8"]),
]


@pytest.mark.parametrize(("experiment", "size", "gpu", "extra"), RECIPES)
def test_each_recipe_fits_its_named_gpu(capsys, experiment, size, gpu, extra):
    status = plan_main([f"experiment={experiment}", f"model.path={SHAPES}/qwen2.5-{size}", f"plan.gpu={gpu}", *extra])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "fits:" in out and "trajectories of 4,096 tokens" in out


def test_a_config_that_does_not_fit_exits_1_and_every_suggestion_fits(capsys):
    args = ["--json", "experiment=paper_qwen2.5_7b", f"model.path={SHAPES}/qwen2.5-7b", "plan.gpu=80GB"]
    status = plan_main([*args, "trainer.devices=8", "rollout.engine.gpu_memory_utilization=0.6"])
    report = json.loads(capsys.readouterr().out)
    assert status == 1 and not report["fits"] and report["problems"]
    assert report["suggestions"]
    for overrides in report["suggestions"]:
        assert plan_of(paper("7b", "trainer.devices=8", "rollout.engine.gpu_memory_utilization=0.6", *overrides)).fits


def test_full_fine_tuning_of_7b_on_one_gpu_is_told_to_use_lora():
    found = suggestions(paper("7b", "trainer=gpu", "rollout.engine.gpu_memory_utilization=0.6"))
    assert ["model.lora.r=16", "model.dtype=bfloat16"] in [o for o, _ in found]


@pytest.mark.parametrize(
    ("value", "gib"), [("80GB", 79.1), ("24GB", 22.0), ("79.6GiB", 79.6), (2 * GIB, 2.0), ("100GB", 95.0)]
)
def test_gpu_sizes(value, gib):
    assert parse_gpu(value)[1] == pytest.approx(gib * GIB, rel=1e-9)


def test_a_bad_gpu_size_names_the_key():
    with pytest.raises(ValueError, match="plan.gpu='lots'"):
        parse_gpu("lots")


def test_a_gpu_config_without_a_visible_or_named_gpu_names_plan_gpu(monkeypatch):
    monkeypatch.setattr("dspo.training.plan_config.visible_gpu", lambda: None)
    cfg = compose_config("train", ["experiment=one_gpu_qwen2.5_3b_lora", f"model.path={SHAPES}/qwen2.5-3b"])
    with pytest.raises(ValueError, match="plan.gpu=80GB"):
        plan_of(cfg)


# --- the check every run makes -------------------------------------------------------------------------------------


def test_a_gpu_run_that_cannot_fit_is_refused_before_loading_and_plan_check_false_goes_on(caplog):
    cfg = paper("7b", "trainer=gpu", "plan.gpu=24GB")
    with pytest.raises(PlanDoesNotFit, match="plan.check=false") as refused:
        check_plan(cfg)
    assert "overrides that fit" in str(refused.value) or "no single override" in str(refused.value)
    with caplog.at_level(logging.WARNING, logger="dspo.plan"):
        assert not check_plan(paper("7b", "trainer=gpu", "plan.gpu=24GB", "plan.check=false")).fits
    assert "plan.check=false" in caplog.text


def test_a_cpu_run_beside_a_visible_gpu_and_bf16_master_weights_are_warned(monkeypatch, caplog):
    monkeypatch.setattr("dspo.training.plan_report.visible_gpu", lambda: ("Fake GPU", 80 * GIB, 1))
    cfg = compose_config("train", ["model.dtype=bfloat16"])
    with caplog.at_level(logging.WARNING, logger="dspo.plan"):
        assert check_plan(cfg) is None
    assert "trainer=gpu" in caplog.text and "model.dtype=bfloat16 with full fine-tuning" in caplog.text


# --- properties over generated shapes and settings -------------------------------------------------------------------


@st.composite
def shapes_and_settings(draw):
    layers, hidden = draw(st.integers(1, 64)), draw(st.sampled_from([64, 512, 2048, 4096]))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    vocab = draw(st.integers(1000, 200_000))
    per_layer = 12 * hidden * hidden
    shape = ModelShape(
        parameters=layers * per_layer + 2 * vocab * hidden, embedding=vocab * hidden, lm_head=vocab * hidden,
        per_layer=per_layer, layers=layers, hidden=hidden, intermediate=draw(st.integers(hidden, 6 * hidden)),
        attention_width=hidden, kv_heads=heads, head_dim=hidden // heads, vocab=vocab, largest_tensor=vocab * hidden,
        lora_parameters=layers * 16 * hidden * 14,
    )  # fmt: skip
    sequence = draw(st.integers(16, 8192))
    micro = draw(st.integers(1, 8)) * sequence
    s = PlanSettings(
        device="GPU", device_bytes=80 * GIB, on_gpu=True, shards=draw(st.sampled_from([1, 2, 8])),
        fsdp=draw(st.booleans()), ddp=False, master_bytes=4, compute_bytes=draw(st.sampled_from([2, 4])),
        lora=draw(st.booleans()), reference=draw(st.booleans()), gradient_checkpointing=draw(st.booleans()),
        micro_tokens=micro, sequence_tokens=sequence, trained_tokens=draw(st.integers(1, micro)),
        head_chunk_rows=draw(st.sampled_from([128, 1024, 4096])), reserve_bytes=2 * 10**9,
    )  # fmt: skip
    return shape, s


@settings(max_examples=150, deadline=None)
@given(shapes_and_settings())
def test_the_peak_never_falls_when_an_input_grows(case):
    shape, s = case
    peak = memory_plan(shape, s).peak
    assert (
        memory_plan(shape, replace(s, micro_tokens=2 * s.micro_tokens, trained_tokens=2 * s.trained_tokens)).peak
        >= peak
    )
    assert memory_plan(shape, replace(s, head_chunk_rows=2 * s.head_chunk_rows)).peak >= peak
    # fp32 compute never needs less for activations (the head's weight gradient is the exception: under autocast it
    # is formed in bf16 and cast, 6 B a value against 4, which the plan counts)
    activations = [t for t in ("activations", "one layer recomputed") if t in terms(memory_plan(shape, s))]
    for name in activations:
        assert terms(memory_plan(shape, replace(s, compute_bytes=4)))[name] >= terms(memory_plan(shape, s))[name]
    assert memory_plan(shape, replace(s, reserve_bytes=s.reserve_bytes + 1)).peak == peak + 1


@settings(max_examples=150, deadline=None)
@given(shapes_and_settings())
def test_sharding_lora_and_checkpointing_never_cost_memory_where_they_save_it(case):
    shape, s = case
    plan = memory_plan(shape, s)
    if s.fsdp:  # more shards: less state per device
        assert memory_plan(shape, replace(s, shards=2 * s.shards)).training_state_bytes() <= plan.training_state_bytes()
    if not s.lora:  # LoRA over a bf16 base: less state than full fine-tuning
        lora = memory_plan(shape, replace(s, lora=True, master_bytes=2))
        assert lora.training_state_bytes() < plan.training_state_bytes()
    if shape.layers >= 2 and not s.gradient_checkpointing:
        on = memory_plan(shape, replace(s, gradient_checkpointing=True))
        assert on.phase_bytes("update") <= plan.phase_bytes("update")
    assert all(t.bytes >= 0 for t in plan.terms)
    assert plan.fits == (plan.margin >= 0)  # no engine here: fitting is the margin


def test_the_planners_answerer_engine_and_a_cpu_plan_of_the_toy_default():
    cfg = compose_config("train", ["env=planner", "model.path=data/toy_warmstart/model"])
    plan = plan_of(cfg)
    names = [e.name for e in plan.settings.engines]
    assert names == ["policy engine (vLLM)", "answerer engine (HF)"]
    assert plan.settings.device == "CPU: host memory" and plan.fits
    assert terms(plan)["answerer engine (HF): weights"] == model_shape("data/toy_warmstart/model").parameters * 4


def test_a_local_judge_enters_the_plan_where_it_runs_and_a_servers_does_not():
    toy = ["env/reward=judge", "model.path=data/toy_warmstart/model"]
    plan = plan_of(compose_config("train", toy))
    assert [e.name for e in plan.settings.engines] == ["policy engine (vLLM)", "judge (HF, local)"]
    assert terms(plan)["judge (HF, local): weights"] == model_shape("data/toy_warmstart/model").parameters * 4
    bf16 = ["env.reward.judge.dtype=bfloat16", "env.reward.judge.batch_size=4"]
    on_gpu = plan_of(compose_config("train", [*toy, "plan.gpu=80GB", "env.reward.judge.device=cuda", *bf16]))
    (judge,) = [e for e in on_gpu.settings.engines if e.name.startswith("judge")]
    assert (judge.dtype_bytes, judge.batch_sequences) == (2, 4)
    assert not [
        e for e in plan_of(compose_config("train", [*toy, "plan.gpu=80GB"])).settings.engines if "judge" in e.name
    ]
    served = plan_of(compose_config("train", [*toy, "env.reward.judge.base_url=http://127.0.0.1:8000/v1"]))
    assert [e.name for e in served.settings.engines] == ["policy engine (vLLM)"]


def test_a_gpu_named_for_a_cpu_config_is_planned_as_trainer_gpu_would_run_it():
    cfg = compose_config("train", ["model.path=data/toy_warmstart/model", "plan.gpu=24GB"])
    settings = plan_of(cfg).settings
    assert settings.on_gpu and settings.compute_bytes == 2 and settings.master_bytes == 4
