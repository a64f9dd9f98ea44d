"""The example search agent written with smolagents (`OpenAIServerModel` + its `ToolCallingAgent`), trained by dspo
unchanged (docs/agents.md#smolagents). Needs the `agents` extra: `pip install -e ".[agents]"`.

PYTHONPATH=docs/examples dspo-train env=agent env.agent=smolagents_agent.agent

smolagents rewrites its history (a call becomes assistant text "Calling tools: [...]", its result a user message
"Observation: ..."), so each call is a sample of its own. Two settings fit it to the environment: its system prompt
(~1,500 tokens of examples for its own action format) is the chat template's default, since the environment's
instruction already says how to search and answer; and a policy that answers in text (`<answer>…</answer>`, as the
instruction asks) rather than through smolagents' `final_answer` tool ends the run at that answer.
"""

import asyncio
import importlib.resources
from concurrent.futures import ThreadPoolExecutor

import yaml
from smolagents import AgentError, OpenAIServerModel, Tool, ToolCallingAgent

from dspo.env.rewards import extract_answer

TEMPLATES = yaml.safe_load(
    importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml").read_text()
)
TEMPLATES["system_prompt"] = "You are a helpful assistant."
# smolagents is synchronous: each episode runs in a thread of its own. asyncio's default pool has cpu_count + 4 threads,
# which would hold the others of a round back (the endpoint batches the calls of episodes that are running)
EPISODES = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="smolagents")


class Search(Tool):
    name = "search"
    description = "Search the knowledge source. Returns the top passages for the query, best first."
    inputs = {"query": {"type": "string", "description": "what to search for"}}
    output_type = "string"

    def __init__(self, tools, loop) -> None:
        super().__init__()
        self.tools, self.loop = tools, loop

    def forward(self, query: str) -> str:
        # smolagents calls tools synchronously, in the agent's thread: the episode's tools live on its event loop
        return asyncio.run_coroutine_threadsafe(self.tools["search"](query=query), self.loop).result()


def written_answer(step) -> str | None:
    return extract_answer(getattr(step, "model_output", None) or "")


def stop_at_answer(step, agent) -> None:
    if written_answer(step) is not None:  # smolagents would take it for a malformed call and ask again
        agent.interrupt()


async def agent(client, item, tools) -> str | None:
    model = OpenAIServerModel(model_id="policy", api_base=str(client.base_url), api_key=client.api_key)
    searcher = ToolCallingAgent(
        tools=[Search(tools, asyncio.get_running_loop())],
        model=model,
        prompt_templates=TEMPLATES,
        step_callbacks=[stop_at_answer],
        verbosity_level=-1,
    )
    try:
        final = await asyncio.get_running_loop().run_in_executor(EPISODES, searcher.run, tools.instruction)
    except AgentError:
        if not searcher.interrupt_switch:
            raise
        final = None
    answers = [a for a in map(written_answer, searcher.memory.steps) if a is not None]
    return answers[-1] if answers else final if isinstance(final, str) else None
