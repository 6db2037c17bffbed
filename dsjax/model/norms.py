"""RMSNorm, computed in f32 and scaled in the input dtype (as transformers does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.model.params import param


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis: str, dtype):
        self.weight = param(None, (dim,), (axis,), dtype, init="ones")
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)
