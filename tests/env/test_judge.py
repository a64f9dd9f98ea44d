"""The judge reward (dspo.env.judge): the strict verdict parser, the prompt, dedupe and the cache, counted failures and
the batch that fails past its share, the key kept out of every text, the reward over subEM and over env=planner's
answerer, the HTTP client against a stub server, the local judge's choice by log-probabilities, and the config node."""

from __future__ import annotations

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dspo.env.answerer import ScriptedAnswerer
from dspo.env.judge import JudgedReward, JudgeFailureError, JudgePrompt, Triple, VerdictError, VerdictParser
from dspo.env.judge_client import HTTPJudge, JudgeUnavailableError, LocalJudge, Reply, choice_logprobs
from dspo.env.planner import PlannerReward
from dspo.env.rewards import EpisodeRecord, SubEMReward, TurnRecord
from dspo.env.tools import ToolResult
from dspo.types import Passage, QAItem

REPO = Path(__file__).resolve().parents[2]
WARM_START = REPO / "data" / "toy_warmstart" / "model"


class ScriptedJudge:
    """Replies from `verdicts[answer]` (a text, or an exception's message as an error); records every call."""

    name = "http://judge.test/v1"

    def __init__(self, verdicts: dict[str, str | Exception], default: str = "no") -> None:
        self.verdicts, self.default, self.asked = verdicts, default, []

    def judge(self, conversations):
        replies = []
        for messages in conversations:
            answer = messages[-1]["content"].split("Answer: ")[1].split("\n")[0]
            self.asked.append(answer)
            verdict = self.verdicts.get(answer, self.default)
            replies.append(Reply(error=str(verdict)) if isinstance(verdict, Exception) else Reply(text=verdict))
        return replies


def episode(answer: str | None, question: str = "Who founded Kozand?", golds=("Bob Lin",), turns=()) -> EpisodeRecord:
    return EpisodeRecord(QAItem(id=question, question=question, golden_answers=list(golds)), list(turns), answer)


def judged(verdicts: dict, **settings) -> tuple[JudgedReward, ScriptedJudge]:
    judge = ScriptedJudge(verdicts)
    return JudgedReward(SubEMReward(), client=judge, **settings), judge


# ------------------------------------------------------------------------------------------ the parser
DECORATED = st.tuples(st.sampled_from(["yes", "no"]), st.sampled_from(["", " ", "\n", "  \t"]), st.booleans())


@given(DECORATED, st.sampled_from(["", " ", "\n"]), st.booleans())
def test_a_choice_word_with_case_space_or_one_period_parses(word_pad_upper, tail, period):
    word, pad, upper = word_pad_upper
    reply = f"{pad}{word.upper() if upper else word}{'.' if period else ''}{tail}"
    assert VerdictParser().parse(reply) == (1.0 if word == "yes" else 0.0)


@given(st.text(max_size=40))
def test_anything_else_is_a_failure_never_a_guess(reply):
    normalized = reply.strip().lower()
    normalized = normalized[:-1].rstrip() if normalized.endswith(".") else normalized
    if normalized in ("yes", "no"):
        return
    with pytest.raises(VerdictError):
        VerdictParser().parse(reply)


@pytest.mark.parametrize(
    "reply", ["yes, it is", "Yes no", "no..", "yes!", "y", "YES because", "'yes'", "<think>yes", "yes\nno", "1"]
)
def test_near_misses_fail(reply):
    with pytest.raises(VerdictError):
        VerdictParser().parse(reply)


def test_a_reasoning_block_before_the_verdict_is_skipped():
    assert VerdictParser().parse("<think>the gold is Bob; yes</think>\nNo") == 0.0


@given(st.integers(min_value=0, max_value=10), st.sampled_from(["", ".", " ", ".0"]))
def test_score_mode_normalizes_numbers_in_range(value, tail):
    assert VerdictParser("score", scale=10).parse(f"{value}{tail}") == pytest.approx(value / 10)


@given(st.one_of(st.integers(min_value=11, max_value=10**6), st.integers(max_value=-1)))
def test_score_mode_refuses_numbers_out_of_range(value):
    with pytest.raises(VerdictError):
        VerdictParser("score", scale=10).parse(str(value))


@given(st.text(alphabet="0123456789 ./-abc", max_size=8))
def test_score_mode_parses_only_one_plain_number(reply):
    parser = VerdictParser("score", scale=10)
    try:
        value = parser.parse(reply)
    except VerdictError:
        return
    text = reply.strip().rstrip(".").strip()
    assert float(text) == pytest.approx(value * 10) and all(c in "0123456789." for c in text)


def test_parser_settings_are_checked_naming_the_key():
    with pytest.raises(ValueError, match="env.reward.judge.mode"):
        VerdictParser("likert")
    with pytest.raises(ValueError, match="env.reward.judge.choices"):
        VerdictParser(choices=["yes", "yes"])
    with pytest.raises(ValueError, match="env.reward.judge.scale"):
        VerdictParser("score", scale=0)
    assert VerdictParser("score", scale=3).words == ["0", "1", "2", "3"]


# ------------------------------------------------------------------------------------------ the prompt
def test_the_prompt_holds_the_triple_and_its_digest_pins_the_template():
    parser = VerdictParser()
    prompt = JudgePrompt(parser)
    (message,) = prompt.render(Triple("Who {x}?", ("Bob Lin", "B. Lin"), "{answer} Bob"))
    assert "Who {x}?" in message["content"] and "Bob Lin | B. Lin" in message["content"]
    assert "{answer} Bob" in message["content"] and "yes or no" in message["content"]
    other = JudgePrompt(parser, "Q {question} G {golds} A {answer}", system="be strict")
    assert other.digest != prompt.digest and other.render(Triple("q", ("g",), "a"))[0]["role"] == "system"
    assert JudgePrompt(VerdictParser("score")).digest != prompt.digest
    with pytest.raises(ValueError, match="env.reward.judge.prompt"):
        JudgePrompt(parser, "Q {question} A {answer}")
    with pytest.raises(ValueError, match="env.reward.judge.prompt"):
        JudgePrompt(parser, "{question} {golds} {answer} {secret}")


# ------------------------------------------------------------------------------------------ the reward
def test_the_verdict_replaces_subem_and_subem_stays_logged():
    reward, judge = judged({"B. Lin": "yes", "Bob Lin Alice": "no"})
    results = reward.score([episode("B. Lin"), episode("Bob Lin Alice"), episode(None)])
    assert [r.outcome for r in results] == [1.0, 0.0, 0.0]
    assert [r.components["subem"] for r in results] == [0.0, 1.0, 0.0]
    assert [r.components["judge"] for r in results] == [1.0, 0.0, 0.0]
    assert [r.components.get("judge_agrees") for r in results] == [0.0, 0.0, None]  # no answer: nothing asked
    assert judge.asked == ["B. Lin", "Bob Lin Alice"]
    assert reward.credit == "trajectory" and reward.extract_answer("<answer>x</answer>") == "x"
    assert reward.max_answer_words is None  # other attributes are the base reward's


def test_an_answer_too_long_is_judged_zero_without_a_call():
    reward, judge = judged({}, max_answer_chars=10)
    (result,) = reward.score([episode("Bob Lin " * 5)])
    assert result.outcome == 0.0 and judge.asked == [] and result.components["judge_calls"] == 0.0


def test_identical_triples_are_judged_once_per_batch_and_cached_across_batches():
    reward, judge = judged({"Bob Lin": "yes"})
    first = reward.score([episode("Bob Lin"), episode("Bob Lin"), episode("Alice"), episode("Bob Lin", golds=("B",))])
    assert judge.asked == ["Bob Lin", "Alice", "Bob Lin"]  # other golds: another triple
    assert [r.components["judge_deduped"] for r in first] == [0.0, 1.0, 0.0, 0.0]
    second = reward.score([episode("Alice"), episode("Bob Lin"), episode("Carol")])
    assert judge.asked[3:] == ["Carol"]
    assert [r.components["judge_cached"] for r in second] == [1.0, 1.0, 0.0]
    assert [r.outcome for r in second] == [0.0, 1.0, 0.0]
    assert (reward.totals.calls, reward.totals.deduped, reward.totals.cached) == (4, 1, 2)


def test_the_cache_is_bounded_and_least_recently_used_goes_first():
    reward, judge = judged({}, cache_size=2)
    reward.score([episode("a"), episode("b")])
    reward.score([episode("a")])  # a is now the most recent
    reward.score([episode("c")])  # evicts b
    reward.score([episode("a"), episode("b")])
    assert judge.asked == ["a", "b", "c", "b"] and len(reward.cache) == 2
    off, judge_off = judged({}, cache_size=0)
    off.score([episode("a")])
    off.score([episode("a")])
    assert judge_off.asked == ["a", "a"]


def test_a_failed_verdict_falls_back_to_the_base_outcome_is_counted_and_not_cached():
    reward, judge = judged({"Bob Lin": "maybe", "Alice": TimeoutError("read timed out")}, max_error_share=1.0)
    results = reward.score([episode("Bob Lin"), episode("Alice"), episode("Carol")])
    assert [r.outcome for r in results] == [1.0, 0.0, 0.0]  # subEM's
    assert [r.components["judge_error"] for r in results] == [1.0, 1.0, 0.0]
    assert "judge" not in results[0].components and results[2].components["judge"] == 0.0
    assert reward.totals.errors == 2
    reward.score([episode("Bob Lin")])
    assert judge.asked.count("Bob Lin") == 2  # asked again: failures are not kept


def test_past_the_share_the_batch_fails_naming_the_key_and_the_url():
    reward, _ = judged({"Alice": "perhaps"}, max_error_share=0.25)
    reward.score([episode(a) for a in ("Alice", "Bob Lin", "Carol", "Dan")])  # 1 of 4: at the share
    with pytest.raises(JudgeFailureError, match=r"env.reward.judge.max_error_share=0.25.*") as failure:
        reward.score([episode(a) for a in ("Alice", "Eve", "Fay")])  # the cache answers none: Alice failed
    assert "http://judge.test/v1" in str(failure.value) and "1 of 3 calls" in str(failure.value)


def test_the_planner_case_judges_the_answerers_answer():
    base = PlannerReward(ScriptedAnswerer(), plan_weight=0.0)
    judge = ScriptedJudge({"Bob Lin": "yes"})
    reward = JudgedReward(base, client=judge)
    found = TurnRecord(
        "<search> Kozand </search>",
        call=("search", {"query_list": ["Kozand"]}),
        result=ToolResult("Kozand was founded by Bob Lin.", passages=[Passage("p1", "Kozand", "founded by Bob Lin")]),
    )
    results = reward.score([episode("the planner's own guess", turns=[found]), episode("Bob Lin")])
    assert judge.asked == ["Bob Lin"]  # the answerer's answer; the second planner found nothing: no answer, no call
    assert [r.outcome for r in results] == [1.0, 0.0]
    assert results[0].components["answerer_subem"] == 1.0 and results[0].answer == "Bob Lin"
    assert results[0].shaping == pytest.approx(-0.1)  # one search + the hand-off, the base's costs kept
    assert reward.credit == "trajectory" and reward.ask_tool == "ask"


# ------------------------------------------------------------------------------------------ the HTTP client
class _Stub(BaseHTTPRequestHandler):
    """Serves /v1/models; /v1/chat/completions answers from the class's script (status, body), echoing the
    Authorization header into error bodies: a client that printed bodies unscrubbed would leak the key."""

    script: list[tuple[int, str]] = []
    bodies: list[dict] = []

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self._send(200, json.dumps({"data": [{"id": "judge-model"}]}))

    def do_POST(self):
        _Stub.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        status, text = _Stub.script.pop(0) if _Stub.script else (200, "yes")
        if status == 200:
            self._send(200, json.dumps({"choices": [{"message": {"content": text}}]}))
        else:
            self._send(status, f"{text} (you sent {self.headers.get('Authorization')})")

    def _send(self, status, body):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Stub.script, _Stub.bodies = [], []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_http_judge_retries_what_a_retry_can_fix_and_constrains_on_request(stub_url):
    _Stub.script = [(503, "busy"), (200, "no"), (400, "bad request")]
    judge = HTTPJudge(stub_url, "judge-model", ["yes", "no"], retries=1, concurrency=1, constrain=True)
    assert judge.judge([[{"role": "user", "content": "q"}]]) == [Reply(text="no")]
    (failed,) = judge.judge([[{"role": "user", "content": "q"}]])
    assert failed.text is None and failed.error.startswith("HTTP 400") and len(_Stub.bodies) == 3  # no retry
    assert _Stub.bodies[0]["structured_outputs"] == {"choice": ["yes", "no"]}
    assert _Stub.bodies[0]["temperature"] == 0.0 and _Stub.bodies[0]["model"] == "judge-model"


def test_the_api_key_never_appears_in_errors_reprs_or_logs(stub_url, monkeypatch, caplog):
    secret = "sk-test-5f3c9a0e7d1b"
    monkeypatch.setenv("DSPO_TEST_JUDGE_KEY", secret)
    caplog.set_level(logging.DEBUG)
    _Stub.script = [(500, "oops")] * 3 + [(401, "denied")]
    settings = {"base_url": stub_url, "model": "judge-model", "api_key_env": "DSPO_TEST_JUDGE_KEY", "retries": 2}
    reward = JudgedReward(SubEMReward(), max_error_share=0.5, concurrency=1, **settings)
    texts = [repr(reward), repr(reward.client), str(reward.describe())]
    with pytest.raises(JudgeFailureError) as failure:
        reward.score([episode("Bob Lin")])
    texts.append(str(failure.value))
    ok = JudgedReward(SubEMReward(), max_error_share=1.0, **settings)
    texts += [json.dumps(r.components) for r in ok.score([episode("Alice")])]
    assert "Bearer " + secret not in " ".join(str(b) for b in _Stub.bodies)  # the stub saw it in headers only
    assert "(you sent Bearer <api key>)" in texts[3]  # the server echoed it; the error shows it scrubbed
    assert secret not in "\n".join(texts) + caplog.text
    monkeypatch.delenv("DSPO_TEST_JUDGE_KEY")
    with pytest.raises(ValueError, match="api_key_env='DSPO_TEST_JUDGE_KEY'"):
        JudgedReward(SubEMReward(), **settings)


def test_a_judge_that_is_down_fails_at_once_naming_the_url(stub_url):
    down = stub_url.replace("/v1", "/nowhere/v1").rsplit(":", 1)[0] + ":9/v1"  # port 9 (discard): refused
    with pytest.raises(JudgeUnavailableError, match=r"env.reward.judge.base_url: the judge at http://127.0.0.1:9/v1"):
        JudgedReward(SubEMReward(), base_url=down, model="m", retries=0)
    with pytest.raises(JudgeUnavailableError, match="env.reward.judge.model='other'"):
        JudgedReward(SubEMReward(), base_url=stub_url, model="other")
    with pytest.raises(ValueError, match="env.reward.judge.model"):
        JudgedReward(SubEMReward(), base_url=stub_url)


# ------------------------------------------------------------------------------------------ the local judge
@pytest.fixture(scope="module")
def warm_start_judge() -> LocalJudge:
    if not WARM_START.is_dir():
        pytest.skip("the shipped warm start is missing")
    return LocalJudge(str(WARM_START), ["yes", "no"], batch_size=3)


def test_the_local_judge_picks_the_likeliest_choice_word_batched_or_not(warm_start_judge):
    reward = JudgedReward(SubEMReward(), client=warm_start_judge)
    results = reward.score([episode(a) for a in ("Bob Lin", "Alice", "no idea", "Kozand")])
    assert all(r.components["judge_error"] == 0.0 for r in results)  # always parseable
    engine = warm_start_judge.engine()
    assert engine is warm_start_judge.engine() and not any(p.requires_grad for p in engine.engine.model.parameters())
    tokenizer, model = engine.tokenizer, engine.engine.model
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("Who founded Kozand? ", "yes or no")]
    words = [tokenizer.encode(word, add_special_tokens=False) for word in ("yes", "no", "Bob Lin")]
    batched = choice_logprobs(model, prompts, words, tokenizer.pad_token_id, batch_size=16)
    for p, prompt in enumerate(prompts):  # each prompt + word alone, unpadded, every position's logits: the same
        for w, word in enumerate(words):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + word])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            reference = sum(logp[len(prompt) - 1 + j, token] for j, token in enumerate(word))
            assert abs(batched[p, w].item() - float(reference)) < 1e-4, (p, w)


# ------------------------------------------------------------------------------------------ the config node
def test_the_config_node_wraps_any_envs_reward(monkeypatch):
    from hydra import compose, initialize_config_dir

    from dspo.env.build import build_environment

    monkeypatch.setenv("DSPO_DATA", str(REPO / "data"))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for env, base in (("search", "subem"), ("planner", "answerer_subem")):
            cfg = compose(config_name="train", overrides=[f"env={env}", "env/reward=judge"])
            reward = build_environment(cfg.env, tools={}).reward  # the tools are not what this test builds
            assert isinstance(reward, JudgedReward) and reward.base.name == base
            assert isinstance(reward.client, LocalJudge) and os.path.samefile(reward.client.name, WARM_START)
            assert reward.parser.choices == ["yes", "no"] and reward.max_error_share == 0.05
