"""A planning agent (docs/extending.md, section 8): the first turn writes the searches it means to make inside
<plan> ... </plan>, then the episode goes on as the tool-calling agent's. Three hooks differ, no loop is rewritten.

    PYTHONPATH=docs/examples dspo-train 'imports=[my_agent]' rollout.agent._target_=my_agent.PlanningAgent
"""

from dataclasses import replace

from dspo.agent.tool_calling import ToolCallingAgent

PLAN_CLOSE = "</plan>"
ASK = "First list the searches you will make inside <plan> and </plan>. "


class PlanningAgent(ToolCallingAgent):
    """The tool-calling agent (`rollout.agent`'s limits as keywords) whose first turn is a plan."""

    def __init__(self, engine, tokenizer, env, ask: str = ASK, **limits) -> None:
        super().__init__(engine, tokenizer, env, **limits)
        self.ask = ask

    def first_prompt(self, item):  # the request for a plan goes before the question
        return super().first_prompt(replace(item, question=self.ask + item.question))

    def stop_strings(self, turn):  # the first turn may end at its plan
        return [PLAN_CLOSE, *super().stop_strings(turn)] if turn == 0 else super().stop_strings(turn)

    def next_message(self, text, turn):  # after the plan, go on (any other turn without a call ends the episode)
        if turn == 0 and PLAN_CLOSE in text:
            return "Plan noted. Carry it out, one search at a time."
        return super().next_message(text, turn)
