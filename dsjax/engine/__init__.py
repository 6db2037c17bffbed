from dsjax.engine.llm import LLM
from dsjax.engine.llm_engine import LLMEngine
from dsjax.engine.outputs import CompletionOutput, RequestOutput
from dsjax.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "CompletionOutput", "RequestOutput", "SamplingParams"]
