"""dsjax: DeepSeek-V2/V3 mixture-of-experts inference in JAX."""

from dsjax.config import EngineConfig, ModelConfig, ParallelConfig
from dsjax.engine import LLM, LLMEngine, RequestOutput, SamplingParams
from dsjax.loader import load_config, load_model, load_tokenizer

__all__ = ["EngineConfig", "LLM", "LLMEngine", "ModelConfig", "ParallelConfig", "RequestOutput", "SamplingParams",
           "load_config", "load_model", "load_tokenizer"]
