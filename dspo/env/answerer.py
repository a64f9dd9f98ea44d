"""A frozen answerer: a second model that answers a question from what a planner found (`env=planner`,
AI-SearchPlanner, Mei et al. 2025; `dspo.env.planner`).

Two answerers behind one protocol (`Answerer.answer(requests)`, all requests of a batch at once):
- `EngineAnswerer`: a model through the same engine classes as the policy (`dspo.engines`: HF or vLLM), with its own
  engine instance, loaded once per process (a cache keyed by the model and the engine's settings, so that the `ask`
  tool and the reward share one), its own seed, wrapped in a `FrozenEngine`: it generates and never takes weights. The
  trainer pushes weights into the engine it built from `rollout.engine` (`dspo.rollout.sides`), never into an
  environment's; `FrozenEngine.push_weights` raises, so a push that ever reached it would stop the run, not train it.
  Its parameters are not the module's, so no optimizer sees them (and `requires_grad` is off for a transformers one).
- `ScriptedAnswerer`: the unit tests' stand-in: the first gold answer a found passage states, else no answer.

What the engine answerer reads (the *transcript*): the planner's episode as the planner's own agent loop rendered it,
the first prompt for the question (`rollout.agent.tag_format`'s instruction, through the answerer's chat template)
and, for every call that ran, the planner's turn text and the tool's result, spliced as the agent splices them; the
planner's final turn (its own answer) is left out. The answerer then writes one turn, stopped at `</answer>` (or at a
call's closing tag: a call instead of an answer is no answer). In the toy the answerer is the shipped warm start, a
search agent, so the transcript is the format it was trained on, token for token at the joins (`prompt_ids`), with
the "one turn left" note where the planner saw it (`max_turns`) and each result cut where the planner's context cut
it (`max_obs_tokens`, by the answerer's tokenizer: the planner's wherever the two models share one, as the toy's and
Qwen2.5's sizes do); uncut, real passages gave the answerer text the planner never saw and could overrun a vLLM
answerer's `max_model_len`. AI-SearchPlanner's generator likewise answers "conditioned on the whole trajectory"
(queries, snippets, the planner's reasoning).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dspo.engines.base import SamplingConfig
from dspo.env.prompting import LAST_TURN_NOTE, ToolTurnTemplate, build_messages, render_prompt  # what the agent renders
from dspo.env.rewards import TurnRecord, extract_answer, observation_ids
from dspo.env.simulated import uniform
from dspo.metrics import normalize_answer

# where the answerer's turn stops: its answer, or a call it may not make (Search-R1 tags, Qwen2.5's tool call)
ANSWER_STOPS = ("</answer>", "</search>", "</ask>", "</tool_call>")
_ENGINES: dict[tuple, Any] = {}  # one engine per (model, engine settings) per process: the tool and reward share it


@dataclass
class AnswerRequest:
    """One question for the answerer: `turns` are the planner's turns so far (the answerers read their `evidence`),
    `answers` the gold answers (hidden from both models; only the scripted stand-in reads them), `key` seeds its
    sampling."""

    question: str
    turns: list[TurnRecord] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    key: str = ""


class Answerer(Protocol):
    def answer(self, requests: Sequence[AnswerRequest]) -> list[str | None]:
        """One answer per request (None: no answer), all requests in one batch."""
        ...


def evidence(turns: Sequence[TurnRecord]) -> list[TurnRecord]:
    """The turns whose call ran and returned a result without error: what the planner found (a failed or invalid
    call found nothing; the final turn, which makes no call, is the planner's own answer)."""
    return [t for t in turns if t.call is not None and t.result is not None and t.result.error is None]


# ------------------------------------------------------------------------------------------ the stand-in
class ScriptedAnswerer:
    """Answers with the first gold answer that a found passage (title and text) states, else None: a perfect reader,
    so its outcome is exactly "the planner found the answer". For unit tests and fast checks."""

    def answer(self, requests: Sequence[AnswerRequest]) -> list[str | None]:
        return [self._answer(request) for request in requests]

    @staticmethod
    def _answer(request: AnswerRequest) -> str | None:
        turns = evidence(request.turns)
        found = " ".join(normalize_answer(f"{p.title} {p.text}") for turn in turns for p in turn.result.passages)
        return next(
            (gold for gold in request.answers if normalize_answer(gold) and normalize_answer(gold) in found), None
        )


# ------------------------------------------------------------------------------------------ the frozen model
class FrozenEngine:
    """An engine that generates and never takes weights: the answerer's. `push_weights` raises (a push is the
    policy's, `rollout.engine`'s); a transformers model's parameters are set not to require gradients."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.version = engine, 0
        model = getattr(engine, "model", None)
        if callable(getattr(model, "requires_grad_", None)):
            model.requires_grad_(False)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list:
        return self.engine.generate(prompts, sampling)

    def push_weights(self, named_tensors: Any, version: int) -> None:
        raise RuntimeError(
            "env.reward.answerer: the answerer is frozen, its weights are never pushed; only rollout.engine (the "
            "policy's engine) takes the policy's weights (a bug in dspo if this is reached; please report it)"
        )


def frozen_engine(model_path: str, factory: Callable[..., Any] | None = None) -> FrozenEngine:
    """The process's answerer engine for `model_path` built by `factory` (a partial engine constructor, as
    `rollout.engine`; None: HFEngine on CPU), built on first use and shared by every caller after."""
    keywords = getattr(factory, "keywords", None) or {}
    function = getattr(factory, "func", factory)
    name = f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', repr(function))}"
    key = (model_path, name, repr(sorted(keywords.items())))
    if key not in _ENGINES:
        _ENGINES[key] = FrozenEngine((factory or _hf_engine)(model_path=model_path))
    return _ENGINES[key]


def _hf_engine(model_path: str) -> Any:
    from dspo.engines import HFEngine

    return HFEngine(model_path=model_path)


class EngineAnswerer:
    """A frozen model answering from the planner's transcript (the module). Args (config keys
    `env.reward.answerer.<key>`):
    model_path: the answerer model's directory (the toy: the shipped warm start, `data/toy_warmstart/model`).
    engine: a partial engine constructor taking `model_path` (`dspo.engines.HFEngine` / `VLLMEngine` with
        `_partial_: true`, as `rollout.engine`), or a built engine; None = HFEngine on CPU. Built on first use.
    tag_format: the transcript's format, the planner's (`rollout.agent.tag_format`).
    max_turns: the planner's `rollout.agent.max_turns`: the result of its turn max_turns - 2 carries the agent's
        "one turn left" note, as the planner saw it (seen on the toy: shown the note after its first search, where
        it never saw it in training, the warm start wrote a broken call instead of its answer); None: no note.
    max_obs_tokens: the planner's `rollout.agent.max_obs_tokens`: each result is cut to it as the planner's context
        cut it (`dspo.env.rewards.observation_ids`); None: not cut.
    instruction: the first user message with `{question}`; None = dspo's default for the tag format (the toy's).
    max_new_tokens: of the answer turn. temperature: 0 = greedy (default: the answerer is a fixed function of what
        was found). seed: of its sampling, its own (mixed with each batch's keys).
    """

    def __init__(
        self,
        model_path: str | None = None,
        engine: Any = None,
        tag_format: str = "searchr1",
        max_turns: int | None = None,
        max_obs_tokens: int | None = None,
        instruction: str | None = None,
        max_new_tokens: int = 96,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> None:
        if tag_format not in ("qwen", "searchr1"):
            raise ValueError(f"env.reward.answerer.tag_format={tag_format!r}: expected 'qwen' or 'searchr1'")
        if max_new_tokens < 1:
            raise ValueError(f"env.reward.answerer.max_new_tokens={max_new_tokens}: must be >= 1")
        if max_obs_tokens is not None and max_obs_tokens < 1:
            raise ValueError(f"env.reward.answerer.max_obs_tokens={max_obs_tokens}: must be >= 1 (or null: no cut)")
        built = engine is not None and callable(getattr(engine, "generate", None))
        if not built and model_path is None:
            raise ValueError("env.reward.answerer.model_path: set the answerer model's directory")
        self.model_path, self.factory = model_path, (None if built else engine)
        self.engine = FrozenEngine(engine) if built else None
        self.tag_format, self.instruction, self.max_turns = tag_format, instruction, max_turns
        self.max_obs_tokens = max_obs_tokens
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed

    def _engine(self) -> FrozenEngine:
        """Built on first use, not at config time: a run builds the policy's engine first (and the environment may be
        built in the engine process, where the answerer then lives)."""
        if self.engine is None:
            self.engine = frozen_engine(str(self.model_path), self.factory)
        return self.engine

    def prompt_ids(self, tokenizer: Any, request: AnswerRequest, wrap: Any = None) -> list[int]:
        """The answerer's prompt for `request` (the module's docstring), tokenized piece by piece as the agent builds
        its context (the first prompt, each turn's text, the tool turn's pre-tokenized wrappers around each result
        cut to `max_obs_tokens`), so that the joins and the results are the tokens the planner's context held, not
        what one tokenization of the whole text would merge them into."""

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        messages = build_messages(request.question, self.tag_format, None, self.instruction)
        ids = encode(render_prompt(tokenizer, messages, self.tag_format))
        wrap = wrap or ToolTurnTemplate.from_tokenizer(tokenizer, self.tag_format)
        found = {id(turn) for turn in evidence(request.turns)}
        for index, turn in enumerate(request.turns):  # the episode's turn numbers: where the planner saw the note
            if id(turn) in found:
                note = LAST_TURN_NOTE if self.max_turns is not None and index == self.max_turns - 2 else ""
                result = observation_ids(tokenizer, turn.result.text + note, self.max_obs_tokens)  # the note is cut too
                ids += encode(turn.text) + wrap.prefix_ids + result + wrap.suffix_ids
        return ids

    def answer(self, requests: Sequence[AnswerRequest]) -> list[str | None]:
        if not requests:
            return []
        engine = self._engine()
        tokenizer = engine.tokenizer
        wrap = ToolTurnTemplate.from_tokenizer(tokenizer, self.tag_format)  # once per batch
        prompts = [self.prompt_ids(tokenizer, r, wrap) for r in requests]
        batch_seed = int(uniform(self.seed, *(r.key for r in requests)) * 2**31)
        sampling = SamplingConfig(self.temperature, 1.0, self.max_new_tokens, list(ANSWER_STOPS), batch_seed)
        generations = engine.generate(prompts, sampling)
        if len(generations) != len(prompts):
            raise RuntimeError(f"answerer engine returned {len(generations)} generations for {len(prompts)} prompts")
        return [extract_answer(generation.text) for generation in generations]
