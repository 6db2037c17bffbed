"""dsjax: DeepSeek-V2/V3 mixture-of-experts inference in JAX."""

from dsjax.config import ModelConfig
from dsjax.loader import load_config, load_model, load_tokenizer

__all__ = ["ModelConfig", "load_config", "load_model", "load_tokenizer"]
