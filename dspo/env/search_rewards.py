"""Rewards of published search-agent RL methods, on dspo's reward interface (`dspo.env.rewards`).

- `StepSearchReward` (StepSearch, Wang et al. 2025, "Igniting LLMs Search Ability via Step-Wise Proximal Policy
  Optimization"): per search step, an information gain (the share of the question's gold documents that this step
  retrieved for the first time) minus a redundancy penalty (the share of this step's documents that earlier steps
  had already retrieved). Departures, on purpose: StepSearch measures gain by the similarity of retrieved to gold
  documents and scores the answer by F1; here a document is gold when its title is one of the item's gold titles
  (`metadata[gold_key]`: HotpotQA's `supporting_titles`, the toy world's `chain`), and the outcome stays dspo's 0/1
  subEM, so the dynamic filter keeps its meaning. With `credit: turn` each turn's tokens get that turn's step reward
  (token-level process supervision); with `credit: trajectory` the steps add to the trajectory's total.
- `IkeaReward` (IKEA, Huang et al. 2025, "Reinforced Internal-External Knowledge Synergistic Reasoning for Efficient
  Adaptive Search Agent"): the outcome plus a knowledge-boundary term r_kb: a right answer earns
  `positive · (1 − n / max_retrievals)` (the fewer retrievals n, the more), a wrong answer after searching earns
  `negative` (searching when the model does not know is encouraged), a wrong answer without search earns 0. The
  constants are dspo's defaults, not IKEA's tuned values; r_kb is trajectory-level shaping (`RewardResult.shaping`).
"""

from __future__ import annotations

from collections.abc import Sequence

from dspo.env.rewards import EpisodeRecord, RewardResult, SubEMReward, gold_titles
from dspo.metrics import normalize_answer


class StepSearchReward(SubEMReward):
    """Args:
    gold_key: the item metadata key holding the gold document titles.
    gain_weight, redundancy_weight: the step reward is gain_weight · gain − redundancy_weight · redundancy.
    max_answer_words, credit: as `SubEMReward`.
    """

    def __init__(
        self,
        gold_key: str = "supporting_titles",
        gain_weight: float = 0.5,
        redundancy_weight: float = 0.5,
        max_answer_words: int | None = None,
        credit: str = "trajectory",
    ) -> None:
        super().__init__(max_answer_words, credit)
        if gain_weight < 0 or redundancy_weight < 0:
            raise ValueError("env.reward.gain_weight and env.reward.redundancy_weight must be >= 0")
        self.gold_key, self.gain_weight, self.redundancy_weight = gold_key, gain_weight, redundancy_weight

    def steps(self, episode: EpisodeRecord) -> tuple[list[float | None], float, float]:
        """Per-turn step rewards (None on turns without a retrieval), the summed gain and the mean redundancy."""
        gold = gold_titles(episode.item, self.gold_key)
        seen: set[str] = set()
        found: set[str] = set()
        steps: list[float | None] = []
        gains, redundancies = 0.0, []
        for turn in episode.turns:
            if turn.call is None or turn.result is None or turn.result.error is not None:
                steps.append(None)
                continue
            titles = [normalize_answer(p.title) for p in turn.result.passages]
            new_gold = (set(titles) & gold) - found
            gain = len(new_gold) / len(gold) if gold else 0.0
            redundancy = sum(title in seen for title in titles) / len(titles) if titles else 0.0
            found |= new_gold
            seen |= set(titles)
            gains += gain
            redundancies.append(redundancy)
            steps.append(self.gain_weight * gain - self.redundancy_weight * redundancy)
        return steps, gains, sum(redundancies) / len(redundancies) if redundancies else 0.0

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        results = []
        for episode in episodes:
            outcome = self.outcome(episode)
            steps, gain, redundancy = self.steps(episode)
            components = {"subem": outcome, "info_gain": gain, "redundancy": redundancy}
            components["step_total"] = sum(s for s in steps if s is not None)
            results.append(RewardResult(outcome, step_rewards=steps, components=components))
        return results


class IkeaReward(SubEMReward):
    """Args:
    positive: r_kb of a right answer without any retrieval (it falls linearly to 0 at `max_retrievals`).
    negative: r_kb of a wrong answer after at least one retrieval.
    max_retrievals: the retrieval count at which a right answer's bonus reaches 0 (the agent's most searches:
        rollout.agent.max_turns − 1).
    max_answer_words, credit: as `SubEMReward` (`credit: turn` is refused: r_kb is not per turn).
    """

    def __init__(
        self,
        positive: float = 0.6,
        negative: float = 0.1,
        max_retrievals: int = 3,
        max_answer_words: int | None = None,
        credit: str = "trajectory",
    ) -> None:
        super().__init__(max_answer_words, credit)
        if credit != "trajectory":
            raise ValueError("env.reward.credit: IKEA's knowledge-boundary term is trajectory-level; use trajectory")
        if max_retrievals < 1:
            raise ValueError(f"env.reward.max_retrievals must be >= 1, got {max_retrievals}")
        self.positive, self.negative, self.max_retrievals = positive, negative, max_retrievals

    def knowledge_boundary(self, outcome: float, retrievals: int) -> float:
        """IKEA's r_kb for an episode with this outcome and this many retrievals."""
        if outcome > 0:
            return self.positive * max(0.0, 1.0 - retrievals / self.max_retrievals)
        return self.negative if retrievals > 0 else 0.0

    def score(self, episodes: Sequence[EpisodeRecord]) -> list[RewardResult]:
        results = []
        for episode in episodes:
            outcome, retrievals = self.outcome(episode), len(episode.searches)
            shaping = self.knowledge_boundary(outcome, retrievals)
            components = {"subem": outcome, "knowledge_boundary": shaping, "retrievals": float(retrievals)}
            results.append(RewardResult(outcome, shaping=shaping, components=components))
        return results
