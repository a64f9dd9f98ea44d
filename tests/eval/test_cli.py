"""dspo-eval: checkpoint export, data selection, and the command end to end (scripted engine, HF engine, vLLM)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dspo.eval.cli import CheckpointError, export_checkpoint, load_eval_sets
from dspo.eval.pinned import weights_digest
from dspo.eval.pipeline import read_predictions, read_results, score
from dspo.metrics import exact_match, sub_exact_match, token_f1
from dspo.process.resources import data_dir
from dspo.search.bm25 import read_manifest

ROOT = Path(__file__).resolve().parents[2]
DATA = data_dir()
TOKENIZER = DATA / "tokenizers" / "qwen2.5"
CORPUS = DATA / "hotpotqa_dev500" / "corpus.jsonl.gz"
BENCHMARKS = DATA / "benchmarks"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from dspo.toy.model import build_tiny_model

    return build_tiny_model(str(TOKENIZER), str(tmp_path_factory.mktemp("tiny") / "model"), hidden_size=64)


def lightning_like_checkpoint(model_dir: str, path: Path, scale: float = 2.0, **extra) -> dict[str, torch.Tensor]:
    """A checkpoint shaped like dspo's: policy weights (changed, so the export is seen) under `policy.`."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        policy.model.norm.weight.mul_(scale)
    state = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    state["reference.model.norm.weight"] = torch.ones(1)  # other prefixes are ignored
    checkpoint = {
        "state_dict": state,
        "global_step": 12,
        "hyper_parameters": {"model": {"path": "/nonexistent/base"}},
        "dspo": {"model_dir": model_dir},
        "pytorch-lightning_version": "2.6.0",
    }
    checkpoint.update(extra)
    torch.save(checkpoint, path)
    return policy.state_dict()


def test_export_checkpoint_round_trip(tiny_model: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = tmp_path / "last.ckpt"
    expected = lightning_like_checkpoint(tiny_model, ckpt)
    folder, step = export_checkpoint(str(ckpt), str(tmp_path / "export"))
    assert step == 12
    exported = AutoModelForCausalLM.from_pretrained(folder)
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert not torch.equal(
        exported.model.norm.weight, AutoModelForCausalLM.from_pretrained(tiny_model).model.norm.weight
    )
    assert AutoTokenizer.from_pretrained(folder).encode("hello world") == AutoTokenizer.from_pretrained(
        tiny_model
    ).encode("hello world")


def test_export_checkpoint_errors(tiny_model: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        export_checkpoint(str(tmp_path / "missing.ckpt"), str(tmp_path / "x"))
    torch.save({"state_dict": {"model.w": torch.ones(1)}, "dspo": {"model_dir": tiny_model}}, tmp_path / "other.ckpt")
    with pytest.raises(CheckpointError, match="no key starting with 'policy.'"):
        export_checkpoint(str(tmp_path / "other.ckpt"), str(tmp_path / "x"))
    ckpt = tmp_path / "nobase.ckpt"
    lightning_like_checkpoint(tiny_model, ckpt, dspo={})
    with pytest.raises(CheckpointError, match="pass model.path=DIR"):
        export_checkpoint(str(ckpt), str(tmp_path / "x"))
    assert export_checkpoint(str(ckpt), str(tmp_path / "y"), model_path=tiny_model)[1] == 12  # model.path supplies it
    # A checkpoint of another architecture names the tensors that differ.
    bad = tmp_path / "bad.ckpt"
    state = torch.load(tmp_path / "nobase.ckpt", weights_only=True)["state_dict"]
    state["policy.model.extra.weight"] = torch.zeros(2)
    del state["policy.model.norm.weight"]
    torch.save({"state_dict": state, "dspo": {"model_dir": tiny_model}}, bad)
    with pytest.raises(CheckpointError, match=r"missing \['model.norm.weight'\].*unexpected \['model.extra.weight'\]"):
        export_checkpoint(str(bad), str(tmp_path / "x"))
    # Arbitrary pickled objects are refused (weights_only=True).
    torch.save({"state_dict": {}, "obj": OmegaConf.create({"a": 1})}, tmp_path / "pickled.ckpt")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        export_checkpoint(str(tmp_path / "pickled.ckpt"), str(tmp_path / "x"))


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}], ids=["full", "lora"])
def test_the_end_of_training_and_dspo_eval_write_one_model_folder(tmp_path: Path, lora) -> None:
    """Issue 71 (3): one exporter (`dspo.models.export`). The model folder the end of training writes and the one
    dspo-eval writes from that run's checkpoint hold the same files, the same tensors (merged LoRA weights, and the
    adapter folder beside them) and the same run record; only config.json comes from another source (the model in
    memory, the base model folder)."""
    from safetensors.torch import load_file

    from dspo.testing import build_toy_lm, toy_run

    lm_dir = build_toy_lm(str(tmp_path / "toy_lm"))
    run = toy_run(lm_dir, str(tmp_path / "run"), 2, lora=lora)
    run.module.run_record = {"format": 1, "config": {"rollout": {"agent": {"max_turns": 3}}}}
    torch.manual_seed(0)  # peft draws A at random when the model is built
    run.trainer.fit(run.module, datamodule=run.datamodule)
    run.trainer.save_checkpoint(str(tmp_path / "last.ckpt"))
    trained = Path(run.callback.exported_to)
    exported, step = export_checkpoint(str(tmp_path / "last.ckpt"), str(tmp_path / "exported"), model_path=lm_dir)
    assert step == 2
    folders = [(trained, Path(exported))]
    if lora is not None:
        folders.append((trained.with_name("model_adapter"), tmp_path / "exported_adapter"))
    for from_training, from_checkpoint in folders:
        names = sorted(path.name for path in from_training.iterdir())
        assert names == sorted(path.name for path in from_checkpoint.iterdir())
        for name in names:
            if name.endswith(".safetensors"):
                ours, theirs = load_file(str(from_training / name)), load_file(str(from_checkpoint / name))
                assert ours.keys() == theirs.keys()
                assert all(torch.equal(ours[key], theirs[key]) for key in ours), name
            elif name != "config.json":
                assert (from_training / name).read_bytes() == (from_checkpoint / name).read_bytes(), name
    assert json.loads((trained / "dspo_run.json").read_text())["step"] == 2


def test_load_eval_sets_shapes(tmp_path: Path) -> None:
    benchmarks = OmegaConf.create(
        {
            "_target_": "dspo.data.qa.load_benchmarks",
            "root": str(BENCHMARKS),
            "files": {"nq": "nq.jsonl", "bamboogle": "bamboogle.jsonl"},
            "path": None,
            "limit": 5,
        }
    )
    assert {k: len(v) for k, v in load_eval_sets(benchmarks, None).items()} == {"nq": 5, "bamboogle": 5}
    assert {k: len(v) for k, v in load_eval_sets(benchmarks, 2).items()} == {"nq": 2, "bamboogle": 2}
    single = OmegaConf.merge(benchmarks, {"path": str(BENCHMARKS / "musique.jsonl")})
    assert list(load_eval_sets(single, 3)) == ["musique"]
    module = OmegaConf.create(
        {
            "_target_": "dspo.data.datamodule.RolloutDataModule",
            "train_files": ["unused.jsonl"],
            "test_files": {"popqa": str(BENCHMARKS / "popqa.jsonl")},
            "test_limit": 4,
        }
    )
    assert {k: len(v) for k, v in load_eval_sets(module, None).items()} == {"popqa": 4}
    with pytest.raises(ValueError, match="names no evaluation sets"):
        load_eval_sets(OmegaConf.create({"_target_": "x.Y", "train_files": ["a"]}), None)
    with pytest.raises(ValueError, match="no questions to evaluate"):
        load_eval_sets(benchmarks, 0)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the BM25 index over the shared corpus goes; the first test builds it, later ones reuse it."""
    return tmp_path_factory.mktemp("bm25") / "index"


def recompute(predictions_path: Path) -> dict[str, dict[str, float]]:
    """subEM / EM / F1 per benchmark straight from predictions.jsonl, with the plain metric functions."""
    rows = [json.loads(line) for line in predictions_path.read_text().splitlines()]
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["benchmark"] for r in rows):
        group = [r for r in rows if r["benchmark"] == name]
        out[name] = {
            "subem": sum(sub_exact_match(r["answer"], r["golden_answers"]) for r in group) / len(group),
            "em": sum(exact_match(r["answer"], r["golden_answers"]) for r in group) / len(group),
            "f1": sum(token_f1(r["answer"], r["golden_answers"]) for r in group) / len(group),
            "n": len(group),
        }
    return out


def check_outputs(out: Path, limit: int, benchmarks: list[str]) -> dict:
    """The benchmark rows of results.json, checked against predictions.jsonl; its `pinned` section is checked to name
    the questions scored (the rest: tests/eval/test_pinned.py)."""
    results, pinned = read_results(out / "results.json")
    assert pinned["schema"] == 1 and sorted(pinned["benchmarks"]) == sorted(benchmarks)
    assert all(pinned["benchmarks"][name]["n"] == limit for name in benchmarks)
    recomputed = recompute(out / "predictions.jsonl")
    assert list(recomputed) == benchmarks
    for name in benchmarks:
        assert recomputed[name]["n"] == results[name]["n"] == limit
        for key in ("subem", "em", "f1"):
            assert results[name][key] == pytest.approx(recomputed[name][key], abs=1e-12), (name, key)
    assert score(read_predictions(out / "predictions.jsonl")) == {k: results[k] for k in benchmarks}
    table = (out / "results.md").read_text()
    assert all(f"| {name} | {limit} |" in table for name in benchmarks)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    return results


# ------------------------------------------------------------------------------------------------ composed configs
CONF = ROOT / "conf"
TWO_BENCHMARKS = ["hotpotqa", "bamboogle"]


def compose(name: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose(config_name=name, overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        return cfg


GOLDS: dict[str, list[str]] = {}


def scripted_engine(model_path: str, **_ignored):
    """Rollout engine for the scripted end-to-end test: search the question, then answer. Every other question is
    answered with its gold answer, the rest with the title of the first passage found (real BM25 hits)."""
    from transformers import AutoTokenizer

    from dspo.engines.scripted import ScriptedEngine

    def script(prompt_text: str, turn: int, index: int) -> str:
        question = re.findall(r"Question: (.*?)(?:<\|im_end\|>|\n)", prompt_text)[0].strip()
        if turn == 0:
            call = {"name": "search", "arguments": {"query_list": [question]}}
            return f"<think>I need to look this up.</think>\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
        titles = re.findall(r"Doc 1 \(Title: (.*?)\)", prompt_text)
        answer = GOLDS[question][0] if index % 2 == 0 else (titles[-1] if titles else "unknown")
        return f"<think>Found it.</think>\n<answer>{answer}</answer>"

    return ScriptedEngine(AutoTokenizer.from_pretrained(model_path), script)


def eval_overrides(tiny_model: str, index_dir: Path, out: Path, limit: int) -> list[str]:
    return [
        f"model.path={tiny_model}",
        f"retriever.index={index_dir}",
        f"retriever.corpus={CORPUS}",
        "retriever.show_progress=false",
        "~data.files",  # a dict override would merge into the seven defaults: replace it instead
        "+data.files={" + ",".join(f"{b}:{b}.jsonl" for b in TWO_BENCHMARKS) + "}",
        f"eval.limit={limit}",
        f"eval.output_dir={out}",
        "eval.progress=false",
    ]


@pytest.mark.slow
def test_dspo_eval_scripted_end_to_end(
    tiny_model: str, index_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Real config, data, BM25 index over the shared corpus, agent loop and scoring; the engine is scripted so that
    scores are neither all 0 nor all 1."""
    from dspo.data.qa import load_qa
    from dspo.eval.cli import run

    for name in TWO_BENCHMARKS:
        GOLDS.update({i.question: i.golden_answers for i in load_qa(str(BENCHMARKS / f"{name}.jsonl"), limit=6)})
    work = tmp_path_factory.mktemp("scripted")
    out = work / "out"
    cfg = compose(
        "eval",
        [*eval_overrides(tiny_model, index_dir, out, limit=6), "eval.batch_size=4"]
        + [f"rollout.engine._target_={scripted_engine.__module__}.scripted_engine", "++rollout.engine._partial_=true"],
    )
    table = run(cfg, str(out))
    results = check_outputs(out, 6, TWO_BENCHMARKS)
    assert table == results
    for name in TWO_BENCHMARKS:
        assert 0.5 <= results[name]["subem"] <= 1.0 and results[name]["mean_tool_calls"] == 1.0
        assert results[name]["mean_turns"] == 2.0
    assert results["average"]["n"] == 12
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert all("<tool_response>" in r["response"] for r in rows)  # the search results went back to the model
    pinned = read_results(out / "results.json")[1]  # issue 73: what decides these numbers
    assert pinned["model"] == weights_digest(tiny_model)
    assert pinned["retriever"]["index_digest"] == read_manifest(index_dir)["digest"]
    for name in TWO_BENCHMARKS:
        digest = hashlib.sha256((BENCHMARKS / f"{name}.jsonl").read_bytes()).hexdigest()
        assert pinned["benchmarks"][name]["file_sha256"] == digest
    assert pinned["agent"]["tag_format"] == cfg.rollout.agent.tag_format and pinned["judge"] is None


@pytest.mark.slow
def test_dspo_eval_cli_from_checkpoint(tiny_model: str, index_dir: Path, tmp_path: Path) -> None:
    """`dspo-eval ckpt_path=...` as a user runs it: checkpoint export, engine, BM25 index, tables. The transformers
    engine (`rollout=hf`): dspo-eval on vLLM runs end to end in tests/test_train.py (`dspo-eval model.path=RUN/model`
    after a run) and vLLM with this 151k vocabulary in tests/engines/test_vllm.py."""
    ckpt = tmp_path / "last.ckpt"
    lightning_like_checkpoint(tiny_model, ckpt)
    out = tmp_path / "out"
    overrides = [o for o in eval_overrides(tiny_model, index_dir, out, limit=3) if "model.path" not in o]
    overrides += [
        f"ckpt_path={ckpt}",
        "rollout=hf",
        "eval.batch_size=3",
        "rollout.agent.max_turns=2",
        "rollout.agent.max_new_tokens_per_turn=12",
        "rollout.agent.max_obs_tokens=64",
        "rollout.agent.max_total_tokens=1024",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, "-m", "dspo.eval.cli", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = check_outputs(out, 3, TWO_BENCHMARKS)
    assert "| **average** | 6 |" in result.stdout
    exported = read_results(out / "results.json")[1]["model"]["digest"]  # the checkpoint's policy, not the base
    assert exported.startswith("sha256:") and exported != weights_digest(tiny_model)["digest"]
    assert set(results) == {*TWO_BENCHMARKS, "average"}


@pytest.mark.parametrize("experiment", ["paper_qwen2.5_7b", "paper_qwen2.5_3b"])
def test_paper_experiments_compose_and_instantiate(experiment: str, tmp_path: Path) -> None:
    from hydra.utils import instantiate

    cfg = compose(
        "train",
        [
            f"experiment={experiment}",
            "model.path=/models/qwen",
            "retriever.index=/indexes/wiki18",
            f"output_dir={tmp_path}",
        ],
    )
    # fp32 master weights and AdamW state, bf16 compute on the GPUs (bf16 weights would round lr-1e-6 updates away)
    assert cfg.model.path == "/models/qwen" and cfg.model.dtype == "float32" and cfg.trainer.precision == "bf16-mixed"
    assert (cfg.callbacks.checkpoint.every_n_rounds, cfg.callbacks.checkpoint.steps_per_round) == (10, 2)
    algorithm = instantiate(cfg.algorithm)
    assert (algorithm.name, algorithm.group_size, algorithm.batch_groups, algorithm.num_minibatches) == (
        "dspo",
        5,
        512,
        2,
    )
    assert (algorithm.loss_kwargs, algorithm.kl_coef) == ({"clip_low": 3e-4, "clip_high": 4e-4}, 0.0)
    agent = cfg.rollout.agent
    assert (agent.max_turns, agent.max_new_tokens_per_turn, agent.max_total_tokens) == (4, 500, 4096)
    assert cfg.env.tools.search.topk == 3
    assert cfg.rollout.engine.max_model_len >= agent.max_total_tokens
    assert instantiate(cfg.optimizer).lr == 1e-6
    assert cfg.trainer.max_steps == 2010 and cfg.trainer.strategy._target_.endswith("FSDP2Strategy")
    assert cfg.data.train_files == ["data/nq_hotpotqa/train.jsonl"] and len(cfg.data.test_files) == 7
    assert instantiate(cfg.data).test_benchmarks == list(cfg.data.test_files)
    assert cfg.retriever.index == "/indexes/wiki18"
    # The retrieval service instead of a local index: the command line wins over the experiment's choice.
    remote = compose(
        "train", [f"experiment={experiment}", "model.path=/m", "retriever=remote", f"output_dir={tmp_path}"]
    )
    assert remote.retriever._target_ == "dspo.search.client.RemoteRetriever"
    # And dspo-eval takes the experiment's test sets through data=nq_hotpotqa.
    assert (
        compose("eval", ["data=nq_hotpotqa", "model.path=/m", "retriever.index=/i"]).data.test_files
        == cfg.data.test_files
    )


# ------------------------------------------------------------------------------------------------ untrusted folders
def run_eval_main(monkeypatch, capsys, tmp_path: Path, *overrides: str) -> tuple[int, str]:
    """`dspo-eval OVERRIDES` in this process, as the console script runs it -> (exit code, stderr)."""
    from dspo.eval.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSPO_OUTPUTS", str(tmp_path / "outputs"))
    monkeypatch.delenv("DSPO_VERBOSE", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["dspo-eval", *overrides])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "module"),
    [("os.system", "os"), ("pathlib.Path.touch", "pathlib.Path")],  # Hydra's own blocklist has the first only
)
def test_a_planted_record_runs_nothing(tmp_path: Path, monkeypatch, capsys, target: str, module: str) -> None:
    """Issue 39 (1): an exported model folder whose dspo_run.json names `os.system` (or `Path.touch`) as the
    environment. Before, the record's sections went to `hydra.utils.instantiate` as they were, and the target ran
    when the folder was evaluated; now the record is refused, naming the key, before anything is built."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from dspo.runs.record import run_record, write_record
    from dspo.testing import build_toy_lm

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        record = run_record(hydra_compose(config_name="train", overrides=["output_dir=/tmp/run", "paths.cache=/c"]))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"id": "1", "question": "Who?", "golden_answers": ["Ada"]}) + "\n")
    pwned = tmp_path / "pwned-planted"
    record["config"]["data"] = {"test_files": {"planted": str(questions)}, "test_limit": 1}
    argument = f"touch {pwned}" if target == "os.system" else str(pwned)
    record["config"]["env"] = {"_target_": target, "_args_": [argument]}
    model = build_toy_lm(str(tmp_path / "model"))
    write_record(model, record, step=1)
    code, err = run_eval_main(monkeypatch, capsys, tmp_path, f"model.path={model}")
    assert not pwned.exists()
    assert code == 2 and "Traceback" not in err, err
    assert "dspo-eval: error: " in err and f"env._target_={target!r} is not a target dspo ships" in err, err
    assert f"imports=[{module}]" in err and "dspo_run.json" in err


class _Touch:
    """A pickle that creates a file when it is loaded (`torch.load(weights_only=False)` would run it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_planted_interpolated_target_runs_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    """Issue 53 (1), the review's trigger as a new user meets it: `dspo-eval model.path=<folder>` on a folder whose
    record names `dspo.${oc.select:x,runs.checkpoint_files.torch.load}` (Hydra builds `torch.load`, which its blocklist
    lets through) with a pickle beside it. Before, the command ran the pickle; now it is a one-line refusal."""
    from dspo.runs.record import run_record, write_record
    from dspo.testing import build_toy_lm, compose_config

    pwned = tmp_path / "pwned-torch-load"
    model = build_toy_lm(str(tmp_path / "model"))
    torch.save(_Touch(str(pwned)), Path(model) / "extra.pt")
    record = run_record(compose_config("train", ["output_dir=/tmp/run", "paths.cache=/c"]))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"id": "1", "question": "Who?", "golden_answers": ["Ada"]}) + "\n")
    record["config"]["data"] = {"test_files": {"planted": str(questions)}, "test_limit": 1}
    record["config"]["retriever"] = {
        "_target_": "dspo.${oc.select:x,runs.checkpoint_files.torch.load}",
        "_args_": [f"{model}/extra.pt"],
        "weights_only": False,
    }
    write_record(model, record, step=1)
    code, err = run_eval_main(monkeypatch, capsys, tmp_path, f"model.path={model}")
    assert not pwned.exists()
    assert code == 2 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("dspo-eval: error: ")]
    assert "retriever._target_='dspo.${oc.select:x,runs.checkpoint_files.torch.load}' is interpolated" in line, err


def test_a_foreign_folder_checkpoint_is_not_unpickled(tmp_path: Path, monkeypatch, capsys) -> None:
    """Issue 39 (1): torch's distributed-checkpoint reader unpickles a folder checkpoint's `.metadata`; one that
    belongs to another user is refused unless `allow_foreign_checkpoint=true`."""
    import dspo.runs.trust

    pwned = tmp_path / "pwned-metadata"

    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {pwned}",)

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    torch.save({"global_step": 3}, folder / "meta.pt")
    (folder / ".metadata").write_bytes(pickle.dumps(Planted()))
    monkeypatch.setattr(dspo.runs.trust, "_owner", lambda path: os.getuid() + 1)  # as if another user's
    code, err = run_eval_main(monkeypatch, capsys, tmp_path, f"ckpt_path={folder}")
    assert not pwned.exists()
    assert code == 2 and "Traceback" not in err, err
    assert "belongs to another user" in err and "allow_foreign_checkpoint=true" in err, err
