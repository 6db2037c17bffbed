"""The step kernel's attention half at one token: the weight layout its phases will take and the reference
they will be checked against (``docs/decode_step_kernel.md``, phases 1-5; the phases are not built yet).

Rope without gathers. The model rotates the pairs of each rope slice: interleaved (x0, x1), (x2, x3), ...
in DeepSeek's checkpoints (``rope_interleave``), else (x_i, x_{i + R/2}). Either way it keeps the halves
layout [rotated evens | rotated odds] (``pallas_kernels.common.rotate``). A kernel's vector layouts take
contiguous halves, not strided gathers, so ``permute_rope_columns`` reorders the rope columns of q_proj and
kv_a once, when the weights are prepared: their products then come out as [evens | odds] already, and the
rotation is of two contiguous halves (``rotate_halves``). The values are the model's, bit for bit.

``attention_half_reference``: x_mid = x + the layer's attention of one token (V2-Lite's form: q_proj, no q
LoRA) over its paged context, the token's latent and rope key written into the cache first, in the model's
order and dtypes (``dsjax.model.mla.MLAttention.paged`` on the reference backend).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import cos_sin, rms_norm, rotate_by
from pallas_kernels.mla_decode import mla_paged_reference


class AttentionWeights(NamedTuple):
    """One layer's attention weights, rope columns permuted (``permute_rope_columns``)."""

    norm: object  # [D] the attention's RMSNorm
    q_proj: object  # [D, H, Dn + R]
    kv_a: object  # [D, C + R]
    kv_a_norm: object  # [C]
    w_uk: object  # [C, H, Dn]
    w_uv: object  # [C, H, V]
    o_proj: object  # [H, V, D]


class AttentionSpec(NamedTuple):
    """The attention's constants (static)."""

    eps: float  # the attention's RMSNorm
    kv_eps: float  # kv_a_norm's
    scale: float  # the softmax's (YaRN's mscale in it)
    inv_freq: tuple  # rope's inverse frequencies [R / 2]
    cos_sin_scale: float  # YaRN's factor on cos and sin


def rope_order(rope_dim: int, interleave: bool) -> np.ndarray:
    """The rope columns in the order that puts a product's pairs as [evens | odds]: [0, 2, ..., R - 2, 1, 3,
    ..., R - 1] for interleaved pairs; as they are otherwise (the pairs are (i, i + R/2) already)."""
    if rope_dim % 2:
        raise ValueError(f"rope dim {rope_dim}: rope rotates pairs, so it must be even")
    columns = np.arange(rope_dim)
    return np.concatenate([columns[0::2], columns[1::2]]) if interleave else columns


def permute_rope_columns(q_proj, kv_a, rope_dim: int, interleave: bool):
    """q_proj [D, H, Dn + R] and kv_a [D, C + R] with each rope slice's columns in ``rope_order``."""
    order = rope_order(rope_dim, interleave)
    nope, latent = q_proj.shape[-1] - rope_dim, kv_a.shape[-1] - rope_dim
    q_order = np.concatenate([np.arange(nope), nope + order])
    kv_order = np.concatenate([np.arange(latent), latent + order])
    return q_proj[..., q_order], kv_a[..., kv_order]


def rope_cos_sin(position, inv_freq, cos_sin_scale: float):
    """cos and sin f32 [R / 2] of the angles position * inv_freq, times ``cos_sin_scale``: what the caller
    hands the kernel (a few XLA ops a step)."""
    return cos_sin(jnp.asarray(position, jnp.float32) * jnp.asarray(inv_freq, jnp.float32), cos_sin_scale)


def rotate_halves(x32, cos, sin):
    """f32 x [..., R] in the [evens | odds] layout, rotated by the angles whose scaled cos and sin [R / 2] are
    given -> f32 [..., R], the model's halves layout."""
    return jnp.concatenate(rotate_by(*jnp.split(x32, 2, axis=-1), cos, sin), axis=-1)


def attention_half_reference(x, position, block_table, c_kv, k_pe, weights: AttentionWeights, spec: AttentionSpec):
    """One token x [D] at ``position`` of the sequence whose pages are block_table i32[W], against the layer's
    paged cache c_kv [N, bs, C] / k_pe [N, bs, R] -> (x_mid [D] = x + attention, c_kv, k_pe with the token's
    latent and rope key written at its slot)."""
    rope_dim = k_pe.shape[-1]
    nope, latent = weights.q_proj.shape[-1] - rope_dim, c_kv.shape[-1]
    h = rms_norm(x[None], weights.norm, spec.eps)
    q = jnp.einsum("td,dhk->thk", h, weights.q_proj)
    kv = h @ weights.kv_a
    cos, sin = rope_cos_sin(position, spec.inv_freq, spec.cos_sin_scale)
    q_pe = rotate_halves(q[..., nope:].astype(jnp.float32), cos, sin).astype(x.dtype)
    c_row = rms_norm(kv[..., :latent], weights.kv_a_norm, spec.kv_eps)
    k_row = rotate_halves(kv[..., latent:].astype(jnp.float32), cos, sin).astype(x.dtype)
    block_size = c_kv.shape[1]
    page, offset = block_table[position // block_size], position % block_size
    c_kv = c_kv.at[page, offset].set(c_row[0].astype(c_kv.dtype))
    k_pe = k_pe.at[page, offset].set(k_row[0].astype(k_pe.dtype))
    q_latent = jnp.einsum("thn,chn->thc", q[..., :nope], weights.w_uk)
    ctx = mla_paged_reference(q_latent, q_pe, c_kv, k_pe, block_table[None], jnp.zeros((1,), jnp.int32),
                              jnp.asarray([position], jnp.int32), spec.scale)
    v_ctx = jnp.einsum("thc,chv->thv", ctx, weights.w_uv).reshape(1, -1)
    out = v_ctx @ weights.o_proj.reshape(v_ctx.shape[-1], -1)
    return x + out[0], c_kv, k_pe
