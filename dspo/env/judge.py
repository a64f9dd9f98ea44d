"""An LLM judge as the outcome reward (`env/reward=judge`, issue 73): a judge reads the question, the gold answers and
the answer given, and its verdict replaces the environment's reward's outcome.

Exact-match rewards miss correct answers phrased otherwise and pay answers that hold a gold answer by accident (subEM
pays "1" inside "1991"; a list of guesses). verl, verifiers (`JudgeRubric`), ART (RULER), ROLL and SkyRL pay with a
judge instead; here it wraps any reward (`JudgedReward(base)`), so it composes with every `env=`:

- the judge's verdict becomes the outcome (what the dynamic filter tests and the advantage starts from); the base's
  shaping, step rewards and components stay, its outcome logged under its own name (`reward/subem`,
  `reward/answerer_subem`) beside `reward/judge` and `reward/judge_agrees` (verdict and base outcome on the same
  side of 0.5, over the episodes the judge was asked about: the agreement figure);
- the answer judged is the one the base reward scored in the policy's place when it set one (`RewardResult.answer`:
  env=planner's answerer), else the policy's (`EpisodeRecord.answer`). No answer is judged 0 without a call, as subEM
  scores it; so is an answer over `max_answer_chars` (a long answer is a list of guesses, or text aimed at the judge);
- verdicts are parsed strictly (`VerdictParser`): the reply must be exactly one choice word (`mode: yes_no`) or one
  number in [0, scale] (`mode: score`, normalized to [0, 1]); anything else is a failed verdict, never a guess;
- a batch's identical (question, gold answers, answer) triples are judged once, and verdicts are kept across rounds
  in a bounded LRU (`cache_size`); failures are not kept, so the next round asks again;
- a failed verdict (unparseable, timed out, an HTTP error after retries) fails that episode's judgement only: its
  outcome falls back to the base reward's, counted as `reward/judge_error` (1.0 on that episode). This departs from
  the endpoint agent's failed episode, a masked stub whose group is dropped: the episode itself ran and its tokens
  are the policy's, so the base reward's outcome is a measured score of it, not a crash. Past `max_error_share` of a
  batch's judge calls failing, the batch fails (`JudgeFailureError`) naming env.reward.judge and the judge's URL, as
  `env.max_tool_error_share` does for a tool: a judge that is down is not a round of base-reward outcomes;
- per batch, on each episode (means over a round's trajectories, as every `reward/<name>`): `judge_calls` (1.0 on the
  episode whose triple was sent), `judge_deduped` (the same triple was sent for another episode of its batch),
  `judge_cached` (answered from the LRU), `judge_s` (the batch's judge seconds / its episodes). A round's calls are
  `reward/judge_calls` x its sampled trajectories, its judge seconds `reward/judge_s` x the same; the running totals
  are on `JudgedReward.totals`. These are the components every agent already folds into the round's statistics (the
  tool-calling loop and the endpoint agent alike), so nothing in the rollout had to learn about judges.

The judge is a local frozen model (`model_path`, the toy's warm start by default: it picks its verdict by the
log-probability of each choice word, `dspo.env.judge_client.LocalJudge`) or any OpenAI-compatible URL (`base_url`,
`model`, `api_key_env`; `HTTPJudge`). `describe()` is what a report pins: the judge's name (URL or model path, never a
key), its model and the prompt's digest.
"""

from __future__ import annotations

import hashlib
import re
import string
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dspo.env.judge_client import Conversation, HTTPJudge, JudgeClient, LocalJudge, Reply
from dspo.env.rewards import EpisodeRecord, RewardResult

MODES = ("yes_no", "score")
DEFAULT_PROMPT = {
    "yes_no": (
        "You grade an answer to a question against the question's gold answers.\n"
        "Question: {question}\nGold answers: {golds}\nAnswer: {answer}\n"
        "Does the answer name the same thing as one of the gold answers (other wording, an alias or a correct extra "
        "detail is fine; several candidates or a hedge is not)? Reply with one word: {choices}."
    ),
    "score": (
        "You grade an answer to a question against the question's gold answers.\n"
        "Question: {question}\nGold answers: {golds}\nAnswer: {answer}\n"
        "How correct is the answer, from 0 (wrong, several candidates, or no answer) to {scale} (the same thing as a "
        "gold answer, in any wording)? Reply with one integer: {choices}."
    ),
}
FIELDS = {"question", "golds", "answer", "choices", "scale"}
_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)  # a reasoning model's block before its verdict
_NUMBER = re.compile(r"^(\d+(?:\.\d+)?)$")


class VerdictError(ValueError):
    """A judge's reply that is not a verdict."""


class JudgeFailureError(RuntimeError):
    """The judge failed on more than `env.reward.judge.max_error_share` of a batch's calls."""


# ------------------------------------------------------------------------------------------ the verdict
class VerdictParser:
    """Reads a reply strictly (the module). `yes_no`: the reply, trimmed, lower-cased, without one trailing period
    and without a leading `<think>…</think>` block, must equal a choice word: the first scores 1, the second 0.
    `score`: the same reply must be one number in [0, scale], returned divided by `scale`."""

    def __init__(self, mode: str = "yes_no", choices: Sequence[str] = ("yes", "no"), scale: int = 10) -> None:
        if mode not in MODES:
            raise ValueError(f"env.reward.judge.mode={mode!r}: choose one of {list(MODES)}")
        choices = [str(c).strip().lower() for c in choices]
        if mode == "yes_no" and (len(choices) != 2 or len(set(choices)) != 2 or not all(choices)):
            raise ValueError(f"env.reward.judge.choices={choices}: two different words, the positive one first")
        if mode == "score" and (not isinstance(scale, int) or scale < 1):
            raise ValueError(f"env.reward.judge.scale={scale!r}: an integer >= 1")
        self.mode, self.choices, self.scale = mode, choices, scale

    @property
    def words(self) -> list[str]:
        """Every reply that parses, one per verdict: what a constrained server or the local model chooses from."""
        return list(self.choices) if self.mode == "yes_no" else [str(i) for i in range(self.scale + 1)]

    def parse(self, reply: str) -> float:
        text = _THINK.sub("", reply).strip().lower()
        text = text[:-1].rstrip() if text.endswith(".") else text
        if self.mode == "yes_no":
            if text not in self.choices:
                raise VerdictError(f"expected exactly one of {self.choices}, got {reply[:80]!r}")
            return 1.0 if text == self.choices[0] else 0.0
        match = _NUMBER.match(text)
        value = float(match.group(1)) if match else -1.0
        if not 0 <= value <= self.scale:
            raise VerdictError(f"expected one number in [0, {self.scale}], got {reply[:80]!r}")
        return value / self.scale


# ------------------------------------------------------------------------------------------ the prompt
@dataclass(frozen=True)
class Triple:
    """What a verdict depends on: the dedupe and cache key."""

    question: str
    golds: tuple[str, ...]
    answer: str


def configured_prompt_digest(
    mode: str = "yes_no",
    choices: Sequence[str] = ("yes", "no"),
    scale: int = 10,
    prompt: str | None = None,
    system: str | None = None,
    **_: Any,
) -> str:
    """The prompt digest a `JudgedReward` built from these `env.reward.judge` settings pins, without building it (the
    training test stage at k >= 1 has no built reward in the trainer, and must pin what `dspo-eval` pins)."""
    return JudgePrompt(VerdictParser(mode, list(choices), scale), prompt, system).digest


class JudgePrompt:
    """The judge's conversation for a triple: the `template` (fields {question}, {golds}, {answer}, and optionally
    {choices}, {scale}) as one user message, after `system` when set. `digest` names both, the mode and the choices,
    for reports (a changed prompt is a changed reward)."""

    def __init__(self, parser: VerdictParser, template: str | None = None, system: str | None = None) -> None:
        template = template or DEFAULT_PROMPT[parser.mode]
        named = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        if named - FIELDS or not {"question", "golds", "answer"} <= named:
            raise ValueError(
                f"env.reward.judge.prompt: the template must use {{question}}, {{golds}} and {{answer}} and may use "
                f"{{choices}} and {{scale}}; it uses {sorted(named)}"
            )
        self.parser, self.template, self.system = parser, template, system
        choices = " or ".join(parser.choices) if parser.mode == "yes_no" else f"0 to {parser.scale}"
        self._fixed = {"choices": choices, "scale": str(parser.scale)}
        pinned = "\x00".join([parser.mode, *parser.words, system or "", template])
        self.digest = hashlib.sha256(pinned.encode()).hexdigest()[:16]

    def render(self, triple: Triple) -> Conversation:
        golds = " | ".join(triple.golds)
        user = self.template.format(question=triple.question, golds=golds, answer=triple.answer, **self._fixed)
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": user}]


# ------------------------------------------------------------------------------------------ the cache
class VerdictCache:
    """A bounded LRU of verdicts across rounds (`cache_size` triples; 0: off)."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"env.reward.judge.cache_size={size}: must be >= 0 (0: no cache)")
        self.size, self._items = size, OrderedDict()

    def get(self, triple: Triple) -> float | None:
        value = self._items.get(triple)
        if value is not None:
            self._items.move_to_end(triple)
        return value

    def put(self, triple: Triple, value: float) -> None:
        if self.size:
            self._items[triple] = value
            self._items.move_to_end(triple)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class Totals:
    """The judge's running counts since it was built (the measurement and reports read them)."""

    episodes: int = 0
    calls: int = 0
    deduped: int = 0
    cached: int = 0
    errors: int = 0
    seconds: float = 0.0
    agreements: list[float] = field(default_factory=list, repr=False)


# ------------------------------------------------------------------------------------------ the reward
class JudgedReward:
    """A reward whose outcome is a judge's verdict (the module). `base` is the environment's reward; the settings are
    config keys `env.reward.judge.<key>` (conf/env/reward/judge.yaml says each):
    base_url, model, api_key_env: an OpenAI-compatible judge (None: the local model).
    model_path, device, dtype, batch_size: the local judge model.
    mode, choices, scale, prompt, system: the verdict and what the judge is asked (`VerdictParser`, `JudgePrompt`).
    concurrency, timeout_s, retries, max_tokens, constrain: the HTTP client's.
    cache_size: verdicts kept across rounds. max_error_share: the batch fails past this share of failed calls.
    max_answer_chars: longer answers are judged 0 without a call.
    client: a built `JudgeClient` instead (tests, a scripted judge).
    """

    name = "judge"

    def __init__(
        self,
        base: Any,
        base_url: str | None = None,
        model: str | None = None,
        api_key_env: str | None = None,
        model_path: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        mode: str = "yes_no",
        choices: Sequence[str] = ("yes", "no"),
        scale: int = 10,
        prompt: str | None = None,
        system: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 30.0,
        retries: int = 2,
        max_tokens: int = 8,
        constrain: bool = False,
        cache_size: int = 100_000,
        max_error_share: float = 0.05,
        max_answer_chars: int = 500,
        client: JudgeClient | None = None,
    ) -> None:
        if not callable(getattr(base, "score", None)):
            raise TypeError(f"env.reward.judge: the base reward {type(base).__name__} has no score(episodes) method")
        if not 0 <= max_error_share <= 1:
            raise ValueError(f"env.reward.judge.max_error_share={max_error_share}: must be within [0, 1]")
        if max_answer_chars < 1:
            raise ValueError(f"env.reward.judge.max_answer_chars={max_answer_chars}: must be >= 1")
        self.base, self.parser = base, VerdictParser(mode, list(choices), scale)
        self.prompt = JudgePrompt(self.parser, prompt, system)
        self.cache, self.totals = VerdictCache(cache_size), Totals()
        self.max_error_share, self.max_answer_chars = max_error_share, max_answer_chars
        self.client = client or _client(self.parser.words, base_url, model, api_key_env, model_path, locals())
        self.model = model if base_url else model_path

    # the Reward protocol: the base's credit and answer extraction
    @property
    def credit(self) -> str:
        return self.base.credit

    def extract_answer(self, text: str) -> str | None:
        return self.base.extract_answer(text)

    def __getattr__(self, name: str) -> Any:
        """Any other attribute a reader of `env.reward` asks for is the base reward's."""
        if name.startswith("__") or name in ("base", "client", "parser", "prompt", "cache", "totals"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def __repr__(self) -> str:
        return f"JudgedReward(base={type(self.base).__name__}, judge={self.client!r}, prompt={self.prompt.digest})"

    @property
    def prompt_digest(self) -> str:
        return self.prompt.digest

    def describe(self) -> dict[str, Any]:
        """What decides the judge's score, for reports: its name (URL or model path), model, mode and prompt."""
        name = self.client.name
        return {"judge": name, "model": self.model, "mode": self.parser.mode, "prompt_digest": self.prompt.digest}

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        results = self.base.score(episodes)
        if len(results) != len(episodes):
            raise RuntimeError(f"{type(self.base).__name__}.score returned {len(results)} for {len(episodes)}")
        triples = [self._triple(e, r) for e, r in zip(episodes, results)]
        start = time.perf_counter()
        verdicts, sources, failures = self._verdicts(triples)
        seconds = time.perf_counter() - start
        self._check(failures, sources.count("call"))
        share = seconds / max(len(episodes), 1)
        judged = [self._judged(r, v, s, share) for r, v, s in zip(results, verdicts, sources)]
        self._count(judged, seconds, len(failures))
        return judged

    def _triple(self, episode: EpisodeRecord, result: RewardResult) -> Triple | None:
        answer = result.answer if result.answer is not None else episode.answer
        if not answer or not answer.strip() or len(answer) > self.max_answer_chars:
            return None
        golds = tuple(str(g) for g in episode.item.golden_answers)
        return Triple(episode.item.question, golds, answer.strip())

    def _verdicts(self, triples: list[Triple | None]) -> tuple[list[float | str], list[str], list[str]]:
        """Per episode: the verdict in [0, 1] or the failure's text, and where it came from ("none": no answer,
        "call", "deduped", "cached"); and the failures of the calls made."""
        sources, asked = [], {}
        for triple in triples:
            if triple is None:
                sources.append("none")
            elif self.cache.get(triple) is not None:
                sources.append("cached")
            elif triple in asked:
                sources.append("deduped")
            else:
                asked[triple] = len(asked)
                sources.append("call")
        replies = self.client.judge([self.prompt.render(t) for t in asked]) if asked else []
        if len(replies) != len(asked):
            raise RuntimeError(f"env.reward.judge: the judge returned {len(replies)} replies for {len(asked)}")
        outcomes = [self._parse(reply) for reply in replies]
        for triple, index in asked.items():
            if isinstance(outcomes[index], float):
                self.cache.put(triple, outcomes[index])
        verdicts: list[float | str] = []
        for triple, source in zip(triples, sources):
            if source == "none":
                verdicts.append(0.0)
            elif source == "cached":
                verdicts.append(self.cache.get(triple))
            else:
                verdicts.append(outcomes[asked[triple]])
        return verdicts, sources, [o for o in outcomes if isinstance(o, str)]

    def _parse(self, reply: Reply) -> float | str:
        if reply.error is not None or reply.text is None:
            return reply.error or "no reply"
        try:
            return self.parser.parse(reply.text)
        except VerdictError as exc:
            return f"unparseable verdict: {exc}"

    def _check(self, failures: list[str], asked: int) -> None:
        if not failures:
            return
        share = len(failures) / max(asked, 1)
        if share > self.max_error_share:
            raise JudgeFailureError(
                f"env.reward.judge: the judge at {self.client.name} failed on {len(failures)} of {asked} calls in "
                f"this batch (share {share:.2f} > env.reward.judge.max_error_share={self.max_error_share}); first "
                f"failure: {failures[0][:300]}. Check the judge (server, model, prompt): the round is aborted rather "
                "than trained on the base reward's outcomes"
            )

    def _judged(self, result: RewardResult, verdict: float | str, source: str, seconds: float) -> RewardResult:
        components = dict(result.components)
        components.setdefault(getattr(self.base, "name", "base"), result.outcome)
        failed = isinstance(verdict, str)
        components.update(
            judge_error=float(failed),
            judge_calls=float(source == "call"),
            judge_deduped=float(source == "deduped"),
            judge_cached=float(source == "cached"),
            judge_s=seconds,
        )
        outcome = result.outcome
        if not failed:
            outcome = float(verdict)
            components["judge"] = outcome
        if not failed and source != "none":  # agreement where the judge was asked, not on the rule's zeros
            components["judge_agrees"] = float((outcome >= 0.5) == (result.outcome >= 0.5))
        return RewardResult(outcome, result.shaping, list(result.step_rewards), components, result.answer)

    def _count(self, judged: list[RewardResult], seconds: float, errors: int) -> None:
        totals = self.totals
        totals.episodes += len(judged)
        totals.seconds += seconds
        totals.errors += errors
        for result in judged:
            c = result.components
            totals.calls += int(c["judge_calls"])
            totals.deduped += int(c["judge_deduped"])
            totals.cached += int(c["judge_cached"])
            if "judge_agrees" in c:
                totals.agreements.append(c["judge_agrees"])


def _client(
    words: list[str],
    base_url: str | None,
    model: str | None,
    api_key_env: str | None,
    model_path: str | None,
    settings: dict[str, Any],
) -> JudgeClient:
    """The HTTP judge when `base_url` is set, else the local model."""
    if base_url:
        keys = ("concurrency", "timeout_s", "retries", "max_tokens", "constrain")
        return HTTPJudge(base_url, str(model or ""), words, api_key_env, **{k: settings[k] for k in keys})
    if api_key_env or model:
        raise ValueError("env.reward.judge.model / api_key_env: set only with env.reward.judge.base_url")
    return LocalJudge(str(model_path or ""), words, settings["device"], settings["dtype"], settings["batch_size"])
