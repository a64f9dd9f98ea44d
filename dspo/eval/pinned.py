"""What decides a report's scores, collected next to them: results.json's `pinned` section (issue 73, item 4).

Search-agent numbers that do not reproduce are a standing complaint (another retriever, corpus version, top-k,
normalization, a judge score set against EM): a number means little without every setting that decides it. So every
results.json (`dspo-eval` and the training test stage) carries, beside its benchmark rows:

- `model`: the digest of the weights the engine loaded (`weights_digest`: SHA-256 over the tensors' names, dtypes,
  shapes and bytes, in name order, read straight from the safetensors files: no torch, no unpickling, streamed);
- `chat_template`: the digest of the tokenizer's chat template (None when it has none);
- `agent`: the agent's settings (tag format, turn and token limits, overflow, system prompt as a digest, ...);
- `sampling`: greedy (temperature 0), top_p, the engine's seed; `engine`: its class and dtype;
- `retriever`: the index's identity (its digest of corpus, analyzer, k1, b and backend, read from the index's manifest,
  or a remote service's /health), `env`: the tools (top-k, ...), reward and instruction;
- `normalization`: the answer normalization's name and version (`NORMALIZATION`; a test ties it to the code);
- `benchmarks`: per benchmark the number of questions scored, the digest of those questions (id, question, golds, in
  order: a `limit` reads a prefix, so the file alone does not say what was scored) and its file's digest;
- `judge`: the judge reward's identity when `env.reward.judge` is configured (model or the URL's host, prompt digest);
- `dspo`: its version and git commit (null outside a git checkout).

Departure from a run record's "store the config": paths are replaced by digests of what they hold (an index, a model,
a file moved to another machine keeps its identity), and secrets never enter (a judge's `api_key_env` is dropped).
The collection is pure but for the digests of files and the git query; `dspo.eval.compare` reads it back.
"""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from dspo.env.judge import configured_prompt_digest

SCHEMA = 1
# The answer normalization every score uses (`dspo.metrics.normalize_answer`: FlashRAG / Search-R1's lowercasing,
# punctuation, articles and whitespace rules). tests/eval/test_pinned.py ties this name to the code's digest: a change
# to the normalization or the scores fails that test until this version is raised, so old reports stop comparing.
NORMALIZATION = "flashrag-normalize_answer/1"
LONG_TEXT = 120  # strings longer than this (system prompts, instructions) are pinned as their digest
CHUNK = 1 << 22
_TORCH_TO_SAFETENSORS = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip
# Judge settings that change how the verdicts are fetched, not what they are; the key's name is never pinned either.
JUDGE_OPERATIONAL_KEYS = frozenset(
    {"_partial_", "api_key_env", "concurrency", "timeout_s", "retries", "cache_size", "max_error_share", "device"}
)


def text_digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def compact(value: Any) -> Any:
    """Plain JSON with long strings as their digest (a 2 kB system prompt is pinned by what it is, not shown)."""
    if isinstance(value, Mapping):
        return {str(key): compact(inner) for key, inner in value.items()}
    if isinstance(value, list | tuple):
        return [compact(inner) for inner in value]
    if isinstance(value, str) and len(value) > LONG_TEXT:
        return text_digest(value)
    return value


# ------------------------------------------------------------------------------------------------ files and weights
@cache
def file_sha256(path: str) -> str:
    """SHA-256 of a file, streamed (cached per path for the process: benchmark files are read once per report)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def safetensors_entries(path: Path) -> list[tuple[str, str, list[int], int, int]]:
    """(name, dtype, shape, start, end) of each tensor of a safetensors file, from its JSON header (no tensor read)."""
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        header = json.loads(handle.read(length))
    base = 8 + length
    return [
        (name, info["dtype"], list(info["shape"]), base + info["data_offsets"][0], base + info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__"
    ]


def _update(digest: Any, name: str, dtype: str, shape: Sequence[int]) -> None:
    digest.update(json.dumps([name, dtype, list(shape)]).encode())


def weights_digest(folder: str | Path) -> dict[str, Any]:
    """The digest of a model folder's weights: tensors in name order, whatever their split into shards and files.
    {digest, tensors, bytes}; a folder without safetensors files (an old `.bin` model) is pinned by its files' bytes."""
    root = Path(folder).expanduser()
    files = sorted(root.glob("*.safetensors"))
    if not files:
        others = sorted(p for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth")) if root.is_dir() else []
        if not others:
            return {"digest": None, "note": f"no weight files in {root.name}"}
        digest = hashlib.sha256()
        for path in others:
            digest.update(f"{path.name}:{file_sha256(str(path))}".encode())
        return {"digest": "sha256:" + digest.hexdigest(), "files": len(others)}
    entries = sorted((entry, path) for path in files for entry in safetensors_entries(path))
    digest, total = hashlib.sha256(), 0
    for (name, dtype, shape, start, end), path in entries:
        _update(digest, name, dtype, shape)
        with path.open("rb") as handle:
            handle.seek(start)
            remaining = end - start
            while remaining > 0:
                block = handle.read(min(CHUNK, remaining))
                if not block:
                    raise ValueError(f"{path}: tensor {name} runs past the end of the file")
                digest.update(block)
                remaining -= len(block)
        total += end - start
    return {"digest": "sha256:" + digest.hexdigest(), "tensors": len(entries), "bytes": total}


def tensors_digest(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """`weights_digest` of tensors in memory (the same digest as the safetensors file they would be saved as)."""
    import torch

    digest, total, count = hashlib.sha256(), 0, 0
    for name, tensor in sorted(named, key=lambda pair: pair[0]):
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        dtype = _TORCH_TO_SAFETENSORS[str(flat.dtype).removeprefix("torch.")]
        _update(digest, name, dtype, tensor.shape)
        raw = flat.view(torch.uint8).numpy()
        digest.update(memoryview(raw))
        total, count = total + raw.nbytes, count + 1
    return {"digest": "sha256:" + digest.hexdigest(), "tensors": count, "bytes": total}


def chat_template_digest(tokenizer: Any) -> str | None:
    """The digest of the tokenizer's chat template (a string, or a dict of named templates); None without one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    return text_digest(template if isinstance(template, str) else json.dumps(template, sort_keys=True))


def folder_chat_template(folder: str | Path) -> str | None:
    """`chat_template_digest` of the tokenizer a model folder loads (as the engines load it)."""
    from transformers import AutoTokenizer

    return chat_template_digest(AutoTokenizer.from_pretrained(str(Path(folder).expanduser())))


def model_identity(folder: str | Path) -> tuple[dict[str, Any], str | None]:
    """(`weights_digest`, chat template digest) of the model folder an engine loads."""
    return weights_digest(folder), folder_chat_template(folder)


# ------------------------------------------------------------------------------------------------ settings
def agent_settings(agent: Mapping[str, Any] | None) -> dict[str, Any]:
    """The agent's settings but its sampling ones (pinned under `sampling`) and Hydra's `_partial_`."""
    skipped = {"temperature", "top_p", "_partial_"}
    return compact({key: value for key, value in (agent or {}).items() if key not in skipped})


def sampling_settings(agent: Mapping[str, Any] | None, engine: Mapping[str, Any] | None) -> dict[str, Any]:
    """Evaluation is greedy (`dspo.eval.pipeline.predict`): temperature 0, whatever the agent's training value."""
    return {"greedy": True, "temperature": 0.0, "top_p": (agent or {}).get("top_p"), "seed": (engine or {}).get("seed")}


def engine_settings(engine: Mapping[str, Any] | None) -> dict[str, Any]:
    target = str((engine or {}).get("_target_") or "")
    return {"class": target.rsplit(".", 1)[-1] or None, "dtype": (engine or {}).get("dtype")}


def remote_health(url: str) -> dict[str, Any]:
    """A retrieval service's /health (dspo-serve: index_digest, backend, num_passages); {} when it does not answer."""
    import httpx

    base = url.rstrip("/").removesuffix("/retrieve")
    try:
        answer = httpx.get(f"{base}/health", timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return answer if isinstance(answer, dict) else {}


def _public_url(url: str) -> str:
    """scheme://host:port/path of a URL: credentials and query strings never enter a report."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


def retriever_identity(section: Mapping[str, Any] | None, health: Any = remote_health) -> dict[str, Any]:
    """What the retriever answers: an in-process index's manifest (digest of corpus, analyzer, k1, b, backend), or a
    remote service's URL and the digest its /health reports (None when it does not say)."""
    section = section or {}
    if isinstance(section.get("index"), str):
        from dspo.search.bm25 import read_manifest

        manifest = read_manifest(section["index"]) or {}
        analyzer = manifest.get("tokenizer")
        return {
            "backend": manifest.get("backend", section.get("backend")),
            "index_digest": manifest.get("digest"),
            "passages_sha256": manifest.get("passages_sha256"),
            "num_passages": manifest.get("num_passages"),
            "analyzer": text_digest(json.dumps(analyzer, sort_keys=True)) if analyzer else None,
            "k1": manifest.get("k1", section.get("k1")),
            "b": manifest.get("b", section.get("b")),
        }
    url = section.get("url")
    if url:
        urls = [url] if isinstance(url, str) else list(url)
        answer = health(urls[0])
        return {
            "backend": "remote",
            "url": [_public_url(u) for u in urls],
            "index_digest": answer.get("index_digest"),
            "num_passages": answer.get("num_passages"),
            "served_backend": answer.get("backend"),
        }
    target = section.get("_target_")
    return {"backend": None if target is None else str(target), "index_digest": None}


# The reward decides what a model learns, which its weights' digest pins; a report's scores are the scored answer's
# subEM, EM and F1 (`dspo.eval.pipeline.score`), whatever the reward paid. So only the reward's parts that write the
# scored answer are pinned: its nested objects, `_target_` nodes (env=planner's answerer, whose answer is scored).
# Its class, its weights (IKEA's, the planner's costs), its credit and the rubric layer are not, so that comparing a
# model trained on one reward with one trained on another (the ablation) is not refused. The judge is pinned apart.
REWARD_LAYERS = ("judge", "rubric")


def env_settings(env: Mapping[str, Any] | None) -> dict[str, Any]:
    """The environment's settings (tools, instruction, the reward's answer-writing parts)."""
    env = dict(env or {})
    reward = env.get("reward")
    if isinstance(reward, Mapping):
        env["reward"] = {
            key: value
            for key, value in reward.items()
            if isinstance(value, Mapping) and "_target_" in value and key not in REWARD_LAYERS
        }
    return compact(env)


def judge_identity(node: Mapping[str, Any] | None, reward: Any = None) -> dict[str, Any] | None:
    """The judge of `env.reward.judge` (None when none): its settings that decide a verdict, the URL's host instead of
    the URL, a local judge's weights digest instead of its path, and the prompt's digest (the built reward's
    `prompt_digest` when it has one, else the digest of the configured prompt)."""
    if not node:
        return None
    settings = {key: value for key, value in node.items() if key not in JUDGE_OPERATIONAL_KEYS}
    base_url = settings.pop("base_url", None)
    if base_url:
        settings["host"] = urlsplit(str(base_url)).hostname
    model_path = settings.pop("model_path", None)
    if not base_url and model_path and Path(str(model_path)).expanduser().is_dir():
        settings["model_digest"] = weights_digest(model_path)["digest"]
    pinned_digest = getattr(reward, "prompt_digest", None)
    pinned_digest = pinned_digest() if callable(pinned_digest) else pinned_digest
    settings["prompt_digest"] = pinned_digest or configured_prompt_digest(**_verdict_settings(node))
    settings.pop("prompt", None)
    return compact(settings)


def _verdict_settings(node: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("mode", "choices", "scale", "prompt", "system")
    return {key: (list(node[key]) if key == "choices" else node[key]) for key in keys if node.get(key) is not None}


def judge_node(env: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    reward = (env or {}).get("reward")
    return reward.get("judge") if isinstance(reward, Mapping) else None


# ------------------------------------------------------------------------------------------------ benchmarks
def benchmark_files(data: Mapping[str, Any] | None) -> dict[str, str]:
    """{benchmark: file} of a data section (`load_benchmarks`' files/root, or a data module's test_files); `path`
    (one file for every benchmark in it) is keyed "". dspo-eval reads the same keys (`dspo.eval.cli.load_eval_sets`)."""
    data = data or {}
    if data.get("path"):
        return {"": str(data["path"])}
    files = data.get("files") if str(data.get("_target_", "")).endswith("load_benchmarks") else None
    if files:
        root = data.get("root")
        return {name: str(Path(root) / path) if root else str(path) for name, path in files.items()}
    return {name: str(path) for name, path in (data.get("test_files") or {}).items()}


def benchmarks_pinned(predictions: Sequence[Any], files: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Per benchmark: questions scored, the digest of those questions (in order) and of the file they came from."""
    files = files or {}
    grouped: dict[str, list[Any]] = {}
    for prediction in predictions:
        grouped.setdefault(prediction.benchmark, []).append(prediction)
    pinned = {}
    for name, group in grouped.items():
        digest = hashlib.sha256()
        for p in group:
            digest.update((json.dumps([p.id, p.question, list(p.golden_answers)], ensure_ascii=False) + "\n").encode())
        path = files.get(name) or files.get("")
        exists = path is not None and Path(path).expanduser().is_file()
        pinned[name] = {
            "n": len(group),
            "items_digest": "sha256:" + digest.hexdigest()[:32],
            "file_sha256": file_sha256(str(Path(path).expanduser())) if exists else None,
        }
    return pinned


# ------------------------------------------------------------------------------------------------ dspo itself
def dspo_identity() -> dict[str, Any]:
    """dspo's version and, in a git checkout, its commit and whether tracked files were changed (else null)."""
    from dspo import __version__

    root = Path(__file__).resolve().parents[2]
    identity: dict[str, Any] = {"version": __version__, "commit": None, "dirty": None}
    if not (root / ".git").exists():
        return identity
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return identity
    if head.returncode == 0:
        identity["commit"] = head.stdout.strip()
        identity["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    return identity


# ------------------------------------------------------------------------------------------------ the section
def collect(
    config: Mapping[str, Any],
    predictions: Sequence[Any],
    model: Mapping[str, Any],
    chat_template: str | None,
    reward: Any = None,
    health: Any = remote_health,
) -> dict[str, Any]:
    """The `pinned` section. `config`: plain sections `rollout` (agent, engine), `retriever`, `env`, `data` (a
    composed dspo-eval config's, or a run record's `config`); `model`: `weights_digest`'s answer; `reward`: the built
    reward when at hand (its `prompt_digest`)."""
    rollout = config.get("rollout") or {}
    agent, engine, env = rollout.get("agent"), rollout.get("engine"), config.get("env")
    return {
        "schema": SCHEMA,
        "model": dict(model),
        "chat_template": chat_template,
        "agent": agent_settings(agent),
        "sampling": sampling_settings(agent, engine),
        "engine": engine_settings(engine),
        "retriever": retriever_identity(config.get("retriever"), health),
        "env": env_settings(env),
        "normalization": NORMALIZATION,
        "benchmarks": benchmarks_pinned(predictions, benchmark_files(config.get("data"))),
        "judge": judge_identity(judge_node(env), reward),
        "dspo": dspo_identity(),
    }


def config_sections(cfg: Any) -> dict[str, Any]:
    """The plain sections `collect` reads, from a composed dspo-eval config (the env as a run record holds it:
    resolved but for its `${retriever...}`, so a training run's report and dspo-eval's pin the same env)."""
    from omegaconf import OmegaConf

    from dspo.runs.record import env_section

    def plain(key: str) -> Any:
        node = OmegaConf.select(cfg, key, default=None)
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

    return {
        "rollout": {"agent": plain("rollout.agent"), "engine": plain("rollout.engine")},
        "retriever": plain("retriever"),
        "env": env_section(cfg),
        "data": plain("data"),
    }
