"""Rotary position embedding for the qk_rope part of MLA, with DeepSeek's YaRN context extension."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig
from pallas_kernels.common import rotate


def _yarn_inv_freq(dim: int, base: float, scaling) -> np.ndarray:
    """YaRN: interpolate low frequencies by 1/factor, keep high ones, ramp linearly in between."""
    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi)) \
            / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    keep = 1 - ramp  # 1 = keep the original (extrapolated) frequency
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def rope_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """-> (inverse frequencies f32[rope_dim / 2], factor on cos/sin)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    if config.rope_scaling is None:
        return (1.0 / base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(np.float32), 1.0
    return _yarn_inv_freq(dim, base, config.rope_scaling), config.rope_scaling.cos_sin_scale


def apply_rope(x, positions, inv_freq: np.ndarray, cos_sin_scale: float, interleave: bool):
    """x [..., R] at positions i32[...] (x's leading dims, heads excluded when broadcasting) -> [..., R].

    ``interleave``: rotate pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay them out;
    otherwise pairs (x_i, x_{i+R/2}). The output keeps the halves layout [rotated evens | rotated odds]
    either way: q and k share it, so q·k is unchanged, which is all the cache needs.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., R/2]
    while freqs.ndim < x.ndim:  # broadcast over the heads axis of q
        freqs = freqs[..., None, :]
    return rotate(x.astype(jnp.float32), freqs, cos_sin_scale, interleave).astype(x.dtype)
