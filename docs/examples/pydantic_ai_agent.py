"""The example search agent written with pydantic-ai (its OpenAI chat model), trained by dspo unchanged
(docs/agents.md#pydantic-ai). Needs the `agents` extra: `pip install -e ".[agents]"`.

PYTHONPATH=docs/examples dspo-train env=agent env.agent=pydantic_ai_agent.agent

pydantic-ai splits a `<think>` block off the text it receives and sends it back re-rendered (`<think>\\n…\\n</think>`),
so a policy that thinks in tags rewrites its history at each call: each call is a sample of its own
(docs/agents.md#pydantic-ai).
"""

from pydantic_ai import Agent, UnexpectedModelBehavior
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from dspo.env.rewards import extract_answer


async def agent(client, item, tools) -> str | None:
    async def search(query: str) -> str:
        """Search the knowledge source. Returns the top passages for the query, best first.

        Args:
            query: what to search for.
        """
        return await tools["search"](query=query)

    model = OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=client))  # the endpoint's client, as given
    searcher = Agent(model, tools=[search])
    try:
        result = await searcher.run(tools.instruction)
    except UnexpectedModelBehavior:  # the policy's calls failed the tool's schema past pydantic-ai's retries: no answer
        return None
    return extract_answer(result.output or "")
