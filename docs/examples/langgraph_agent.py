"""The example search agent written with LangGraph (`langchain-openai`'s `ChatOpenAI(...).bind_tools`), trained by dspo
unchanged (docs/agents.md#langgraph). Needs the `agents` extra: `pip install -e ".[agents]"`.

PYTHONPATH=docs/examples dspo-train env=agent env.agent=langgraph_agent.agent
"""

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from dspo.env.rewards import extract_answer


async def agent(client, item, tools) -> str | None:
    @tool
    async def search(query: str) -> str:
        """Search the knowledge source. Returns the top passages for the query, best first."""
        return await tools["search"](query=query)

    # the endpoint's URL and key: every call of this graph is recorded as this episode's
    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    model = llm.bind_tools([search])

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([search]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    state = await graph.compile().ainvoke({"messages": [("user", tools.instruction)]})
    return extract_answer(state["messages"][-1].content or "")
