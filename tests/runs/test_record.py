"""Issue 32 (1): what a trained model records of its run, and how dspo-eval / dspo-rollout adopt it (the end-to-end
check against a real training run is in tests/test_train.py)."""

from __future__ import annotations

import copy
import json

import pytest
from omegaconf import OmegaConf

from dspo.runs.record import RECORD_FILE, adopt, checkpoint_record, read_model_record, write_record
from dspo.testing import compose_config


def test_the_record_holds_the_resolved_sections_of_the_run(record, tmp_path) -> None:
    config = record["config"]
    agent = config["rollout"]["agent"]
    trained = (agent["tag_format"], agent["max_turns"], agent["max_total_tokens"])
    assert trained == ("searchr1", 3, 1024) and agent["_target_"] == "dspo.agent.tool_calling.ToolCallingAgent"
    search = config["env"]["tools"]["search"]
    assert search["topk"] == 1 and search["retriever"] == "${retriever}"  # the toy's top-k; the retriever follows
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


EVAL_SECTIONS = ("rollout.agent", "rollout.engine", "retriever", "env", "data", "eval.batch_size")


def test_eval_adopts_the_trained_agent_retriever_and_test_sets(record) -> None:
    overrides = ["model.path=/m"]
    cfg = compose_config("eval", overrides)
    lines = adopt(cfg, record, overrides, "/m/dspo_run.json", EVAL_SECTIONS)
    assert cfg.rollout.agent.tag_format == "searchr1" and cfg.env.tools.search.topk == 1
    assert cfg.retriever.index == "/c/toyworld/default/world/bm25"
    assert cfg.data.test_limit == 100 and list(cfg.data.test_files) == ["toy_1hop", "toy_2hop"]
    assert cfg.eval.batch_size == 100
    assert len(lines) == 1 and lines[0].startswith("adopted from /m/dspo_run.json (the run that trained this model)")
    assert "tag_format=searchr1" in lines[0] and "test sets toy_1hop, toy_2hop, first 100 each" in lines[0]


def test_command_line_overrides_win_and_agent_changes_are_warned_by_name(record) -> None:
    overrides = ["model.path=/m", "rollout.agent.max_turns=4", "env.tools.search.topk=3", "retriever=remote"]
    overrides += ["data=file", "data.path=q.jsonl"]
    cfg = compose_config("eval", overrides)
    lines = adopt(cfg, record, overrides, "/m/dspo_run.json", EVAL_SECTIONS)
    assert cfg.rollout.agent.max_turns == 4 and cfg.rollout.agent.tag_format == "searchr1"  # the rest still adopted
    assert cfg.env.tools.search.topk == 3 and cfg.env.reward._target_ == "dspo.env.SubEMReward"  # the record's env
    assert cfg.retriever._target_ == "dspo.search.client.RemoteRetriever" and cfg.data.path == "q.jsonl"
    assert "kept from the command line: retriever (set on the command line: retriever)" in lines[1]
    assert "data (set on the command line: data, data.path)" in lines[1]
    agent_warning, env_warning = [line for line in lines if line.startswith("WARNING")]
    assert "rollout.agent.max_turns=4 differs from the trained agent's max_turns=3" in agent_warning
    assert "env.tools.search.topk=3 differs from the trained environment's 1" in env_warning


def test_another_engine_on_the_command_line_keeps_the_trained_agent(record) -> None:
    overrides = ["model.path=/m", "rollout=hf", "eval.batch_size=7"]
    cfg = compose_config("eval", overrides)
    adopt(cfg, record, overrides, "/m/dspo_run.json", EVAL_SECTIONS)
    assert cfg.rollout.engine._target_ == "dspo.engines.HFEngine" and cfg.rollout.agent.tag_format == "searchr1"
    assert cfg.eval.batch_size == 7
    assert OmegaConf.to_container(cfg.rollout.agent) == record["config"]["rollout"]["agent"]


def older_record(record: dict) -> dict:
    """`record` as dspo wrote it before issue 41: the agent (`AgentConfig`) held the search limits and the answer
    guard, the environment read them from there, and the engines lived in dspo.rollout.engine."""
    old = copy.deepcopy(record)
    old["config"]["rollout"]["engine"]["_target_"] = "dspo.rollout.engine.VLLMEngine"
    agent = old["config"]["rollout"]["agent"]
    del agent["_partial_"]
    agent.update(_target_="dspo.rollout.agent.AgentConfig", topk=1, max_queries_per_call=3, max_query_chars=512)
    agent["max_answer_words"] = None
    env = old["config"]["env"]
    for key in ("topk", "max_queries_per_call", "max_query_chars"):
        env["tools"]["search"][key] = f"${{rollout.agent.{key}}}"
    env["reward"]["max_answer_words"] = "${rollout.agent.max_answer_words}"
    return old


def test_an_older_record_is_read_in_todays_terms(record, tmp_path) -> None:
    from hydra.utils import instantiate

    from dspo.agent.tool_calling import ToolCallingAgent

    write_record(tmp_path, older_record(record))
    read = read_model_record(tmp_path)
    assert read["config"]["rollout"] == record["config"]["rollout"] and read["config"]["env"] == record["config"]["env"]
    assert checkpoint_record({"dspo": {"run": older_record(record)}}, "x.ckpt")["config"] == record["config"]
    overrides = ["model.path=/m"]
    cfg = compose_config("eval", overrides)
    adopt(cfg, read, overrides, str(tmp_path / RECORD_FILE), EVAL_SECTIONS)
    assert instantiate(cfg.rollout.agent).func is ToolCallingAgent and cfg.env.tools.search.topk == 1
    assert cfg.rollout.engine._target_ == "dspo.engines.VLLMEngine"
    assert cfg.env.tools.search.retriever.index == "/c/toyworld/default/world/bm25"  # follows the adopted retriever


def test_the_record_names_the_index_it_trained_with_and_eval_warns_on_another(tmp_path) -> None:
    from dspo.runs.record import index_mismatch, with_index
    from dspo.search.bm25 import BM25Index
    from dspo.types import Passage

    docs = [Passage("a", "A", "alpha beta"), Passage("b", "B", "beta gamma")]
    BM25Index.build(docs, show_progress=False).save(tmp_path / "ix")
    record = {"format": 1, "config": {"retriever": {"index": str(tmp_path / "ix"), "k1": 1.2}}}
    (tmp_path / "model").mkdir()
    written = json.loads(write_record(tmp_path / "model", record, step=3).read_text())
    trained = BM25Index.load(tmp_path / "ix")
    assert written["index"]["digest"] == trained.digest and written["index"]["num_passages"] == 2
    assert index_mismatch(written, trained) is None
    other = BM25Index.build(docs, k1=0.9, b=0.4, show_progress=False)
    warning = index_mismatch(written, other)
    assert warning and trained.digest in warning and other.digest in warning and "retriever.index" in warning
    # nothing to compare: a remote retriever (no digest), a record without an index, a missing index folder
    assert index_mismatch(written, object()) is None and index_mismatch({"config": {}}, other) is None
    missing = {"config": {"retriever": {"index": str(tmp_path / "nowhere")}}}
    assert with_index(missing) == missing and "index" not in with_index({"config": {"retriever": {"url": "x"}}})
