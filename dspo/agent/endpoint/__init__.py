"""An OpenAI-compatible endpoint over the rollout engine, and the agent that trains what runs behind it (`env.agent`).

Layers, bottom up: `requests` (bodies in and out), `chat` (messages -> token ids, completions -> messages),
`episodes` (calls by token ids -> training samples), `scheduler` (batching across episodes), `server` (HTTP),
`generation` and `tools` (a batch of requests or tool calls, run on the rollout's thread), `trajectories`, and
`agent` (`EndpointAgent`, the `Agent` the trainer sees). docs/agents.md is the user's guide.
"""

from dspo.agent.endpoint.agent import AgentFailureError, EndpointAgent

__all__ = ["AgentFailureError", "EndpointAgent"]
