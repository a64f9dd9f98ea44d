"""Issue 73 (4): the `pinned` section of results.json (dspo.eval.pinned): what decides a report's scores."""

from __future__ import annotations

import hashlib
import inspect
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from dspo.env.judge import JudgedReward
from dspo.env.rewards import SubEMReward
from dspo.eval import pinned
from dspo.eval.pipeline import Prediction
from dspo.runs.record import adopt
from dspo.testing import compose_config
from dspo.types import Passage

REPO = Path(__file__).resolve().parents[2]
# The normalization and score functions NORMALIZATION names, and the digest of their code at that version. A change
# to one of them fails here: raise NORMALIZATION's version (old reports then refuse to compare) and update the digest.
NORMALIZATION_CODE = {"flashrag-normalize_answer/1": "de4299be3ebf1530"}


def normalization_code_digest() -> str:
    from dspo import metrics

    functions = [metrics.normalize_answer, metrics.normalized_golds, metrics.phrase_in]
    functions += [metrics.sub_exact_match, metrics.exact_match, metrics.token_f1]
    code = "".join(inspect.getsource(f) for f in functions)
    code += "".join(sorted(metrics._PUNCTUATION)) + metrics._ARTICLES.pattern
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def test_the_normalization_version_is_tied_to_its_code() -> None:
    assert {pinned.NORMALIZATION: normalization_code_digest()} == NORMALIZATION_CODE


def weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.embed.weight": torch.randn(7, 3) * scale,
        "model.norm.weight": torch.ones(3, dtype=torch.bfloat16),
        "lm_head.bias": torch.arange(5, dtype=torch.int64),
    }


def test_the_weights_digest_is_the_tensors_whatever_the_files(tmp_path: Path) -> None:
    tensors = weights()
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    save_file(tensors, str(one / "model.safetensors"), metadata={"format": "pt"})
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:1]}, str(two / "model-00002-of-00002.safetensors"))  # another split
    save_file({n: tensors[n] for n in names[1:]}, str(two / "model-00001-of-00002.safetensors"))
    digest = pinned.weights_digest(one)
    assert digest == pinned.weights_digest(two)
    assert digest["tensors"] == 3 and digest["bytes"] == 7 * 3 * 4 + 3 * 2 + 5 * 8
    assert pinned.tensors_digest(tensors.items()) == digest  # in memory: the digest of the file they would be
    changed = dict(tensors, **{"model.norm.weight": torch.full((3,), 1.5, dtype=torch.bfloat16)})
    assert pinned.tensors_digest(changed.items())["digest"] != digest["digest"]
    renamed = {("x." + name if name == names[0] else name): t for name, t in tensors.items()}
    assert pinned.tensors_digest(renamed.items())["digest"] != digest["digest"]
    assert pinned.weights_digest(tmp_path)["digest"] is None  # no weight files there
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 8)
    with pytest.raises(ValueError, match="not a safetensors file"):
        pinned.weights_digest(tmp_path)


def test_a_model_folder_pins_its_weights_and_chat_template(lm_dir: str, qwen_tokenizer) -> None:
    model, template = pinned.model_identity(lm_dir)
    assert model["digest"].startswith("sha256:") and model["tensors"] > 0
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(lm_dir)
    tied = loaded.config.tie_word_embeddings
    state = {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight" or not tied}
    assert pinned.tensors_digest(state.items())["digest"] == model["digest"]
    from transformers import AutoTokenizer

    assert template == pinned.chat_template_digest(AutoTokenizer.from_pretrained(lm_dir))  # None: the toy has none
    assert pinned.chat_template_digest(qwen_tokenizer).startswith("sha256:")
    assert pinned.chat_template_digest(SimpleNamespace(chat_template=None)) is None
    as_dict = SimpleNamespace(chat_template={"default": "a", "tool_use": "b"})
    assert pinned.chat_template_digest(as_dict) != pinned.chat_template_digest(SimpleNamespace(chat_template="a"))


def test_an_index_is_pinned_by_its_manifest_and_a_service_by_its_health(tmp_path: Path) -> None:
    from dspo.search.bm25 import BM25Index

    passages = [Passage(id=str(i), title=f"T{i}", text=f"word{i} shared text") for i in range(4)]
    index = BM25Index.build(passages, backend="rank_bm25", k1=0.9, b=0.4, show_progress=False)
    index.save(tmp_path / "index")
    identity = pinned.retriever_identity({"index": str(tmp_path / "index"), "backend": "bm25s"})
    assert identity["index_digest"] == BM25Index.load(tmp_path / "index").digest
    assert (identity["backend"], identity["k1"], identity["b"], identity["num_passages"]) == ("rank_bm25", 0.9, 0.4, 4)
    assert identity["analyzer"].startswith("sha256:") and len(identity["passages_sha256"]) == 64
    assert pinned.retriever_identity({"index": str(tmp_path / "none")})["index_digest"] is None  # not built yet

    asked = []

    def health(url: str) -> dict:
        asked.append(url)
        return {"status": "ok", "index_digest": "abc", "num_passages": 9, "backend": "tantivy"}

    section = {"url": ["http://user:secret@node0:8000/retrieve?token=t", "http://node1:8000/retrieve"]}
    remote = pinned.retriever_identity(section, health)
    assert asked == ["http://user:secret@node0:8000/retrieve?token=t"]
    assert remote == {
        "backend": "remote",
        "url": ["http://node0:8000/retrieve", "http://node1:8000/retrieve"],  # no credentials, no query
        "index_digest": "abc",
        "num_passages": 9,
        "served_backend": "tantivy",
    }
    assert pinned.retriever_identity({"url": "http://127.0.0.1:9/retrieve"})["index_digest"] is None  # down: unknown


def test_the_judge_is_pinned_by_what_decides_a_verdict(lm_dir: str) -> None:
    node = {
        "_target_": "dspo.env.judge.JudgedReward",
        "_partial_": True,
        "base_url": "https://api.example.com:8443/v1",
        "model": "judge-7b",
        "api_key_env": "MY_JUDGE_KEY",
        "concurrency": 8,
        "timeout_s": 30,
        "prompt": "Is {answer} right for {question}? Gold: {golds}",
    }
    identity = pinned.judge_identity(node)
    assert identity == {
        "_target_": "dspo.env.judge.JudgedReward",
        "model": "judge-7b",
        "host": "api.example.com",
        "prompt_digest": JudgedReward(SubEMReward(), client=SimpleNamespace(), prompt=node["prompt"]).prompt_digest,
    }
    assert "MY_JUDGE_KEY" not in json.dumps(identity)  # the key's variable name never enters a report
    assert pinned.judge_identity(node, SimpleNamespace(prompt_digest="sha256:built"))["prompt_digest"] == "sha256:built"
    local = pinned.judge_identity({"model_path": lm_dir, "prompt": None, "mode": "yes_no"})
    built = JudgedReward(SubEMReward(), client=SimpleNamespace())  # the default prompt: the trainer at k >= 1 has no
    assert local == {  # built reward, and must pin what dspo-eval's built one pins
        "model_digest": pinned.weights_digest(lm_dir)["digest"],
        "mode": "yes_no",
        "prompt_digest": built.prompt_digest,
    }
    scored = pinned.judge_identity({"mode": "score", "scale": 5, "system": "Grade.", "choices": ["yes", "no"]})
    assert (
        scored["prompt_digest"]
        == JudgedReward(SubEMReward(), client=SimpleNamespace(), mode="score", scale=5, system="Grade.").prompt_digest
    )
    assert pinned.judge_identity(None) is None
    rubric = {"_target_": "dspo.env.rubric.RubricReward", "_partial_": True, "criteria": {"subem": 1.0}}
    reward = {"_target_": "dspo.env.SubEMReward", "judge": node, "rubric": rubric, "credit": "turn"}
    reward["max_answer_words"] = 5
    env = {"reward": reward, "instruction": "x" * 200}
    assert pinned.judge_node(env) is node
    assert (
        pinned.env_settings(env)
        == {  # what trained (rubric, credit) is in the model's digest; the judge apart
            "reward": {},
            "instruction": "sha256:" + (hashlib.sha256(b"x" * 200).hexdigest()[:16]),
        }
    )


def test_only_the_rewards_answer_writing_parts_are_pinned():
    """Rewards differ between the runs an ablation compares (subEM, IKEA, a rubric); what they paid is in the model's
    digest. A planner's answerer writes the answer that is scored, so it is pinned."""
    search, ikea = (compose_config("train", o).env for o in ([], ["env=ikea", "env/reward=rubric"]))
    as_dict = lambda env: OmegaConf.to_container(env, resolve=False)  # noqa: E731
    assert pinned.env_settings(as_dict(search))["reward"] == pinned.env_settings(as_dict(ikea))["reward"] == {}
    planner = pinned.env_settings(as_dict(compose_config("train", ["env=planner"]).env))["reward"]
    assert list(planner) == ["answerer"] and planner["answerer"]["max_new_tokens"] == 96


def prediction(id_: str, benchmark: str, golds: list[str] | None = None) -> Prediction:
    return Prediction(id_, benchmark, f"q{id_}", golds or ["a"], "a", 1.0, 1.0, 1.0, 1, 0)


def test_benchmarks_are_pinned_by_the_questions_scored_and_their_file(tmp_path: Path) -> None:
    data = tmp_path / "nq.jsonl"
    data.write_text('{"id": "1"}\n')
    scored = [prediction("1", "nq"), prediction("2", "nq"), prediction("3", "hotpotqa")]
    pins = pinned.benchmarks_pinned(scored, {"nq": str(data)})
    assert pins["nq"]["n"] == 2 and pins["hotpotqa"]["n"] == 1
    assert pins["nq"]["file_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert pins["hotpotqa"]["file_sha256"] is None
    reordered = pinned.benchmarks_pinned([scored[1], scored[0]])["nq"]["items_digest"]
    other_gold = pinned.benchmarks_pinned([prediction("1", "nq", ["b"]), scored[1]])["nq"]["items_digest"]
    assert len({pins["nq"]["items_digest"], reordered, other_gold}) == 3
    one_file = pinned.benchmark_files({"_target_": "dspo.data.qa.load_benchmarks", "path": "all.jsonl", "files": {}})
    assert one_file == {"": "all.jsonl"}
    files = {"_target_": "dspo.data.qa.load_benchmarks", "root": "/d", "files": {"nq": "nq.jsonl"}, "path": None}
    assert pinned.benchmark_files(files) == {"nq": "/d/nq.jsonl"}
    assert pinned.benchmark_files({"test_files": {"toy_1hop": "/w/t.jsonl"}}) == {"toy_1hop": "/w/t.jsonl"}


def test_dspo_is_pinned_by_its_version_and_commit() -> None:
    from dspo import __version__

    identity = pinned.dspo_identity()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert identity["version"] == __version__
    assert identity["commit"] == (head.stdout.strip() if head.returncode == 0 else None)


def test_a_training_run_and_dspo_eval_of_its_model_pin_the_same_settings(record) -> None:
    """The training test stage pins from the run record, dspo-eval from its config after adopting that record: the
    same sections, so the two reports of one model compare (tests/test_train.py checks them equal on a real run)."""
    overrides = ["model.path=/m"]
    cfg = compose_config("eval", overrides)
    adopt(cfg, record, overrides, "/m/dspo_run.json", ("rollout.agent", "rollout.engine", "retriever", "env", "data"))
    scored, model = [prediction("1", "toy_1hop")], {"digest": "sha256:m"}
    from_eval = pinned.collect(pinned.config_sections(cfg), scored, model, "sha256:t")
    from_training = pinned.collect(record["config"], scored, model, "sha256:t")
    assert from_eval == from_training
    assert from_eval["agent"]["tag_format"] == "searchr1" and from_eval["agent"]["max_turns"] == 3
    assert from_eval["sampling"] == {"greedy": True, "temperature": 0.0, "top_p": 1.0, "seed": 0}
    assert from_eval["engine"] == {"class": "VLLMEngine", "dtype": "float32"}
    assert from_eval["env"]["tools"]["search"]["topk"] == 1 and from_eval["judge"] is None
    assert from_eval["normalization"] == pinned.NORMALIZATION and from_eval["schema"] == pinned.SCHEMA
    plain = pinned.collect(pinned.config_sections(compose_config("eval", ["retriever.index=/i"])), scored, model, None)
    assert plain["agent"]["tag_format"] == "qwen" and plain["env"]["tools"]["search"]["topk"] == 3
