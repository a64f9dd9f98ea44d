"""Issue 32 (1): what a trained model records of its run, and how dspo-eval / dspo-rollout adopt it (the end-to-end
check against a real training run is in tests/test_train.py)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from dspo.record import RECORD_FILE, adopt, checkpoint_record, read_model_record, write_record
from dspo.testing import compose_config


def test_the_record_holds_the_resolved_sections_of_the_run(record, tmp_path) -> None:
    config = record["config"]
    agent = config["rollout"]["agent"]
    trained = (agent["tag_format"], agent["topk"], agent["max_turns"], agent["max_total_tokens"])
    assert trained == ("searchr1", 1, 3, 1024)
    assert config["retriever"]["index"] == "/c/toyworld/default/world/bm25"  # interpolations resolved
    assert config["data"]["test_files"] == {
        "toy_1hop": "/c/toyworld/default/world/test_1hop.jsonl",
        "toy_2hop": "/c/toyworld/default/world/test_2hop.jsonl",
    }
    assert config["eval_batch_size"] == 100 and config["algorithm"]["name"] == "dspo"
    json.dumps(record)  # plain containers only: checkpoints are loaded with weights_only=True
    write_record(tmp_path, record, step=100)
    assert read_model_record(tmp_path) == {**record, "step": 100}
    assert checkpoint_record({"dspo": {"run": record}}, "x.ckpt") == record
    assert read_model_record(tmp_path / "nothing") is None and checkpoint_record({"dspo": {}}, "x") is None
    (tmp_path / RECORD_FILE).write_text("{broken")
    with pytest.raises(ValueError, match="not a readable dspo run record"):
        read_model_record(tmp_path)


EVAL_SECTIONS = ("rollout.agent", "rollout.engine", "retriever", "data", "eval.batch_size")


def test_eval_adopts_the_trained_agent_retriever_and_test_sets(record) -> None:
    overrides = ["model.path=/m"]
    cfg = compose_config("eval", overrides)
    lines = adopt(cfg, record, overrides, "/m/dspo_run.json", EVAL_SECTIONS)
    assert cfg.rollout.agent.tag_format == "searchr1" and cfg.rollout.agent.topk == 1
    assert cfg.retriever.index == "/c/toyworld/default/world/bm25"
    assert cfg.data.test_limit == 100 and list(cfg.data.test_files) == ["toy_1hop", "toy_2hop"]
    assert cfg.eval.batch_size == 100
    assert len(lines) == 1 and lines[0].startswith("adopted from /m/dspo_run.json (the run that trained this model)")
    assert "tag_format=searchr1" in lines[0] and "test sets toy_1hop, toy_2hop, first 100 each" in lines[0]


def test_command_line_overrides_win_and_agent_changes_are_warned_by_name(record) -> None:
    overrides = ["model.path=/m", "rollout.agent.topk=3", "retriever=remote", "data=file", "data.path=q.jsonl"]
    cfg = compose_config("eval", overrides)
    lines = adopt(cfg, record, overrides, "/m/dspo_run.json", EVAL_SECTIONS)
    assert cfg.rollout.agent.topk == 3 and cfg.rollout.agent.tag_format == "searchr1"  # the rest still adopted
    assert cfg.retriever._target_ == "dspo.search.client.RemoteRetriever" and cfg.data.path == "q.jsonl"
    assert "kept from the command line: retriever (set on the command line: retriever)" in lines[1]
    assert "data (set on the command line: data, data.path)" in lines[1]
    (warning,) = [line for line in lines if line.startswith("WARNING")]
    assert "rollout.agent.topk=3 differs from the trained agent's topk=1" in warning


def test_another_engine_on_the_command_line_keeps_the_trained_agent(record) -> None:
    overrides = ["model.path=/m", "rollout=hf", "eval.batch_size=7"]
    cfg = compose_config("eval", overrides)
    adopt(cfg, record, overrides, "/m/dspo_run.json", EVAL_SECTIONS)
    assert cfg.rollout.engine._target_ == "dspo.rollout.engine.HFEngine" and cfg.rollout.agent.tag_format == "searchr1"
    assert cfg.eval.batch_size == 7
    assert OmegaConf.to_container(cfg.rollout.agent) == record["config"]["rollout"]["agent"]
