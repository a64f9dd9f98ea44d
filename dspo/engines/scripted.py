"""`ScriptedEngine`: a `RolloutEngine` that replays fixed model turns, for tests, demonstrations and benchmarks.

It tokenizes the scripted text and stops like the real engines (stop strings, EOS), so everything after the engine
(agent loop, loss masks, filter, trainer) runs exactly as with vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from dspo.engines.base import SamplingConfig
from dspo.types import Generation

ScriptFn = Callable[[str, int, int], str]


class ScriptedEngine:
    """Replays fixed model turns: tokenizes the scripted text, with the same stop semantics as the real engines.

    `script` is either a callable `script(prompt_text, turn_index, trajectory_index) -> str` or a list, per trajectory,
    of the texts of its turns (`script[trajectory_index][turn_index]`). `prompt_text` is the decoded prompt (chat
    template + everything so far). Trajectories are identified by their token history: a prompt that continues an
    earlier prompt + its output belongs to that trajectory (lowest index first); any other prompt starts a new one.
    Indices count from 0 since the last `reset_episodes()`, which `ToolCallingAgent.rollout` calls, so within one
    `rollout(items, group_size)` the trajectory index is `item_position * group_size + g`.

    A scripted text is cut after its first stop string; a text with no stop string ends with EOS appended (the model
    ended its turn). Logprobs are 0.0. A compacted context (`rollout.agent.overflow=compact`) extends no history, so it
    starts a new trajectory index: script such episodes with a callable that reads the prompt.
    """

    def __init__(self, tokenizer, script: ScriptFn | Sequence[Sequence[str]]) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("ScriptedEngine: the tokenizer has no eos_token_id")
        self.tokenizer = tokenizer
        self.script = script
        self.version = 0
        self.reset_episodes()

    def reset_episodes(self) -> None:
        """Forget all trajectories; the next new prompt is trajectory 0."""
        self._history: list[list[int]] = []  # per trajectory: its last prompt + output
        self._turns: list[int] = []

    def _trajectory_of(self, prompt: list[int], taken: set[int]) -> int:
        for index, seen in enumerate(self._history):
            if (
                index not in taken
                and len(seen) <= len(prompt)
                and prompt[len(seen) - 1] == seen[-1]
                and prompt[: len(seen)] == seen
            ):
                return index
        self._history.append([])
        self._turns.append(0)
        return len(self._history) - 1

    def _text(self, prompt: list[int], turn: int, index: int) -> str:
        if callable(self.script):
            return self.script(self.tokenizer.decode(prompt, skip_special_tokens=False), turn, index)
        if index >= len(self.script) or turn >= len(self.script[index]):
            raise IndexError(
                f"ScriptedEngine: no scripted text for trajectory {index}, turn {turn} "
                f"(script has {len(self.script)} trajectories); extend the script or call reset_episodes()"
            )
        return self.script[index][turn]

    def _render(self, text: str, sampling: SamplingConfig) -> Generation:
        hits = [(text.find(s) + len(s), s) for s in sampling.stop if s in text]
        reason = None
        if hits:
            end, reason = min(hits)
            ids = self.tokenizer.encode(text[:end], add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish, reason = ids[: sampling.max_new_tokens], "length", None
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish, stop_reason=reason, text=text)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        taken: set[int] = set()
        out = []
        for prompt in prompts:
            prompt = list(prompt)
            index = self._trajectory_of(prompt, taken)
            taken.add(index)
            generation = self._render(self._text(prompt, self._turns[index], index), sampling)
            self._history[index] = prompt + generation.token_ids
            self._turns[index] += 1
            out.append(generation)
        return out

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        for _ in named_tensors:  # consume, like a real engine would
            pass
        self.version = version
