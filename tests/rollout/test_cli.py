"""dspo-rollout wiring: the real config composed by Hydra, HF engine on the tiny model, BM25 over a small corpus."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from dspo.rollout.cli import CONF_DIR, run_rollout


def compose_cli(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="rollout_cli", overrides=overrides)


def test_vllm_config_composes_with_engine_partial():
    cfg = compose_cli(["model.path=/m", "data.path=/d", "retriever.index=/i"])
    assert cfg.rollout.engine._target_ == "dspo.engines.VLLMEngine" and cfg.rollout.engine._partial_
    assert "model_path" not in cfg.rollout.engine
    assert cfg.rollout.agent.tag_format == "qwen" and cfg.retriever.index == "/i"
    with pytest.raises(FileNotFoundError, match=r"model.path='/m' is not an existing directory"):
        run_rollout(cfg)


@pytest.mark.slow
def test_cli_writes_one_record_per_trajectory(tiny_model_dir, tmp_path):
    questions = tmp_path / "qa.jsonl"
    rows = [{"id": f"q{i}", "question": f"Question {i}?", "golden_answers": [f"a{i}"]} for i in range(2)]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"T{i}"\ntext {i}'}) + "\n" for i in range(5)))
    output = tmp_path / "out" / "rollouts.jsonl"
    cfg = compose_cli(
        [
            f"model.path={tiny_model_dir}",
            f"data.path={questions}",
            f"retriever.index={tmp_path / 'index'}",
            f"retriever.corpus={corpus}",
            "retriever.show_progress=false",
            "rollout=hf",
            "rollout.agent.max_new_tokens_per_turn=6",
            "n=2",
            "group_size=3",
            f"output={output}",
        ]
    )
    assert run_rollout(cfg) == output
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 6 and [r["id"] for r in records] == ["q0"] * 3 + ["q1"] * 3
    for record in records:
        for key in ("question", "golden_answers", "answer", "reward", "num_turns", "num_tool_calls", "response_text"):
            assert key in record
        assert len(record["response_ids"]) == len(record["response_mask"]) and record["prompt_ids"]
        assert record["reward"] == 0.0 and record["num_turns"] == 1
