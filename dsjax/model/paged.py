"""Device-side types of the paged latent KV cache and the per-step attention metadata."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsjax.config import KV_CACHE_DTYPES, ModelConfig
from pallas_kernels.kv_quant import QUANT_DTYPES, num_scale_groups

assert set(KV_CACHE_DTYPES) == {"auto", *QUANT_DTYPES}


def cache_layout(config: ModelConfig, dtype, kv_cache_dtype: str = "auto", group_size: int | None = None):
    """(c_kv storage dtype, scales per token or 0 when unquantized). k_pe always keeps ``dtype``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; accepted: {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "auto":
        return jnp.dtype(dtype), 0
    return jnp.dtype(QUANT_DTYPES[kv_cache_dtype][0]), num_scale_groups(config.kv_lora_rank, group_size)


class PagedKVCache(NamedTuple):
    """MLA caches one latent per token, not per-head K/V: c_kv and the shared rope key k_pe. An 8-bit
    c_kv (kv_cache_dtype int8 / fp8) carries f32 scales, one per kv_lora_rank / G elements."""

    c_kv: jax.Array  # [L, num_blocks, block_size, kv_lora_rank]
    k_pe: jax.Array  # [L, num_blocks, block_size, qk_rope_head_dim]
    c_kv_scale: jax.Array | None = None  # f32[L, num_blocks, block_size, G] when c_kv is 8-bit

    @property
    def quantization(self) -> str | None:
        """'int8', 'fp8' or None (c_kv in the model's dtype)."""
        if self.c_kv_scale is None:
            return None
        return next(kind for kind, (dtype, _) in QUANT_DTYPES.items() if jnp.dtype(dtype) == self.c_kv.dtype)

    @property
    def num_blocks(self) -> int:
        return self.c_kv.shape[1]

    @property
    def block_size(self) -> int:
        return self.c_kv.shape[2]

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype, kv_cache_dtype: str = "auto", group_size: int | None = None) -> int:
        """Bytes one token occupies over all layers: latent (+ its scales) and rope key."""
        latent_dtype, num_groups = cache_layout(config, dtype, kv_cache_dtype, group_size)
        per_layer = (config.kv_lora_rank * latent_dtype.itemsize + num_groups * 4
                     + config.qk_rope_head_dim * jnp.dtype(dtype).itemsize)
        return config.num_hidden_layers * per_layer

    @classmethod
    def bytes_per_block(cls, config: ModelConfig, block_size: int, dtype, kv_cache_dtype: str = "auto",
                        group_size: int | None = None) -> int:
        return block_size * cls.bytes_per_token(config, dtype, kv_cache_dtype, group_size)

    @classmethod
    def zeros(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype, sharding=None,
              kv_cache_dtype: str = "auto", group_size: int | None = None) -> "PagedKVCache":
        """``sharding`` (of every array): each device allocates only its slice."""
        layers = config.num_hidden_layers
        latent_dtype, num_groups = cache_layout(config, dtype, kv_cache_dtype, group_size)

        def make():
            return cls(jnp.zeros((layers, num_blocks, block_size, config.kv_lora_rank), latent_dtype),
                       jnp.zeros((layers, num_blocks, block_size, config.qk_rope_head_dim), dtype),
                       jnp.ones((layers, num_blocks, block_size, num_groups), jnp.float32) if num_groups else None)

        return make() if sharding is None else jax.jit(make, out_shardings=sharding)()


class PagedBatch(NamedTuple):
    """Where each token of a packed step sits: written to ``slot_mapping``, attending to its sequence's
    positions 0..positions[t] through the block table row ``seq_ids[t]``."""

    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T] block * block_size + offset; padding >= num_blocks * block_size (dropped)
    seq_ids: jax.Array  # i32[T]
    block_tables: jax.Array  # i32[S, W]
