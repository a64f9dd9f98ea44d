"""The tool-calling agent: batched over every live trajectory of a round, turn by turn, in an `Environment`.

One turn: generate (stop at a call's closing tag, `</answer>` or EOS) → parse the call (`dspo.agent.parsing`) → one
batched `run` per tool for all valid calls of the turn → splice each observation in as the chat template renders a
tool turn → repeat. When every episode has ended, the environment's reward scores the whole batch of finished episodes.

What varies between agents are hooks, not branches: `first_prompt` (the first prompt's tokens), `stop_strings` (where
a turn's generation stops), `next_message` (what follows a turn that is neither a tool call nor the answer; None ends
the episode) and `observation_text` (the tool message spliced in). docs/extending.md subclasses it in a few lines.

Token bookkeeping is exact by construction: model tokens are appended as the engine returned them (mask 1, engine
logprobs), environment tokens are pre-tokenized wrappers + the observation tokenized alone (mask 0, logprob 0.0).
Nothing already in the sequence is ever re-tokenized.

Departures from Search-R1's loop, on purpose: a malformed call gets an explanatory tool message instead of a canned
"invalid action" string; a call in the last allowed turn ends the episode (counted as invalid, `call_after_last_turn`);
when only one turn is left, the observation says so. The reward is computed from model-generated text only. A tool
that fails on a call gives that trajectory an error message and is counted; above `env.max_tool_error_share` of a
batch's calls the rollout fails naming the tool (`dspo.env.tools`). With `overflow: compact`, a context that would
outgrow `max_total_tokens` has its oldest tool responses replaced by one-line notes, and the episode is trained as one
sample per context (`dspo.agent.compaction`).
"""

from __future__ import annotations

import time
from typing import Any

from dspo.agent import compaction, parsing
from dspo.agent.accounting import (  # noqa: F401  ToolFailureError, run_with_timeout: re-exported (old import paths)
    CALL_STAT_KINDS,
    ToolFailureError,
    check_tool_errors,
    grouped,
    rollout_stats,
    run_tool_batch,
    run_with_timeout,
)
from dspo.agent.config import AgentConfig
from dspo.agent.episode import Episode
from dspo.agent.partial import CarriedGroup, PartialRollout, StopFn
from dspo.agent.protocol import AgentRollout
from dspo.agent.trajectory import EpisodeCounts, EpisodeEnd, EpisodeTokens, build_trajectory
from dspo.engines.base import RolloutEngine, SamplingConfig
from dspo.env.environment import Environment
from dspo.env.prompting import (  # noqa: F401  LAST_TURN_NOTE: re-exported (old import path)
    LAST_TURN_NOTE,
    ToolTurnTemplate,
    build_messages,
    render_prompt,
)
from dspo.env.rewards import EpisodeRecord, TurnRecord, observation_ids
from dspo.env.tools import CallContext, carried
from dspo.types import Generation, QAItem, RolloutGroup, Segment, Trajectory

ANSWER_CLOSE = "</answer>"
TAG_FORMATS = ("qwen", "searchr1")


class ToolCallingAgent:
    """Rolls out `group_size` trajectories per item in `env` (an `Environment`; a bare `Retriever` stands for the
    default one: its search tool with default limits and the subEM reward), all items at once.

    Args:
        engine: the `RolloutEngine` that generates.
        tokenizer: the policy's tokenizer (None: the engine's).
        env: the environment: tools + reward.
        config: the episode's limits; or give them as keywords (`rollout.agent`'s settings: max_turns, ...).
    """

    stat_kinds = {**CALL_STAT_KINDS, **compaction.STAT_KINDS}  # its rollout statistics' kinds (dspo.agent.stats)

    def __init__(
        self, engine: RolloutEngine, tokenizer: Any, env: Any, config: AgentConfig | None = None, **limits: Any
    ) -> None:
        if config is None:
            config = AgentConfig.from_settings(limits)
        elif limits:
            raise TypeError(f"{type(self).__name__}: give the limits as config or as keywords, not both ({limits})")
        if config.tag_format not in TAG_FORMATS:
            raise ValueError(f"rollout.agent.tag_format={config.tag_format!r}: expected one of {sorted(TAG_FORMATS)}")
        if config.max_turns < 1:
            raise ValueError(f"rollout.agent.max_turns={config.max_turns}: must be >= 1")
        if not isinstance(env, Environment):
            env = Environment.search(env)
        if config.overflow == "compact" and env.credit != "trajectory":
            raise ValueError(
                f"rollout.agent.overflow=compact with env.reward.credit={env.credit}: a compacted episode is trained "
                "as several samples, and per-turn credit covers one token sequence; use env.reward.credit=trajectory "
                "or rollout.agent.overflow=end"
            )
        tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.engine, self.tokenizer, self.env, self.config = engine, tokenizer, env, config
        self.tools = env.tools
        self.tool_turn = ToolTurnTemplate.from_tokenizer(tokenizer, config.tag_format)
        self.call_closes = parsing.call_closes(self.tools, config.tag_format)

    @property
    def retriever(self):
        """The default search tool's retriever (rollout statistics count its retries), None without one."""
        return getattr(self.tools.get("search"), "retriever", None)

    # ------------------------------------------------------------------------------------------ hooks
    def first_prompt(self, item: QAItem) -> list[int]:
        """Token ids of the first prompt for `item` (chat template + tool schemas + generation prompt)."""
        cfg = self.config
        messages = build_messages(item.question, cfg.tag_format, cfg.system_prompt, self.env.instruction)
        schemas = [tool.schema() for tool in self.tools.values()]
        return self.tokenizer.encode(
            render_prompt(self.tokenizer, messages, cfg.tag_format, schemas), add_special_tokens=False
        )

    def stop_strings(self, turn: int) -> list[str]:
        """Where generation stops in `turn`: a call's closing tag or the answer's."""
        return [*self.call_closes, ANSWER_CLOSE]

    def next_message(self, text: str, turn: int) -> str | None:
        """What follows a turn (`text`) that stopped on neither a tool call nor a length cap: None ends the episode
        (the answer, or EOS); a message continues it, spliced in as a tool turn (mask 0)."""
        return None

    def observation_text(self, observation: str, turn: int) -> str:
        """The tool message spliced in after `turn` (a note when one turn is left)."""
        return observation + (LAST_TURN_NOTE if turn == self.config.max_turns - 2 else "")

    def compaction_note(self, turn: TurnRecord) -> str:
        """The one line that replaces this turn's tool response when the context is compacted (`overflow: compact`)."""
        tool = self.tools.get(turn.call[0]) if turn.call is not None else None
        return compaction.compaction_note(turn, tool)

    def rollout(
        self,
        items: list[QAItem],
        group_size: int,
        policy_version: int,
        greedy: bool = False,
        seed: int | None = None,
    ) -> AgentRollout:
        """`group_size` trajectories per item; groups in `items` order, `prompt_index` = position in `items`; the
        call's statistics."""
        start = time.perf_counter()
        timers = {"generation_s": 0.0, "tool_s": 0.0, "generated_tokens": 0}
        self._reset_engine()
        episodes = [ep for item in items for ep in self._new_episodes(item, group_size, policy_version)]
        self._run_turns(episodes, greedy, seed, timers)
        check_tool_errors(self.env, episodes)
        trajectories = self._finish(episodes)
        stats = self._stats(trajectories, episodes, timers, start)
        return AgentRollout(grouped(items, trajectories, group_size), stats)

    def rollout_partial(
        self,
        carried: list[CarriedGroup],
        items: list[tuple[int, QAItem]],
        group_size: int,
        policy_version: int,
        seed: int | None,
        stop: StopFn,
    ) -> PartialRollout:
        """A resumable call (`rollout.partial_rollouts`, `dspo.agent.partial`): the `carried` groups continue, on
        the weights of `policy_version`, beside `group_size` new episodes per (prompt index, item); after each turn
        the groups that finished are scored and passed to `stop`, which may end the call there."""
        start = time.perf_counter()
        timers = {"generation_s": 0.0, "tool_s": 0.0, "generated_tokens": 0}
        if not carried:
            self._reset_engine()
        for group in carried:
            for ep in group.episodes:
                ep.version = policy_version
        fresh = [
            CarriedGroup(item, index, self._new_episodes(item, group_size, policy_version), policy_version)
            for index, item in items
        ]
        running, ended = [*carried, *fresh], []
        finished: list[RolloutGroup] = []

        def after_turn() -> bool:
            nonlocal running
            now = [group for group in running if group.done]
            if not now:
                return False
            running = [group for group in running if not group.done]
            ended.extend(now)
            scored = self._finish([ep for group in now for ep in group.episodes])
            done = [
                RolloutGroup(group.item, scored[i * group_size : (i + 1) * group_size], group.prompt_index)
                for i, group in enumerate(now)
            ]
            finished.extend(done)
            return stop(done)

        self._run_turns([ep for group in running for ep in group.episodes], False, seed, timers, after_turn)
        episodes = [ep for group in ended for ep in group.episodes]
        check_tool_errors(self.env, episodes)
        trajectories = [t for group in finished for t in group.trajectories]
        return PartialRollout(finished, running, self._stats(trajectories, episodes, timers, start))

    def _reset_engine(self) -> None:
        reset = getattr(self.engine, "reset_episodes", None)
        if reset is not None:
            reset()

    def _new_episodes(self, item: QAItem, group_size: int, policy_version: int) -> list[Episode]:
        prompt = self.first_prompt(item)
        return [Episode(item=item, prompt_ids=list(prompt), version=policy_version) for _ in range(group_size)]

    def _run_turns(self, episodes: list[Episode], greedy: bool, seed: int | None, timers: dict, after_turn=None):
        """Turn by turn until every episode ended (or `after_turn()` says stop); each episode at its own turn (a
        carried one is further along)."""
        for step in range(self.config.max_turns):
            live = [ep for ep in episodes if not ep.done]
            if not live:
                break
            self._generate_turn(live, step, greedy, seed, timers)
            self._run_tools(live, episodes, timers)
            for ep in live:
                if ep.observation is not None:
                    self._append_observation(ep, ep.turn - 1)
                if not ep.done and ep.turn >= self.config.max_turns:
                    ep.end("max_turns")
            if after_turn is not None and after_turn():
                return

    def _stats(self, trajectories: list[Trajectory], episodes: list[Episode], timers: dict, start: float) -> dict:
        stats = rollout_stats(self.tools, trajectories, episodes, timers, time.perf_counter() - start)
        if self.config.overflow == "compact":
            stats["compactions"] = float(sum(ep.compactions for ep in episodes))
            stats["samples_per_episode"] = sum(1 + len(t.segments) for t in trajectories) / max(len(trajectories), 1)
        return stats

    def _generate_turn(self, live: list[Episode], step: int, greedy: bool, seed: int | None, timers: dict) -> None:
        """One model turn for every live episode: one engine call per set of stop strings (one, by default)."""
        cfg = self.config
        batches: dict[tuple[str, ...], list[Episode]] = {}
        for ep in live:
            batches.setdefault(tuple(self.stop_strings(ep.turn)), []).append(ep)
        for stop, batch in batches.items():
            sampling = SamplingConfig(
                temperature=0.0 if greedy else cfg.temperature,
                top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens_per_turn,
                stop=list(stop),
                seed=None if seed is None else seed + 1_000_003 * step,
            )
            tic = time.perf_counter()
            generations = self.engine.generate([ep.prompt_ids + ep.response_ids for ep in batch], sampling)
            timers["generation_s"] += time.perf_counter() - tic
            if len(generations) != len(batch):
                raise RuntimeError(
                    f"{type(self.engine).__name__}.generate returned {len(generations)} for {len(batch)}"
                )
            for ep, gen in zip(batch, generations):
                timers["generated_tokens"] += len(gen.token_ids)
                self._take_turn(ep, gen, ep.turn)

    def _take_turn(self, ep: Episode, gen: Generation, turn: int) -> None:
        """Append the model's tokens (cut to the total length cap) and decide what the environment does next."""
        cfg = self.config
        ep.observation, ep.pending = None, None
        room = cfg.max_total_tokens - ep.length
        ids, logprobs, text = gen.token_ids, gen.logprobs, gen.text
        start = len(ep.response_ids)
        if len(ids) > room:  # the tokens kept were sampled from the same prefix; only the tail is dropped
            ids, logprobs = ids[: max(room, 0)], logprobs[: max(room, 0)]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            self._record_turn(ep, ids, logprobs, text, start)
            ep.end("max_tokens")
            return
        self._record_turn(ep, ids, logprobs, text, start)
        close = self._closing_tag(gen, text)
        if gen.finish_reason == "length":
            ep.end("max_tokens")
        elif close is not None:
            self._handle_call(ep, text, turn, close)
        else:  # </answer> or EOS: the episode is over, unless the agent has more to say
            ep.observation = self.next_message(text, turn)
            if ep.observation is None:
                ep.end("finished")

    def _record_turn(self, ep: Episode, ids: list[int], logprobs: list[float], text: str, start: int) -> None:
        ep.append(ids, 1, logprobs)
        ep.model_text.append(text)
        ep.turns.append(TurnRecord(text=text))
        ep.turn_spans.append((start, len(ep.response_ids)))

    def _closing_tag(self, gen: Generation, text: str) -> str | None:
        """The call tag that ended the turn (engines report the stop string; a stop token leaves only the text)."""
        if gen.stop_reason in self.call_closes:
            return gen.stop_reason
        if gen.stop_reason is None:
            return next((close for close in self.call_closes if text.endswith(close)), None)
        return None

    def _handle_call(self, ep: Episode, text: str, turn: int, close: str) -> None:
        cfg, record = self.config, ep.turns[-1]
        if turn == cfg.max_turns - 1:
            tool = close[2:-1] if cfg.tag_format == "searchr1" else parsing.NO_TOOL
            ep.invalid[(tool, parsing.CALL_AFTER_LAST_TURN)] += 1
            record.invalid = parsing.CALL_AFTER_LAST_TURN
            ep.end("max_turns")
            return
        call = parsing.parse_call(text, self.tools, cfg.tag_format, close)
        if call.ok:
            ep.pending = call
            ep.tool_calls[call.tool] += 1
            record.call = (call.tool, call.arguments)
        else:
            ep.invalid[(call.tool, call.error_kind)] += 1
            record.invalid = call.error_kind
            ep.observation = call.error

    def _run_tools(self, live: list[Episode], episodes: list[Episode], timers: dict) -> None:
        """One batched `run` per tool for every valid call of this turn."""
        positions = {id(ep): i for i, ep in enumerate(episodes)}
        for name, tool in self.tools.items():
            pending = [ep for ep in live if ep.pending is not None and ep.pending.tool == name]
            if not pending:
                continue
            contexts = [CallContext(ep.item, ep.turn - 1, positions[id(ep)], list(ep.turns)) for ep in pending]
            tic = time.perf_counter()
            results = run_tool_batch(tool, [ep.pending.arguments for ep in pending], contexts)
            timers["tool_s"] += time.perf_counter() - tic
            for ep, result in zip(pending, results):
                ep.observation, ep.turns[-1].result = result.text, result
                if result.error is not None:
                    ep.tool_errors[name] += 1

    def _append_observation(self, ep: Episode, turn: int) -> None:
        """Splice `prefix + observation (≤ max_obs_tokens) + suffix` in with mask 0, within the total length cap (with
        `overflow: compact`, after making room for it and a whole next turn)."""
        cfg = self.config
        # one cut for the loop and every reader of the episode (env=planner's answerer): `observation_ids`
        obs_ids = observation_ids(self.tokenizer, self.observation_text(ep.observation, turn), cfg.max_obs_tokens)
        wrapped = self.tool_turn.prefix_ids + obs_ids + self.tool_turn.suffix_ids
        if cfg.overflow == "compact":
            self._compact(ep, ep.length + len(wrapped) + cfg.max_new_tokens_per_turn - cfg.max_total_tokens, wrapped)
        if ep.length + len(wrapped) >= cfg.max_total_tokens:  # no room left for the model to answer
            ep.end("max_tokens")
            return
        start = len(ep.response_ids) + len(self.tool_turn.prefix_ids)
        ep.append(wrapped, 0)
        ep.observation = None
        if cfg.overflow == "compact":
            ep.spliced.append(compaction.Spliced(start, start + len(obs_ids), self.compaction_note(ep.turns[-1])))

    def _compact(self, ep: Episode, excess: int, incoming: list[int]) -> None:
        """Free `excess` tokens by replacing the oldest tool responses with their notes, closing the context so far as
        a segment (its masks as sampled); nothing happens when even that would not let `incoming` in."""
        if excess <= 0:
            return
        note_ids: dict[int, list[int]] = {}

        def ids_of(obs: compaction.Spliced) -> list[int]:
            if id(obs) not in note_ids:
                note_ids[id(obs)] = self.tokenizer.encode(carried(obs.note), add_special_tokens=False)
            return note_ids[id(obs)]

        chosen = compaction.choose(ep.spliced, ids_of, excess)
        freed = sum((obs.end - obs.start) - len(ids_of(obs)) for obs in chosen)
        if not chosen or ep.length - freed + len(incoming) >= self.config.max_total_tokens:
            return
        rewritten = compaction.rewrite(ep.response_ids, [(obs.start, obs.end, ids_of(obs)) for obs in chosen])
        if any(ep.mask):
            ep.segments.append(Segment(list(ep.prompt_ids), ep.response_ids, ep.mask, ep.logprobs))
        moved = rewritten.moved
        ep.response_ids, ep.mask, ep.logprobs = rewritten.response_ids, rewritten.response_mask, rewritten.logprobs
        ep.versions = [ep.version] * len(ep.response_ids)  # one version: compaction is refused with partial rollouts
        ep.turn_spans = [(moved(start), moved(end)) for start, end in ep.turn_spans]
        replaced = {id(obs) for obs in chosen}
        for obs in ep.spliced:
            start = moved(obs.start)
            end = start + len(ids_of(obs)) if id(obs) in replaced else moved(obs.end)
            obs.start, obs.end, obs.compacted = start, end, obs.compacted or id(obs) in replaced
        ep.compactions += 1

    def _finish(self, episodes: list[Episode]) -> list[Trajectory]:
        """Score every finished episode in one batch (the environment's reward) and build the trajectories."""
        reward = self.env.reward
        records = []
        for ep in episodes:
            if not ep.done:  # ran out of turns without an answer
                ep.end("max_turns")
            answer = reward.extract_answer("".join(ep.model_text))
            records.append(EpisodeRecord(item=ep.item, turns=ep.turns, answer=answer, truncated=ep.truncated))
        results = reward.score(records)
        if len(results) != len(records):
            raise RuntimeError(f"{type(reward).__name__}.score returned {len(results)} results for {len(records)}")
        return [self._trajectory(ep, record, result) for ep, record, result in zip(episodes, records, results)]

    def _trajectory(self, ep: Episode, record: EpisodeRecord, result) -> Trajectory:
        if result.step_rewards and len(result.step_rewards) != len(ep.turns):
            raise RuntimeError(
                f"reward {type(self.env.reward).__name__}: {len(result.step_rewards)} step rewards for "
                f"{len(ep.turns)} turns"
            )
        tokens = EpisodeTokens(
            ep.prompt_ids,
            ep.response_ids,
            ep.mask,
            ep.logprobs,
            ep.turn_spans,
            ep.segments,
            token_versions=list(ep.versions) if ep.spans_versions() else [],
        )
        counts = EpisodeCounts(len(ep.turns), ep.tool_calls, ep.invalid)
        version = min(ep.versions, default=ep.version)  # the oldest: what staleness is measured from
        end = EpisodeEnd(ep.stop_reason, ep.truncated, record.answer)
        return build_trajectory(ep.item, tokens, result, counts, end, version, self.tokenizer)
