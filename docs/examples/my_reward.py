"""A new reward: subEM plus ReSeek-style process rewards for the judge tool (my_tool.py). A verdict is right when it
matches whether the passages retrieved before it contain a gold answer. docs/extending.md, section 7."""

from dspo.env import RewardResult, SubEMReward
from dspo.metrics import normalize_answer


class JudgedSubEM(SubEMReward):
    def __init__(self, weight: float = 0.1, **subem) -> None:
        super().__init__(**subem)  # max_answer_words, credit
        self.weight = weight

    def score(self, episodes):
        results = []
        for episode in episodes:
            golds = [g for g in map(normalize_answer, episode.item.golden_answers) if g]
            seen, steps = "", []  # steps: one entry per model turn, None where the turn did not judge
            for turn in episode.turns:
                if turn.call and turn.call[0] == "judge":
                    found = any(gold in seen for gold in golds)
                    right = (turn.call[1]["verdict"] == "yes") == found
                    steps.append(self.weight if right else -self.weight)
                else:
                    steps.append(None)
                if turn.result:
                    seen += " " + normalize_answer(" ".join(p.text for p in turn.result.passages))
            outcome = self.outcome(episode)
            judge = sum(s for s in steps if s is not None)
            results.append(RewardResult(outcome, step_rewards=steps, components={"subem": outcome, "judge": judge}))
        return results
