"""A batch of chat requests -> one engine call per distinct sampling setting -> recorded calls and OpenAI answers.

Runs on the rollout's thread. Each request's prompt continues its episode's tokens when its messages extend the last
exchange (`dspo.agent.endpoint.chat`), else it is rendered from scratch; budgets are checked before anything is
generated, and the turn budget is counted as a request is admitted (two requests of one episode in one batch cannot
both take its last turn); any error while preparing one request answers that request (a `RequestError`, else a 400
naming the error), never the batch. The request's sampling settings are replaced by training's (`SamplingPolicy`),
each replacement counted and warned about once per run. The request's own `stop` strings end a completion without
appearing in its content (OpenAI's meaning), while a call's closing tag and `</answer>` end it and stay (the built-in
loop's stops; `formats`).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from dspo.agent.config import AgentConfig
from dspo.agent.endpoint import chat
from dspo.agent.endpoint.episodes import CallRecord, Episode, RequestError
from dspo.agent.endpoint.requests import ChatRequest, Choice, SamplingPolicy, completion_body
from dspo.agent.endpoint.scheduler import Work
from dspo.engines.base import SamplingConfig
from dspo.env.rewards import TurnRecord
from dspo.types import Generation

Warn = Callable[[str, Any, Any], None]  # (parameter, the value sent, the value used)


class Generator:
    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        config: AgentConfig,
        chat_format: Any,
        greedy: bool,
        seed: int | None,
        warn: Warn | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.config, self.format = engine, tokenizer, config, chat_format
        self.policy = SamplingPolicy(
            temperature=0.0 if greedy else config.temperature,
            top_p=config.top_p,
            max_new_tokens=config.max_new_tokens_per_turn,
        )
        self.seed, self.calls = seed, 0
        self.warn = warn
        self.overridden: Counter = Counter()  # parameter -> requests whose value was replaced
        self.eos_text = tokenizer.eos_token if tokenizer.eos_token_id is not None else None

    def run(self, batch: list[Work], episodes: list[Episode]) -> int:
        """Answer every request of `batch`; returns the number of tokens generated."""
        prepared = []
        for work in batch:
            episode, request = episodes[work.episode], work.payload
            try:
                prompt, sampling = self._prepare(episode, request)
            except RequestError as error:
                work.answer(error)
                continue
            except Exception as error:  # noqa: BLE001  one request's failure is its own, not the batch's
                message = f"the request could not be rendered ({type(error).__name__}: {str(error)[:300]})"
                work.answer(RequestError(400, message + "; check its messages and tools"))
                continue
            prepared.append((work, episode, request, prompt, sampling))
        by_setting: dict[tuple, list[int]] = {}
        for k, (_, _, _, _, sampling) in enumerate(prepared):
            by_setting.setdefault((sampling.max_new_tokens, tuple(sampling.stop)), []).append(k)
        generated, replies = 0, []
        for (max_new, stops), members in by_setting.items():
            prompts = [prepared[k][3] for k in members for _ in range(prepared[k][2].n)]
            sampling = SamplingConfig(
                temperature=self.policy.temperature,
                top_p=self.policy.top_p,
                max_new_tokens=max_new,
                stop=list(stops),
                seed=None if self.seed is None else self.seed + 1_000_003 * self.calls,
            )
            self.calls += 1
            outputs = iter(self.engine.generate(prompts, sampling))
            for k in members:
                work, episode, request, prompt, _ = prepared[k]
                generations = [next(outputs) for _ in range(request.n)]
                generated += sum(len(g.token_ids) for g in generations)
                replies.append((work, self._answer(episode, request, prompt, generations)))
        for work, reply in replies:  # answered together: an episode woken early would compete for the GIL
            work.answer(reply)
        return generated

    def _prepare(self, episode: Episode, request: ChatRequest) -> tuple[list[int], SamplingConfig]:
        cfg = self.config
        for name, sent, used in self.policy.overrides(request):
            self.overridden[name] += 1
            if self.warn is not None:
                self.warn(name, sent, used)
        if episode.admitted >= cfg.max_turns:
            episode.truncated, episode.stop_reason = True, "max_turns"
            raise RequestError(400, f"turn budget spent: rollout.agent.max_turns={cfg.max_turns} calls per episode")
        prompt = self._prompt(episode, request)
        room = cfg.max_total_tokens - len(prompt)
        if room < 1:
            episode.truncated, episode.stop_reason = True, "max_tokens"
            raise RequestError(
                400,
                f"context budget spent: the prompt has {len(prompt)} tokens and rollout.agent.max_total_tokens="
                f"{cfg.max_total_tokens}",
            )
        max_new = min(cfg.max_new_tokens_per_turn, room, request.max_tokens or room)
        stops = list(dict.fromkeys([*request.stop, *self.format.stops(request.tool_names is not None)]))
        episode.admitted += 1  # last: a refused request takes no turn
        return prompt, SamplingConfig(max_new_tokens=max_new, stop=stops)

    def _prompt(self, episode: Episode, request: ChatRequest) -> list[int]:
        """Token ids of the request's prompt: the episode's tokens + what the template adds, when the messages extend
        the last exchange; else the whole conversation rendered."""
        if episode.messages is not None and chat.extends(request.messages, episode.messages, episode.returned):
            ids = self.format.following_ids(request.messages, request.tools, len(episode.messages))
            if ids is not None:
                completion = list(episode.calls[-1].completions[0].token_ids)
                return episode.last_ids + ids[_token_overlap(completion, ids) :]
        return self.format.prompt_ids(request.messages, request.tools)

    def _answer(self, episode: Episode, request: ChatRequest, prompt: list[int], generations: list[Generation]) -> dict:
        kept, choices, malformed = self.format.stops(True), [], []
        for generation in generations:
            text = generation.text
            if generation.stop_reason in request.stop and generation.stop_reason not in kept:
                text = text[: text.rfind(generation.stop_reason)]
            message, has_calls, invalid = self.format.message(text, self.eos_text, request.tool_names)
            for call in message.get("tool_calls") or []:  # unique, as OpenAI's: frameworks key results by call id
                call["id"] = f"call_{uuid.uuid4().hex[:24]}"
            finish = "length" if generation.finish_reason == "length" else "tool_calls" if has_calls else "stop"
            choices.append(Choice(message, finish, generation))
            malformed.append(invalid)
        episode.invalid.update(malformed[0])  # the choice the episode goes on with is the one counted
        episode.calls.append(CallRecord(list(prompt), generations))
        episode.turns.append(TurnRecord(text=generations[0].text, invalid=malformed[0][0][1] if malformed[0] else None))
        episode.messages, episode.returned = list(request.messages), choices[0].message
        return completion_body(choices, len(prompt), request.logprobs, self.tokenizer)


MAX_OVERLAP = 8  # an end-of-turn marker is a token or a few; a longer search would be quadratic in the turn's length


def _token_overlap(completion: list[int], following: list[int]) -> int:
    """How many leading ids of `following` the completion already ends with (its end-of-turn token)."""
    for size in range(min(len(completion), len(following), MAX_OVERLAP), 0, -1):
        if completion[-size:] == following[:size]:
            return size
    return 0
