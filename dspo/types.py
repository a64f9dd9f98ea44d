"""Typed records that flow between the stages of one training round.

rollout (agent loop) -> `Trajectory` -> grouped per prompt -> `RolloutGroup` -> filtered + batched -> `PolicyBatch`.

Token-level lists are plain Python lists (variable length, produced one turn at a time); tensors appear only in
`PolicyBatch`, which is padded and ready for the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensors only in PolicyBatch and two RolloutGroup properties: the retrieval side runs without torch
    import torch


@dataclass
class Passage:
    """One retrieved passage. `score` is the retriever's score (BM25), higher is better."""

    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        """FlashRAG / Search-R1 wiki format: quoted title line, then the text."""
        return f'"{self.title}"\n{self.text}'


@dataclass
class QAItem:
    """One question with its gold answers (FlashRAG schema). `benchmark` names the data source (e.g. `nq`)."""

    id: str
    question: str
    golden_answers: list[str]
    benchmark: str = "default"
    metadata: dict = field(default_factory=dict)


@dataclass
class Generation:
    """What an engine returns for one prompt: new token ids exactly as sampled, and their logprobs."""

    token_ids: list[int]  # [T] includes the stop token / EOS when generation stopped on one
    logprobs: list[float]  # [T] sampling-distribution logprob of each token (temperature applied by the engine)
    finish_reason: str  # "stop" (stop string or EOS) | "length"
    stop_reason: str | None = None  # the stop string that ended generation, if any
    text: str = ""  # decoded text of `token_ids` (for parsing only; ids are the source of truth)


# Why an episode ended (`Trajectory.stop_reason`): the model ended it (an answer, or EOS), it ran out of turns or of
# tokens (context budget or engine length), or a failure outside the policy ended it (the agent behind the endpoint
# raised or timed out).
STOP_REASONS = ("finished", "max_turns", "max_tokens", "agent_error", "agent_timeout")
FAILED_STOP_REASONS = frozenset({"agent_error", "agent_timeout"})


@dataclass
class Segment:
    """An earlier context of an episode that its final context does not extend (the agent or the template rewrote
    history, or the context was compacted): trained as a sample of its own with the episode's advantage, never
    re-tokenized. Same conventions as `Trajectory`'s token lists."""

    prompt_ids: list[int]  # [P]
    response_ids: list[int]  # [R]
    response_mask: list[int]  # [R] 1 = model-generated
    engine_logprobs: list[float]  # [R] engine logprob on mask-1 tokens, 0.0 elsewhere

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.engine_logprobs) != n:
            raise ValueError(
                f"Segment lengths disagree: response_ids={n}, response_mask={len(self.response_mask)}, "
                f"engine_logprobs={len(self.engine_logprobs)}"
            )


@dataclass
class Trajectory:
    """One multi-turn episode. `response_*` covers everything after the prompt: model turns and tool turns.

    response_mask is 1 on model-generated tokens (including their stop token), 0 on every token the environment
    inserted (tool responses, template wrappers, the next assistant header).
    """

    prompt_ids: list[int]  # [P]
    response_ids: list[int]  # [R]
    response_mask: list[int]  # [R] 1 = trained (model-generated), 0 = environment
    engine_logprobs: list[float]  # [R] engine logprob on mask-1 tokens, 0.0 elsewhere
    reward: float = 0.0  # what the group advantage uses: outcome + shaping + Σ step_rewards (dspo.env.rewards)
    outcome: float | None = None  # the 0/1 correctness the dynamic filter tests (None: the reward itself)
    step_rewards: list[float | None] = field(default_factory=list)  # [turns] per-turn rewards (None: none)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [turns] (start, end) response positions
    reward_components: dict[str, float] = field(default_factory=dict)  # logged as reward/<name>
    answer: str | None = None
    question: str = ""
    golden_answers: list[str] = field(default_factory=list)
    response_text: str = ""
    num_turns: int = 0
    num_tool_calls: int = 0  # valid tool calls (every tool; per tool in tool_calls)
    num_invalid_calls: int = 0
    tool_calls: dict[str, int] = field(default_factory=dict)
    truncated: bool = False  # hit the total length cap or max_turns without an answer
    # why the episode ended (`STOP_REASONS`); "" when the agent did not say. A failed one (`FAILED_STOP_REASONS`) is a
    # masked stub whose outcome says nothing about the policy: its group is dropped before the filter
    stop_reason: str = ""
    policy_version: int = 0  # completed training rounds of the weights that generated its first (oldest) tokens
    segments: list[Segment] = field(default_factory=list)  # earlier contexts, trained with this one's advantage
    # [R] the policy version of each response token, when more than one generated them (rollout.partial_rollouts:
    # the episode was carried into a later round); empty: every token is policy_version's
    token_versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.outcome is None:
            self.outcome = self.reward
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.engine_logprobs) != n:
            raise ValueError(
                f"Trajectory lengths disagree: response_ids={n}, response_mask={len(self.response_mask)}, "
                f"engine_logprobs={len(self.engine_logprobs)}"
            )
        if self.token_versions and len(self.token_versions) != n:
            raise ValueError(
                f"Trajectory lengths disagree: response_ids={n}, token_versions={len(self.token_versions)}"
            )

    @property
    def failed(self) -> bool:
        """The episode ended by a failure outside the policy (the agent raised, or timed out): no outcome."""
        return self.stop_reason in FAILED_STOP_REASONS

    def trained_token_versions(self) -> list[int]:
        """The policy version of each trained (mask-1) token, segments included."""
        own = [
            version
            for version, trained in zip(
                self.token_versions or [self.policy_version] * len(self.response_ids), self.response_mask
            )
            if trained
        ]
        return own + [self.policy_version for s in self.segments for trained in s.response_mask if trained]

    @property
    def num_generated_tokens(self) -> int:
        return int(sum(self.response_mask)) + sum(int(sum(s.response_mask)) for s in self.segments)

    def samples(self) -> list[Trajectory]:
        """The training samples of this episode: itself (without segments), then one per segment, each with this
        trajectory's reward, outcome and policy version (so each gets its advantage)."""
        if not self.segments:
            return [self]
        own = replace(self, segments=[])
        return [own] + [
            replace(
                own,
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                response_mask=s.response_mask,
                engine_logprobs=s.engine_logprobs,
                step_rewards=[],
                turn_spans=[],
                token_versions=[],  # compaction is not combined with partial rollouts (RolloutCallback refuses it)
            )
            for s in self.segments
        ]


# The role of a group in a round whose agent plays one role: what every un-roled run's groups are. An agent that plays
# several roles in one call (`dspo.agent.roles`: a proposer and a solver, a planner) tags each group with its own, and
# the round logs `rollout/<role>/<stat>` beside the un-roled figures; the trainer treats every group alike.
DEFAULT_ROLE = "solver"


@dataclass
class RolloutGroup:
    """The G trajectories sampled for one prompt (Algorithm 1's group)."""

    item: QAItem
    trajectories: list[Trajectory]  # [G]
    prompt_index: int = -1  # position of the prompt in the sampler's order (for resume/debugging)
    role: str = DEFAULT_ROLE  # who played it (`dspo.agent.roles`); statistics only: filter and loss treat all alike

    @property
    def rewards(self) -> torch.Tensor:
        """What the advantages use (outcome + shaping + step rewards). [G]"""
        import torch

        return torch.tensor([t.reward for t in self.trajectories], dtype=torch.float32)

    @property
    def outcomes(self) -> torch.Tensor:
        """The 0/1 outcomes the dynamic filter tests. [G]"""
        import torch

        return torch.tensor([t.outcome for t in self.trajectories], dtype=torch.float32)

    @property
    def failed(self) -> bool:
        """Some episode failed outside the policy (`Trajectory.failed`): the group's outcomes are not all measured."""
        return any(t.failed for t in self.trajectories)

    @property
    def policy_version(self) -> int:
        versions = {t.policy_version for t in self.trajectories}
        if len(versions) != 1:
            raise ValueError(f"group mixes policy versions {sorted(versions)}")
        return versions.pop()


@dataclass
class PolicyBatch:
    """Padded tensors for one (micro-)batch of N = sequences. Position t holds token t; `loss_mask[:, t]` = 1 means
    token t is trained, so its logprob is predicted from position t-1 (the first token is never trained).
    """

    input_ids: torch.Tensor  # [N, L] long, right-padded with pad_token_id
    attention_mask: torch.Tensor  # [N, L] long, 1 on real tokens
    loss_mask: torch.Tensor  # [N, L] float, 1 on model-generated response tokens
    advantages: torch.Tensor  # [N] float
    old_logprobs: torch.Tensor | None = None  # [N, L] float, logπ_old at loss_mask positions (0 elsewhere)
    ref_logprobs: torch.Tensor | None = None  # [N, L] float, logπ_ref at loss_mask positions (0 elsewhere)
    engine_logprobs: torch.Tensor | None = None  # [N, L] float, engine logprob at loss_mask positions (0 elsewhere)
    rewards: torch.Tensor | None = None  # [N] float
    policy_version: int = 0
    # an episode trained as several samples (segments) has one row per sample, all in one micro-batch:
    episode_ids: torch.Tensor | None = None  # [N] long, the episode of each row (unique within the round)
    # [N] float, |y_row| / |y_episode| in trained tokens (1 for an unsplit episode): a sequence-mean objective scales
    # each row's term by it, so that an episode weighs the same however many samples it became
    sample_scale: torch.Tensor | None = None

    def episode_heads(self) -> torch.Tensor:
        """[N] bool: the first row of each episode (every row when no episode is split)."""
        import torch

        if self.episode_ids is None:
            return torch.ones(len(self), dtype=torch.bool, device=self.input_ids.device)
        ids = self.episode_ids
        heads = torch.ones_like(ids, dtype=torch.bool)
        heads[1:] = ids[1:] != ids[:-1]  # an episode's rows are consecutive (`collate_trajectories`)
        return heads

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> PolicyBatch:
        import torch

        moved = {
            name: (value.to(device) if isinstance(value, torch.Tensor) else value)
            for name, value in self.__dict__.items()
        }
        return PolicyBatch(**moved)


@dataclass(frozen=True)
class RoundReport:
    """What sampling one round showed, for what watches the run (the guard, `dspo.guard`): made by the round producer
    when the round is taken, carried by the round's first `RoundSlot`. Field names are the contract; a watcher never
    reads logger keys, so renaming a logged tag cannot silently turn a detector off."""

    round_index: int
    sampled_reward: float  # mean reward of every sampled episode, filtered-out groups included
    truncated_share: float  # episodes that ran out of turns or tokens before an answer
    no_search_share: float  # episodes that answered without a tool call
    searched_reward: float  # mean reward of the episodes that called a tool
    # policy versions (completed rounds) of the weights that sampled the round's trained tokens: equal at
    # max_staleness 0 (= round_index); older at k >= 1; a span with partial rollouts (an episode over several weights)
    oldest_version: int
    newest_version: int

    def __post_init__(self) -> None:
        if not 0 <= self.oldest_version <= self.newest_version <= self.round_index:
            raise ValueError(
                f"RoundReport of round {self.round_index}: sampled by versions {self.oldest_version}.."
                f"{self.newest_version}, outside 0 <= oldest <= newest <= round (a bug in dspo; please report it)"
            )


@dataclass(frozen=True)
class StepReport:
    """One optimizer step as the module saw it, for what watches the run (the guard). A skipped step (non-finite loss
    or gradient) has no numbers."""

    skipped: bool = False
    entropy: float | None = None  # mean token entropy of the step's trained tokens
    response_tokens: float | None = None  # mean trained tokens per episode
    grad_norm: float | None = None  # before clipping


@dataclass(frozen=True)
class SavedCheckpoint:
    """A round checkpoint as the guard knows it (`RoundCheckpoint.newest`): the policy version its weights are (rounds
    completed when it was saved: the version of the rounds they sample), the global step it was saved at, its file."""

    version: int
    step: int
    path: str
