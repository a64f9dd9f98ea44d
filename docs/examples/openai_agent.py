"""A search agent written against the OpenAI chat API, trained by dspo unchanged (docs/agents.md):

PYTHONPATH=docs/examples dspo-train env=agent env.agent=openai_agent.agent
"""

import json

from dspo.env.rewards import extract_answer


async def agent(client, item, tools) -> str | None:
    # tools.instruction: the environment's instruction with the question (what the built-in agent sends first)
    messages = [{"role": "user", "content": tools.instruction}]
    schemas = [tool.schema for tool in tools.values()]
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=schemas)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return extract_answer(message.content or "")
        for call in message.tool_calls:
            try:
                result = await tools[call.function.name](**json.loads(call.function.arguments))
            except (ValueError, KeyError, TypeError) as error:
                result = f"Error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
