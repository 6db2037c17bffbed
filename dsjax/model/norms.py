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
        return rms_norm(x, self.weight[...], self.eps)


def rms_norm(x, weight, eps: float):
    """x [..., D] over its last axis, times weight [D] (the decode kernels fuse the same arithmetic)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)
