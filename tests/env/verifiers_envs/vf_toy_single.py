"""A single-turn verifiers (v1) taskset written with its public API: each question is asked once, the reply's last
`<answer>…</answer>` is paid 1 when a gold answer is a substring of it (subEM). `questions` (config) or `path`, a
JSON Lines file of {question, golden_answers}, gives the questions."""

import json

import verifiers.v1 as vf

from dspo.env.prompting import SEARCHR1_INSTRUCTION
from dspo.env.rewards import extract_answer, subem_reward


class ToyData(vf.TaskData):
    answer: str = ""
    golds: list[str] = []


class ToyTask(vf.Task[ToyData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = trace.messages[-1].content if trace.messages else ""
        return subem_reward(extract_answer(reply or ""), self.data.golds)

    @vf.reward(weight=0.0)
    async def answered(self, trace: vf.Trace) -> float:
        reply = trace.messages[-1].content if trace.messages else ""
        return float(extract_answer(reply or "") is not None)


class ToyConfig(vf.TasksetConfig):
    questions: list[dict] = []
    path: str | None = None
    limit: int = 64


def rows(config) -> list[dict]:
    if config.path:
        with open(config.path) as handle:
            return [json.loads(line) for line in handle][: config.limit]
    return list(config.questions)


class ToySingleTaskset(vf.Taskset[ToyTask, ToyConfig]):
    def load(self):
        for row in rows(self.config):
            golds = list(row["golden_answers"])
            data = ToyData(prompt=SEARCHR1_INSTRUCTION.format(question=row["question"]), answer=golds[0], golds=golds)
            yield ToyTask(data, self.config.task)


__all__ = ["ToySingleTaskset"]
