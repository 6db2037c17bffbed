"""8-bit storage of MLA's latent cache: int8 or fp8 (e4m3) values with f32 scales.

Only the latent c_kv [C] is quantized; the rope key k_pe [R] stays in the model's dtype, as in
DeepSeek's own FP8 MLA cache (512 fp8 + 4 f32 scales + 64 bf16 = 656 bytes a token). A scale covers
``group_size`` consecutive latent elements of one token: C (one scale a token) or e.g. 128 (C/128
scales a token). Symmetric absmax scaling: value ~= stored * scale.

The attention kernels never materialize a dequantized cache: with a per-token (or per-group) scale,
scores are dot(q, stored) * scale and the value update is dot(p * scale, stored), so the kernel only
converts the 8-bit tile to bf16 (exact for both formats) on its way into the tensor cores.
"""

from __future__ import annotations

import jax.numpy as jnp

# Storage dtype and the largest magnitude it holds.
QUANT_DTYPES = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}


def num_scale_groups(latent_dim: int, group_size: int | None) -> int:
    """Scales per token: 1 for per-token scaling (group_size None or C), else C / group_size."""
    group_size = group_size or latent_dim
    if latent_dim % group_size:
        raise ValueError(f"kv_cache_group_size={group_size} must divide kv_lora_rank={latent_dim}")
    return latent_dim // group_size


def quantize_latent(c_kv, kind: str, num_groups: int = 1):
    """c_kv [..., C] (any float dtype) -> (stored [..., C] int8 | float8_e4m3fn, scale f32[..., G]).

    G = num_groups scales per token, one per C/G consecutive elements. An all-zero group gets scale 1
    (it dequantizes to zeros either way) so no division by zero reaches the cache.
    """
    if kind not in QUANT_DTYPES:
        raise ValueError(f"kv cache quantization {kind!r} is not supported; accepted: {', '.join(QUANT_DTYPES)}")
    dtype, qmax = QUANT_DTYPES[kind]
    grouped = c_kv.astype(jnp.float32).reshape(*c_kv.shape[:-1], num_groups, -1)  # [..., G, C/G]
    amax = jnp.max(jnp.abs(grouped), axis=-1)  # [..., G]
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    scaled = grouped / scale[..., None]
    if kind == "int8":
        stored = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(dtype)
    else:  # round-to-nearest-even in the cast; |scaled| <= 448 by construction
        stored = jnp.clip(scaled, -qmax, qmax).astype(dtype)
    return stored.reshape(c_kv.shape), scale


def dequantize_latent(stored, scale, dtype=jnp.float32):
    """(stored [..., C], scale f32[..., G]) -> [..., C] in ``dtype``: stored * scale per group."""
    num_groups = scale.shape[-1]
    grouped = stored.astype(jnp.float32).reshape(*stored.shape[:-1], num_groups, -1)
    return (grouped * scale[..., None]).reshape(stored.shape).astype(dtype)
