"""dspo.rollout: engines (vLLM, transformers, scripted), the multi-turn search agent, tool-call parsing, prompts."""

from dspo.rollout.agent import AgentConfig, SearchAgent
from dspo.rollout.engine import HFEngine, RolloutEngine, SamplingConfig, VLLMEngine
from dspo.rollout.scripted import ScriptedEngine

__all__ = ["AgentConfig", "HFEngine", "RolloutEngine", "SamplingConfig", "ScriptedEngine", "SearchAgent", "VLLMEngine"]
