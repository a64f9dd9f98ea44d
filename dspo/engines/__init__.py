"""dspo.engines: generation behind one protocol (`RolloutEngine`): in-process vLLM (`vllm`), transformers (`hf`) and
scripted replays (`scripted`). The lowest layer of the rollout side: nothing here imports the agent, the environment
or the rollout orchestration. Configs name the classes here (`_target_: dspo.engines.VLLMEngine`)."""

from dspo.engines.base import RolloutEngine, SamplingConfig
from dspo.engines.hf import HFEngine
from dspo.engines.scripted import ScriptedEngine
from dspo.engines.vllm import VLLMEngine

__all__ = ["HFEngine", "RolloutEngine", "SamplingConfig", "ScriptedEngine", "VLLMEngine"]
