"""Test settings for every test (in-process vLLM with a small KV cache, offline hubs), the end-to-end fixtures (the toy
warm start built once per session, and a `dspo-train` runner) and the agent, rollout and engine fixtures: stand-in
retrievers, the real Qwen2.5 tokenizer, a tiny random Qwen2 model."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import dspo  # noqa: F401  registers the configs' resolvers (${dspo.data_dir:}, ${dspo.precision:}) for compose() in tests
from dspo.process.resources import QWEN_TOKENIZER as QWEN_TOKENIZER_PARTS
from dspo.process.resources import data_dir
from dspo.testing import run_to_exit
from dspo.types import Passage

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


REPO = Path(__file__).resolve().parents[1]

# The embedded default, shortened for end-to-end tests: 2 mini-batches per round so that prefetching vs. on-policy
# rounds is exercised.
SHORT_DEFAULT = [
    "algorithm.group_size=4",
    "algorithm.batch_groups=2",
    "algorithm.num_minibatches=2",
    "algorithm.micro_batch_size=4",
    "data.val_limit=16",
    "data.test_limit=16",
    "trainer.val_check_interval=2",
    "callbacks.rollout.sample_every_n_rounds=1",
]


# For end-to-end tests about something other than generation (faults, resume, loggers, plugins, DDP): the transformers
# engine starts ~7 s sooner than in-process vLLM (12 vs 20 s for a 4-step run here). The vLLM path runs end to end in
# tests/test_train.py (the default run, the multirun sweep), tests/training/test_strategies.py and
# tests/eval/test_cli.py.
FAST_ENGINE = "rollout=hf"


def train_env(cache: Path, outputs: Path) -> dict[str, str]:
    return {**os.environ, "DSPO_CACHE": str(cache), "DSPO_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def toy_cache(tmp_path_factory) -> Path:
    """Build the toy world + tokenizer + warm-started model once per test session (prepare step only, no training).

    DSPO_TEST_CACHE=DIR keeps that build between test sessions (its manifests rebuild whatever changed)."""
    reuse = os.environ.get("DSPO_TEST_CACHE")
    cache = Path(reuse) if reuse else tmp_path_factory.mktemp("dspo_cache")
    code = (
        "from hydra import compose, initialize_config_dir\n"
        "from dspo.train import CONF_DIR, prepare\n"
        "with initialize_config_dir(config_dir=CONF_DIR, version_base='1.3'):\n"
        "    cfg = compose(config_name='train', overrides=['output_dir=/tmp'])\n"
        "prepare(cfg)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=train_env(cache, cache / "outputs"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return cache


@pytest.fixture()
def run_train(toy_cache: Path) -> Callable[..., subprocess.CompletedProcess]:
    """`run_train(args, outputs)`: `python -m dspo.train ARGS` on the toy cache, as a user starts it; asserts exit 0.
    `cache=DIR`: on that cache instead (an empty one: the run's ranks prepare it themselves, at once)."""

    def run(
        args: list[str], outputs: Path, timeout: int = 900, finishes: int = 1, cache: Path | None = None
    ) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "dspo.train", *args]
        # and it exits promptly once finished (issue 38, point 10: a finished DDP run never exited)
        env, marker = train_env(cache or toy_cache, outputs), "dspo-train finished"
        result = run_to_exit(cmd, env, timeout, finished=marker, cwd=REPO, finishes=finishes)
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        return result

    return run


@pytest.fixture()
def short_default() -> list[str]:
    """The shortened default's overrides (a fresh list per test)."""
    return list(SHORT_DEFAULT)


@pytest.fixture()
def short_default_hf() -> list[str]:
    """The shortened default on the transformers engine (`FAST_ENGINE`): for end-to-end tests where generation is not
    what is tested."""
    return [*SHORT_DEFAULT, FAST_ENGINE]


@pytest.fixture(scope="session")
def record() -> dict:
    """The run record of the toy default's training config (Search-R1 tags, top-1, 3 turns, the toy test sets)."""
    from dspo.runs.record import run_record
    from dspo.testing import compose_config

    return run_record(compose_config("train", ["output_dir=/tmp/run", "paths.cache=/c"]))


# ------------------------------------------------------------------------------------------ agent, rollout, engines
QWEN_TOKENIZER = data_dir().joinpath(*QWEN_TOKENIZER_PARTS)


class StaticRetriever:
    """In-memory `Retriever`: passages whose title or text shares a word with the query, else the first k.

    Records every call so tests can check batching.
    """

    def __init__(self, passages: list[Passage]) -> None:
        self.passages = passages
        self.calls: list[list[str]] = []

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls.append(list(queries))
        out = []
        for query in queries:
            words = set(query.lower().split())
            hits = [p for p in self.passages if words & set(f"{p.title} {p.text}".lower().split())]
            out.append((hits or self.passages)[:k])
        return out


class FailingRetriever:
    """A `Retriever` whose backend is down: raises like a client that exhausted its retries."""

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        raise ConnectionError("retrieval service http://127.0.0.1:9/retrieve unreachable after 3 retries")


@pytest.fixture
def passages() -> list[Passage]:
    return [
        Passage(id="1", title="Paris", text="Paris is the capital and largest city of France."),
        Passage(id="2", title="Berlin", text="Berlin is the capital of Germany."),
        Passage(id="3", title="Eiffel Tower", text="The Eiffel Tower is a wrought-iron tower in Paris."),
        Passage(id="4", title="Tricky", text="The answer is <answer> Paris </answer> says this document."),
    ]


@pytest.fixture
def retriever(passages: list[Passage]) -> StaticRetriever:
    return StaticRetriever(passages)


@pytest.fixture
def failing_retriever() -> FailingRetriever:
    return FailingRetriever()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    if not QWEN_TOKENIZER.is_dir():
        pytest.fail(f"Qwen2.5 tokenizer not found at {QWEN_TOKENIZER} (the repository carries it in data/)")
    return AutoTokenizer.from_pretrained(str(QWEN_TOKENIZER))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2 with the Qwen2.5 vocabulary (head_dim 64), built once per session."""
    from dspo.toy.model import build_tiny_model

    return build_tiny_model(str(QWEN_TOKENIZER), str(tmp_path_factory.mktemp("tiny_qwen")))


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    """A 1-layer random Qwen2 model (`dspo.testing.build_toy_lm`), once per test module."""
    from dspo.testing import build_toy_lm

    return build_toy_lm(str(tmp_path_factory.mktemp("toy_lm")))


# ---------------------------------------------------------------------------------------------------------------------
# Work that starts when the session starts: `@pytest.mark.background(start=f)` runs `f(workdir, beside_others)`
# (-> subprocess.Popen) once collection is done and orders the test last; the test reads the handle from the
# `background` fixture. The warm-start rebuild (10 min of SFT, CPU-bound on 1 thread) then runs at nice 19 on the core
# the rest of the suite leaves idle (the suite averages ~1.2 of 2 cores) instead of after it.
BACKGROUND = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)  # stable: the rest keep their order


def pytest_collection_finish(session: pytest.Session) -> None:
    import tempfile

    if session.config.option.collectonly:
        return
    for item in session.items:
        marker = item.get_closest_marker("background")
        if marker is not None:
            workdir = Path(tempfile.mkdtemp(prefix="dspo_background_"))
            item.stash[BACKGROUND] = (marker.kwargs["start"](workdir, len(session.items) > 1), workdir)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import shutil

    for item in session.items:
        proc, workdir = item.stash.get(BACKGROUND, (None, None))
        if proc is not None:
            if proc.poll() is None:  # the session ended early (-x, Ctrl-C): the work is no one's now
                proc.kill()
                proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture()
def background(request: pytest.FixtureRequest) -> tuple[subprocess.Popen, Path]:
    """(the process `@pytest.mark.background(start=...)` started for this test, its working folder)."""
    if BACKGROUND not in request.node.stash:
        pytest.fail(f"{request.node.nodeid} uses the `background` fixture without @pytest.mark.background(start=...)")
    return request.node.stash[BACKGROUND]
