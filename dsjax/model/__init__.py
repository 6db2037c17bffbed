from dsjax.model.paged import PagedBatch, PagedKVCache
from dsjax.model.transformer import DeepseekForCausalLM, abstract_model, random_model

__all__ = ["DeepseekForCausalLM", "abstract_model", "random_model", "PagedBatch", "PagedKVCache"]
