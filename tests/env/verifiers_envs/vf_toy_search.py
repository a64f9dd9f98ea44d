"""A multi-turn verifiers (v1) taskset written with its public API: the task's `search` tool (a `vf.Toolset`, served
by verifiers as an MCP server in its own process, per rollout or, with `task.shared`, once for the taskset) looks up a
page by word overlap; the reply's last `<answer>` is paid
by subEM, and whether the episode searched is a zero-weight reward (logged, not paid)."""

import json
import re

import verifiers.v1 as vf
from vf_toy_single import ToyConfig, ToyData, rows

from dspo.env.prompting import SEARCHR1_INSTRUCTION
from dspo.env.rewards import extract_answer, subem_reward


class PagesConfig(vf.ToolsetConfig):
    pages: list[dict] = []  # {title, text}
    corpus: str | None = None  # or a JSON Lines corpus of {title, text} / {contents}


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


class SearchToolset(vf.Toolset[PagesConfig]):
    def _pages(self) -> list[dict]:
        if getattr(self, "_cache", None) is None:
            pages = list(self.config.pages)
            if self.config.corpus:
                with open(self.config.corpus) as handle:
                    for line in handle:
                        row = json.loads(line)
                        title, _, text = row.get("contents", "").partition("\n")
                        pages.append({"title": row.get("title", title.strip('"')), "text": row.get("text", text)})
            self._cache = pages
        return self._cache

    @vf.tool
    def search(self, query: str) -> str:
        """Search the encyclopedia."""
        pages = self._pages()
        best = max(pages, key=lambda p: len(_words(query) & _words(p["title"] + " " + p["text"])), default=None)
        return f"Doc 1(Title: {best['title']}) {best['text']}" if best else "No results."


class SearchTaskConfig(vf.TaskConfig):
    tools: PagesConfig = PagesConfig()
    shared: bool = False  # one server for the whole taskset (Taskset.toolsets) instead of one per rollout


class SearchTask(vf.Task[ToyData, vf.State, SearchTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [] if config.shared else [SearchToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = trace.messages[-1].content if trace.messages else ""
        return subem_reward(extract_answer(reply or ""), self.data.golds)

    @vf.reward(weight=0.0)
    async def searched(self, trace: vf.Trace) -> float:
        return float(any(m.role == "tool" for m in trace.messages))


class SearchConfig(ToyConfig):
    task: SearchTaskConfig = SearchTaskConfig()


class ToySearchTaskset(vf.Taskset[SearchTask, SearchConfig]):
    @classmethod
    def toolsets(cls, config):
        return [SearchToolset(config.task.tools)] if config.task.shared else []

    def load(self):
        for row in rows(self.config):
            golds = list(row["golden_answers"])
            data = ToyData(prompt=SEARCHR1_INSTRUCTION.format(question=row["question"]), answer=golds[0], golds=golds)
            yield SearchTask(data, self.config.task)


__all__ = ["ToySearchTaskset"]

if __name__ == "__main__":
    SearchToolset.run()
