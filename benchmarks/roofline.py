"""Memory roofline of one decode step: the bytes a step must read from HBM, over the bandwidth.

A decode step of B sequences reads every weight that B tokens use once, plus each sequence's cached
latents. Weights split in two:

- always read: attention projections, norms, dense-layer MLPs, routers, shared experts, lm_head, and
  the B embedding rows (the table itself is not read, one row per token is);
- routed experts: only those the batch touches. Assumption: each token picks top-k of E experts
  uniformly at random and independently of the other tokens, so one expert is missed by a token with
  probability 1 - k/E and the expected number of distinct experts touched per MoE layer is
  E * (1 - (1 - k/E)^B). It is k at B = 1 and approaches E as B grows (random-weight routers are close
  to uniform; trained routers are skewed, which touches fewer experts and lowers the bytes).

KV: every sequence reads its whole context of latents (kv_lora_rank + qk_rope_head_dim numbers per
token per layer) and writes one token's. Activations are left out (KBs against GBs).
"""

from __future__ import annotations

import dataclasses
import math

from dsjax.config import ModelConfig

H200_BYTES_PER_S = 4.27e12  # measured H200 copy bandwidth (issue #8, docs: 4.3 TB/s device-to-device)


def expected_experts_touched(num_tokens: int, num_experts: int, top_k: int) -> float:
    """E * (1 - (1 - k/E)^B): distinct experts per MoE layer under uniform independent routing."""
    if num_tokens < 0 or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_tokens={num_tokens}, top_k={top_k}, num_experts={num_experts}: "
                         "accepted num_tokens >= 0 and 1 <= top_k <= num_experts")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def batch_touching_fraction(fraction: float, num_experts: int, top_k: int) -> int:
    """Smallest batch whose expected touched experts reach ``fraction`` of all experts."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction={fraction}: accepted a number in (0, 1)")
    if top_k == num_experts:
        return 1
    return max(1, math.ceil(math.log(1 - fraction) / math.log(1 - top_k / num_experts)))


@dataclasses.dataclass(frozen=True)
class WeightCounts:
    """Parameter counts of one model, split by how a decode step reads them."""

    always: int  # read by every step whatever the batch (embedding rows excluded)
    per_expert: int  # one routed expert of one MoE layer: gate, up and down
    num_moe_layers: int
    embedding_row: int  # hidden_size: read once per token

    @classmethod
    def of(cls, c: ModelConfig) -> WeightCounts:
        d, h = c.hidden_size, c.num_attention_heads
        q = d * h * c.qk_head_dim if c.q_lora_rank is None else \
            d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim
        attn = q + d * c.kv_cache_dim + c.kv_lora_rank + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) \
            + h * c.v_head_dim * d
        per_layer = attn + 2 * d  # + the two RMSNorms
        dense_mlp = 3 * d * c.intermediate_size
        moe_fixed = d * c.n_routed_experts + 3 * d * c.moe_intermediate_size * c.n_shared_experts  # router, shared
        lm_head = c.vocab_size * d
        always = c.num_hidden_layers * per_layer + c.num_dense_layers * dense_mlp + c.num_moe_layers * moe_fixed \
            + d + lm_head
        return cls(always, 3 * d * c.moe_intermediate_size, c.num_moe_layers, d)


@dataclasses.dataclass(frozen=True)
class StepBytes:
    batch: int
    context_tokens: int  # cached tokens the step attends to, summed over its sequences
    experts_touched: float  # expected, per MoE layer
    weight_bytes: float  # always-read weights + embedding rows
    expert_bytes: float  # routed experts touched
    kv_bytes: float  # latents read (whole contexts) + written (one token per sequence)

    @property
    def total(self) -> float:
        return self.weight_bytes + self.expert_bytes + self.kv_bytes

    def seconds(self, bytes_per_s: float = H200_BYTES_PER_S) -> float:
        return self.total / bytes_per_s

    def tok_per_s(self, bytes_per_s: float = H200_BYTES_PER_S) -> float:
        """Roofline decode throughput: B tokens per step."""
        return self.batch / self.seconds(bytes_per_s)


def decode_step_bytes(config: ModelConfig, batch: int, context_tokens: int, dtype_bytes: int = 2) -> StepBytes:
    """Bytes one decode step of ``batch`` sequences attending to ``context_tokens`` tokens in all must read.

    Weights and KV cache are both ``dtype_bytes`` wide (the engine caches in the model's dtype)."""
    if batch < 1 or context_tokens < batch:
        raise ValueError(f"batch={batch}, context_tokens={context_tokens}: accepted batch >= 1 and "
                         "context_tokens >= batch (each sequence attends at least to its new token)")
    counts = WeightCounts.of(config)
    touched = expected_experts_touched(batch, config.n_routed_experts, config.num_experts_per_tok) \
        if config.num_moe_layers else 0.0
    kv_per_token = config.kv_cache_dim * config.num_hidden_layers * dtype_bytes
    return StepBytes(
        batch=batch, context_tokens=context_tokens, experts_touched=touched,
        weight_bytes=(counts.always + batch * counts.embedding_row) * dtype_bytes,
        expert_bytes=counts.num_moe_layers * touched * counts.per_expert * dtype_bytes,
        kv_bytes=(context_tokens + batch) * kv_per_token)


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    return config.kv_cache_dim * config.num_hidden_layers * dtype_bytes


def all_weight_bytes(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """What a step reads once every routed expert is touched (the embedding table aside)."""
    counts = WeightCounts.of(config)
    return (counts.always + counts.num_moe_layers * config.n_routed_experts * counts.per_expert) * dtype_bytes
