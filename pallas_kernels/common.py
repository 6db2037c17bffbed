"""Small pieces the kernels share."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_precision(dtype):
    """f32 operands get IEEE products: the Triton lowering otherwise runs f32 dots as TF32, which
    would make f32 runs disagree with the references. bf16/fp16 keep the tensor cores' native path."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def shrink_for_itemsize(block_k: int, num_stages: int, itemsize: int) -> tuple[int, int]:
    """Tile tables are tuned for 2-byte operands; 4-byte (f32) tiles halve block_k and keep at most
    two pipeline stages so the staged tiles still fit in shared memory (227 KiB per block on H100/H200)."""
    if itemsize <= 2:
        return block_k, num_stages
    return max(16, block_k // 2), min(num_stages, 2)
