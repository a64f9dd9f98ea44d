"""The example search agent written with the OpenAI Agents SDK (its Chat Completions model), trained by dspo unchanged
(docs/agents.md#openai-agents-sdk). Needs the `agents` extra: `pip install -e ".[agents]"`.

PYTHONPATH=docs/examples dspo-train env=agent env.agent=openai_agents_sdk_agent.agent
"""

from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

from dspo.env.rewards import extract_answer


async def agent(client, item, tools) -> str | None:
    @function_tool
    async def search(query: str) -> str:
        """Search the knowledge source. Returns the top passages for the query, best first.

        Args:
            query: what to search for.
        """
        return await tools["search"](query=query)

    searcher = Agent(
        name="searcher",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),  # the endpoint's client, as given
        tools=[search],
    )
    # tracing off: the SDK would otherwise export each run's trace to OpenAI's servers
    result = await Runner.run(searcher, tools.instruction, run_config=RunConfig(tracing_disabled=True))
    return extract_answer(result.final_output or "")
