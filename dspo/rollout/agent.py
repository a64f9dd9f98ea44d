"""Multi-turn search agent: batched over every live trajectory of a round, turn by turn.

One turn: generate (stop at the call's closing tag, `</answer>` or EOS) → parse → one batched retriever call for all
valid queries of the turn → splice the observation in as the chat template renders a tool turn → repeat.

Token bookkeeping is exact by construction: model tokens are appended as the engine returned them (mask 1, engine
logprobs), environment tokens are pre-tokenized wrappers + the observation tokenized alone (mask 0, logprob 0.0).
Nothing already in the sequence is ever re-tokenized.

Departures from Search-R1's loop, on purpose: a malformed call gets an explanatory tool message instead of a canned
"invalid action" string; a call in the last allowed turn ends the episode (counted as invalid, `call_after_last_turn`);
when only one turn is left, the observation says so. The reward is computed from model-generated text only.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from dspo.rewards import extract_answer, subem_reward
from dspo.rollout import parsing
from dspo.rollout.engine import RolloutEngine, SamplingConfig
from dspo.rollout.prompts import ToolTurnTemplate, build_messages, render_prompt
from dspo.search.base import Retriever
from dspo.types import Generation, Passage, QAItem, RolloutGroup, Trajectory

ANSWER_CLOSE = "</answer>"
_CALL_TAGS = {"qwen": ("<tool_call>", "</tool_call>"), "searchr1": ("<search>", "</search>")}
LAST_TURN_NOTE = "\n(You have one turn left: give your final answer now.)"


@dataclass
class AgentConfig:
    """Limits of one episode. `max_total_tokens` caps prompt + response (the trainer's sequence length)."""

    max_turns: int = 4
    max_new_tokens_per_turn: int = 256
    max_obs_tokens: int = 256
    max_total_tokens: int = 2048
    topk: int = 3
    temperature: float = 1.0
    top_p: float = 1.0
    max_queries_per_call: int = 3
    max_query_chars: int = 512
    tag_format: str = "qwen"  # "qwen" | "searchr1"
    system_prompt: str | None = None
    max_answer_words: int | None = None

    def __post_init__(self) -> None:
        # The trainer's logprobs and the rollout-correction weights (dspo.algorithms.rollout_correction) compare the
        # engine's logprob with the full-vocabulary softmax at `temperature`; a nucleus renormalizes over a subset, so
        # every sampled token would look off-policy. top_k is no option at all (vLLM ignores the model's defaults).
        if self.top_p != 1.0:
            raise ValueError(
                f"rollout.agent.top_p={self.top_p}: only 1.0 is supported; top-p sampling makes the engine's logprobs "
                "incomparable with the trainer's full-vocabulary logprobs. Use temperature to control sampling."
            )


@dataclass
class _Episode:
    """Mutable state of one trajectory while it is being rolled out."""

    item: QAItem
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    model_text: list[str] = field(default_factory=list)
    turns: int = 0
    search_calls: int = 0
    invalid: Counter = field(default_factory=Counter)
    done: bool = False
    truncated: bool = False
    observation: str | None = None  # pending tool message for this turn
    queries: list[str] = field(default_factory=list)  # pending valid queries for this turn

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.response_ids.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


def format_passages(queries: list[str], results: list[list[Passage]]) -> str:
    """`Doc i (Title: t) text` lines; with several queries, one block per query headed by the query."""
    blocks = []
    for query, passages in zip(queries, results):
        lines = [f"Doc {i} (Title: {p.title}) {p.text}" for i, p in enumerate(passages, start=1)]
        body = "\n".join(lines) if lines else "No results."
        blocks.append(body if len(queries) == 1 else f'Results for "{query}":\n{body}')
    return "\n\n".join(blocks)


class SearchAgent:
    """Rolls out `group_size` trajectories per item against a retriever, all items at once."""

    def __init__(self, engine: RolloutEngine, tokenizer, retriever: Retriever, config: AgentConfig) -> None:
        if config.tag_format not in _CALL_TAGS:
            raise ValueError(f"AgentConfig.tag_format={config.tag_format!r}: expected one of {sorted(_CALL_TAGS)}")
        if config.max_turns < 1:
            raise ValueError(f"AgentConfig.max_turns={config.max_turns}: must be >= 1")
        self.engine, self.tokenizer, self.retriever, self.config = engine, tokenizer, retriever, config
        self.tool_turn = ToolTurnTemplate.from_tokenizer(tokenizer, config.tag_format)
        self.call_open, self.call_close = _CALL_TAGS[config.tag_format]
        self.last_stats: dict[str, float] = {}

    def prompt_ids(self, item: QAItem) -> list[int]:
        """Token ids of the first prompt for `item` (chat template + tool schema + generation prompt)."""
        messages = build_messages(item.question, self.config.tag_format, self.config.system_prompt)
        text = render_prompt(self.tokenizer, messages, self.config.tag_format)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def rollout(
        self,
        items: list[QAItem],
        group_size: int,
        policy_version: int,
        greedy: bool = False,
        seed: int | None = None,
    ) -> list[RolloutGroup]:
        """`group_size` trajectories per item; groups in `items` order, `prompt_index` = position in `items`."""
        start = time.perf_counter()
        timers = {"generation_s": 0.0, "search_s": 0.0, "generated_tokens": 0}
        reset = getattr(self.engine, "reset_episodes", None)
        if reset is not None:
            reset()
        episodes = []
        for item in items:
            prompt = self.prompt_ids(item)
            episodes.extend(_Episode(item=item, prompt_ids=list(prompt)) for _ in range(group_size))
        for turn in range(self.config.max_turns):
            live = [ep for ep in episodes if not ep.done]
            if not live:
                break
            self._generate_turn(live, turn, greedy, seed, timers)
            self._search(live, turn, timers)
            for ep in live:
                if ep.observation is not None:
                    self._append_observation(ep, turn)
        trajectories = [self._finish(ep, policy_version) for ep in episodes]
        self.last_stats = self._stats(trajectories, episodes, timers, time.perf_counter() - start)
        return [
            RolloutGroup(item=item, trajectories=trajectories[i * group_size : (i + 1) * group_size], prompt_index=i)
            for i, item in enumerate(items)
        ]

    def _generate_turn(self, live: list[_Episode], turn: int, greedy: bool, seed: int | None, timers: dict) -> None:
        cfg = self.config
        sampling = SamplingConfig(
            temperature=0.0 if greedy else cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens_per_turn,
            stop=[self.call_close, ANSWER_CLOSE],
            seed=None if seed is None else seed + 1_000_003 * turn,
        )
        tic = time.perf_counter()
        generations = self.engine.generate([ep.prompt_ids + ep.response_ids for ep in live], sampling)
        timers["generation_s"] += time.perf_counter() - tic
        if len(generations) != len(live):
            raise RuntimeError(f"{type(self.engine).__name__}.generate returned {len(generations)} for {len(live)}")
        for ep, gen in zip(live, generations):
            timers["generated_tokens"] += len(gen.token_ids)
            self._take_turn(ep, gen, turn)

    def _take_turn(self, ep: _Episode, gen: Generation, turn: int) -> None:
        """Append the model's tokens (cut to the total length cap) and decide what the environment does next."""
        cfg = self.config
        ep.observation, ep.queries = None, []
        room = cfg.max_total_tokens - ep.length
        ids, logprobs, text = gen.token_ids, gen.logprobs, gen.text
        if len(ids) > room:  # the tokens kept were sampled from the same prefix; only the tail is dropped
            ids, logprobs = ids[: max(room, 0)], logprobs[: max(room, 0)]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            ep.append(ids, 1, logprobs)
            ep.model_text.append(text)
            ep.turns += 1
            ep.done = ep.truncated = True
            return
        ep.append(ids, 1, logprobs)
        ep.model_text.append(text)
        ep.turns += 1
        if gen.finish_reason == "length":
            ep.done = ep.truncated = True
        elif gen.stop_reason == self.call_close or (gen.stop_reason is None and text.endswith(self.call_close)):
            self._handle_call(ep, text, turn)
        else:  # </answer> or EOS: the episode is over
            ep.done = True

    def _handle_call(self, ep: _Episode, text: str, turn: int) -> None:
        cfg = self.config
        if turn == cfg.max_turns - 1:
            ep.invalid[parsing.CALL_AFTER_LAST_TURN] += 1
            ep.done = ep.truncated = True
            return
        if cfg.tag_format == "qwen":
            call = parsing.parse_qwen_tool_call(text, cfg.max_queries_per_call, cfg.max_query_chars)
        else:
            call = parsing.parse_searchr1_query(text, cfg.max_query_chars)
        if call.ok:
            ep.queries = call.queries
            ep.search_calls += 1
        else:
            ep.invalid[call.error_kind] += 1
            ep.observation = call.error

    def _search(self, live: list[_Episode], turn: int, timers: dict) -> None:
        """One batched retriever call for every valid query of this turn; a failing retriever fails the round."""
        pending = [ep for ep in live if ep.queries]
        if not pending:
            return
        queries = [q for ep in pending for q in ep.queries]
        tic = time.perf_counter()
        try:
            results = self.retriever.search(queries, self.config.topk)
        except Exception as exc:
            raise RuntimeError(
                f"retriever {type(self.retriever).__name__} failed on turn {turn} for {len(queries)} queries "
                f"(first: {queries[0]!r}): {exc}. Check that the index / retrieval service is up; the rollout round "
                "is aborted rather than continued with empty results."
            ) from exc
        timers["search_s"] += time.perf_counter() - tic
        if len(results) != len(queries):
            raise RuntimeError(
                f"retriever {type(self.retriever).__name__} returned {len(results)} result lists for {len(queries)} "
                "queries; a Retriever must return one list per query"
            )
        offset = 0
        for ep in pending:
            n = len(ep.queries)
            ep.observation = format_passages(ep.queries, results[offset : offset + n])
            offset += n

    def _append_observation(self, ep: _Episode, turn: int) -> None:
        """Splice `prefix + observation (≤ max_obs_tokens) + suffix` in with mask 0, within the total length cap."""
        cfg = self.config
        text = ep.observation + (LAST_TURN_NOTE if turn == cfg.max_turns - 2 else "")
        obs_ids = self.tokenizer.encode(text, add_special_tokens=False)[: cfg.max_obs_tokens]
        wrapped = self.tool_turn.prefix_ids + obs_ids + self.tool_turn.suffix_ids
        if ep.length + len(wrapped) >= cfg.max_total_tokens:  # no room left for the model to answer
            ep.done = ep.truncated = True
            return
        ep.append(wrapped, 0)
        ep.observation = None

    def _finish(self, ep: _Episode, policy_version: int) -> Trajectory:
        if not ep.done:  # ran out of turns without an answer
            ep.truncated = True
        answer = extract_answer("".join(ep.model_text))
        return Trajectory(
            prompt_ids=ep.prompt_ids,
            response_ids=ep.response_ids,
            response_mask=ep.mask,
            engine_logprobs=ep.logprobs,
            reward=subem_reward(answer, ep.item.golden_answers, self.config.max_answer_words),
            answer=answer,
            question=ep.item.question,
            golden_answers=list(ep.item.golden_answers),
            response_text=self.tokenizer.decode(ep.response_ids, skip_special_tokens=False),
            num_turns=ep.turns,
            num_search_calls=ep.search_calls,
            num_invalid_calls=sum(ep.invalid.values()),
            truncated=ep.truncated,
            policy_version=policy_version,
        )

    def _stats(self, trajectories: list[Trajectory], episodes: list[_Episode], timers: dict, total: float) -> dict:
        n = max(len(trajectories), 1)
        invalid = sum((ep.invalid for ep in episodes), Counter())
        stats = {
            "generation_s": timers["generation_s"],
            "search_s": timers["search_s"],
            "other_s": max(total - timers["generation_s"] - timers["search_s"], 0.0),
            "generated_tokens": float(timers["generated_tokens"]),
            "tokens_per_s": timers["generated_tokens"] / max(timers["generation_s"], 1e-9),
            "search_calls_mean": sum(t.num_search_calls for t in trajectories) / n,
            "invalid_calls": float(sum(invalid.values())),
            "turns_mean": sum(t.num_turns for t in trajectories) / n,
            "response_len_mean": sum(len(t.response_ids) for t in trajectories) / n,
            "truncated_frac": sum(t.truncated for t in trajectories) / n,
            "reward_mean": sum(t.reward for t in trajectories) / n,
        }
        stats.update({f"invalid/{kind}": float(count) for kind, count in invalid.items()})
        return stats
