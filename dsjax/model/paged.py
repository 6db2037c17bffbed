"""Device-side types of the paged latent KV cache and the per-step attention metadata."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsjax.config import KV_CACHE_DTYPES, ModelConfig
from pallas_kernels.kv_quant import QUANT_DTYPES, num_scale_groups, quantize_latent

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
    # Distance-aware precision: a second, 8-bit pool for old blocks; block ids >= num_blocks index it
    # (minus num_blocks), and k_pe then holds num_blocks + Nc blocks.
    c_kv_compressed: jax.Array | None = None  # [L, Nc, block_size, kv_lora_rank] int8 | float8_e4m3fn
    compressed_scale: jax.Array | None = None  # f32[L, Nc, block_size, G]

    @property
    def quantization(self) -> str | None:
        """'int8', 'fp8' or None: the format of the 8-bit pool (c_kv's, or the compressed pool's)."""
        stored = self.c_kv_compressed if self.c_kv_compressed is not None else (
            self.c_kv if self.c_kv_scale is not None else None)
        if stored is None:
            return None
        return next(kind for kind, (dtype, _) in QUANT_DTYPES.items() if jnp.dtype(dtype) == stored.dtype)

    @property
    def pools(self) -> tuple[int, int] | None:
        """(full-precision blocks, compressed blocks) with distance-aware precision, else None."""
        if self.c_kv_compressed is None:
            return None
        return self.c_kv.shape[1], self.c_kv_compressed.shape[1]

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
              kv_cache_dtype: str = "auto", group_size: int | None = None,
              num_compressed_blocks: int = 0) -> "PagedKVCache":
        """``sharding`` (of every array): each device allocates only its slice. With
        ``num_compressed_blocks`` the num_blocks pool keeps the model's dtype and ``kv_cache_dtype``
        formats the compressed pool."""
        layers = config.num_hidden_layers
        latent_dtype, num_groups = cache_layout(config, dtype, kv_cache_dtype, group_size)
        if num_compressed_blocks and not num_groups:
            raise ValueError("a compressed pool needs kv_cache_dtype int8 or fp8 (the format it stores)")
        latent = lambda n, dt: jnp.zeros((layers, n, block_size, config.kv_lora_rank), dt)
        scales = lambda n: jnp.ones((layers, n, block_size, num_groups), jnp.float32)

        def make():
            k_pe = jnp.zeros((layers, num_blocks + num_compressed_blocks, block_size, config.qk_rope_head_dim), dtype)
            if num_compressed_blocks:
                return cls(latent(num_blocks, dtype), k_pe, None, latent(num_compressed_blocks, latent_dtype),
                           scales(num_compressed_blocks))
            return cls(latent(num_blocks, latent_dtype), k_pe, scales(num_blocks) if num_groups else None)

        return make() if sharding is None else jax.jit(make, out_shardings=sharding)()

    def copy_blocks(self, src, dst) -> "PagedKVCache":
        """Copies whole full-precision blocks src i32[P] to dst i32[P] in every layer (latent, its scales,
        rope key); a dst out of range (padding) is dropped. Every source is read before any write."""
        put = lambda pool: None if pool is None else pool.at[:, dst].set(pool[:, src], mode="drop")
        return self._replace(c_kv=put(self.c_kv), c_kv_scale=put(self.c_kv_scale), k_pe=put(self.k_pe))

    def compress_blocks(self, src, dst) -> "PagedKVCache":
        """Moves full-precision blocks src i32[P] into compressed blocks dst i32[P] (global ids, >=
        num_blocks), quantizing their latents per token; a dst out of range (padding) is dropped."""
        num_full = self.c_kv.shape[1]
        stored, scale = quantize_latent(self.c_kv[:, src], self.quantization, self.compressed_scale.shape[-1])
        put = lambda pool, index, rows: pool.at[:, index].set(rows, mode="drop")
        return self._replace(c_kv_compressed=put(self.c_kv_compressed, dst - num_full, stored),
                             compressed_scale=put(self.compressed_scale, dst - num_full, scale),
                             k_pe=put(self.k_pe, dst, self.k_pe[:, src]))


class PagedBatch(NamedTuple):
    """Where each token of a packed step sits: written to ``slot_mapping``, attending to its sequence's
    positions 0..positions[t] through the block table row ``seq_ids[t]``."""

    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T] block * block_size + offset; padding >= num_blocks * block_size (dropped)
    seq_ids: jax.Array  # i32[T]
    block_tables: jax.Array  # i32[S, W]
