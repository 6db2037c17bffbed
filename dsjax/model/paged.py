"""Device-side types of the paged latent KV cache and the per-step attention metadata."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsjax.config import ModelConfig


class PagedKVCache(NamedTuple):
    """MLA caches one latent per token, not per-head K/V: c_kv and the shared rope key k_pe."""

    c_kv: jax.Array  # [L, num_blocks, block_size, kv_lora_rank]
    k_pe: jax.Array  # [L, num_blocks, block_size, qk_rope_head_dim]

    @property
    def num_blocks(self) -> int:
        return self.c_kv.shape[1]

    @property
    def block_size(self) -> int:
        return self.c_kv.shape[2]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype) -> int:
        return config.num_hidden_layers * block_size * config.kv_cache_dim * jnp.dtype(dtype).itemsize

    @classmethod
    def zeros(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype, sharding=None) -> "PagedKVCache":
        """``sharding`` (of both arrays): each device allocates only its slice."""
        layers = config.num_hidden_layers

        def make():
            return cls(jnp.zeros((layers, num_blocks, block_size, config.kv_lora_rank), dtype),
                       jnp.zeros((layers, num_blocks, block_size, config.qk_rope_head_dim), dtype))

        return make() if sharding is None else jax.jit(make, out_shardings=sharding)()


class PagedBatch(NamedTuple):
    """Where each token of a packed step sits: written to ``slot_mapping``, attending to its sequence's
    positions 0..positions[t] through the block table row ``seq_ids[t]``."""

    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T] block * block_size + offset; padding >= num_blocks * block_size (dropped)
    seq_ids: jax.Array  # i32[T]
    block_tables: jax.Array  # i32[S, W]
