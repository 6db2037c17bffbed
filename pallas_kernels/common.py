"""Small pieces the kernels share."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_precision(dtype):
    """f32 operands get IEEE products: the Triton lowering otherwise runs f32 dots as TF32, which
    would make f32 runs disagree with the references. bf16/fp16 keep the tensor cores' native path."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
