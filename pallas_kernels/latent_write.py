"""A decode step's new latents into the paged MLA cache, in one launch and in place.

What the cache stores for a token is kv_a_proj's output split in two: the latent, RMS-normalized
(kv_a_norm), and the rope key, rotated at the token's position. In XLA that is a norm (two fusions),
a rope fusion and, per pool, a bounds-checked scatter (a read of the old row, then the write): ~10 µs a
layer at batch 1 for a few KB (benchmarks/results/decode_profile.md, round 5). Here one program per
token normalizes, rotates and stores both rows at its slot; the pools are aliased in and out (no
copy), and padding tokens (slots past the pool) store nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu



def _write_kernel(layer_ref, norm_index_ref, slots_ref, positions_ref, kv_ref, norm_ref, inv_freq_ref, c_kv_in, k_pe_in, c_kv_ref,
                  k_pe_ref, *, latent_dim, rope_dim, eps, cos_sin_scale, interleave, block_size, num_slots):
    # layer, norm_index i32[1]; slots, positions i32[T]; kv f32[T, C + R] (kv_a_proj's output); norm [Ln, C]; inv_freq
    # f32[R / 2]; c_kv_ref [L, N, bs, C] and k_pe_ref [L, N, bs, R], aliased to c_kv_in / k_pe_in.
    del c_kv_in, k_pe_in  # the same buffers as the outputs
    token, layer = pl.program_id(0), layer_ref[0]
    slot = slots_ref[token]
    dtype = c_kv_ref.dtype
    width_c, half = pl.next_power_of_2(latent_dim), rope_dim // 2
    width_r = pl.next_power_of_2(half)

    @pl.when(slot < num_slots)  # padding tokens point past the pool
    def _():
        block, offset = slot // block_size, slot % block_size
        cols = jnp.arange(width_c)
        c_ok = cols < latent_dim
        # kv_a_proj's output in the model dtype, as the reference path rounds it, then RMSNorm in f32
        c = plgpu.load(kv_ref.at[token, cols], mask=c_ok, other=0).astype(dtype).astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.sum(c * c) / latent_dim + eps)
        g = plgpu.load(norm_ref.at[norm_index_ref[0], cols], mask=c_ok, other=0)
        plgpu.store(c_kv_ref.at[layer, block, offset, cols], (g * (c * inv_rms).astype(dtype)).astype(dtype),
                    mask=c_ok)

        pairs = jnp.arange(width_r)
        r_ok = pairs < half
        first, second = (2 * pairs, 2 * pairs + 1) if interleave else (pairs, pairs + half)
        load_r = lambda idx: plgpu.load(kv_ref.at[token, latent_dim + idx], mask=r_ok, other=0
                                        ).astype(dtype).astype(jnp.float32)
        x1, x2 = load_r(first), load_r(second)
        freqs = positions_ref[token].astype(jnp.float32) * plgpu.load(inv_freq_ref.at[pairs], mask=r_ok, other=0)
        cos, sin = jnp.cos(freqs) * cos_sin_scale, jnp.sin(freqs) * cos_sin_scale
        # [rotated evens | rotated odds], the layout apply_rope keeps for q and k alike
        plgpu.store(k_pe_ref.at[layer, block, offset, pairs], (x1 * cos - x2 * sin).astype(dtype), mask=r_ok)
        plgpu.store(k_pe_ref.at[layer, block, offset, half + pairs], (x2 * cos + x1 * sin).astype(dtype), mask=r_ok)


@functools.partial(jax.jit, static_argnames=("eps", "inv_freq", "cos_sin_scale", "interleave", "interpret"),
                   donate_argnums=(0, 1))
def write_latents(c_kv, k_pe, kv, slots, positions, layer, norm, norm_index, *, eps: float, inv_freq: tuple[float, ...],
                  cos_sin_scale: float, interleave: bool, interpret: bool = False):
    """c_kv [L, N, bs, C], k_pe [L, N, bs, R] (donated: updated in place) <- the step's tokens at layer
    ``layer``: kv f32[T, C + R] (kv_a_proj's output), slots i32[T] (block * bs + offset; >= N * bs:
    padding, not stored), positions i32[T], kv_a_norm's weights ``norm[norm_index]`` (``norm``: a layer
    stack's [Ln, C]; ``layer`` counts all the cache's layers, ``norm_index`` the stack's). Stores
    RMSNorm(kv[:, :C]) and rope(kv[:, C:]) as ``write_latents_reference`` -> (c_kv, k_pe)."""
    num_blocks, block_size, latent_dim = c_kv.shape[1:]
    rope_dim = k_pe.shape[-1]
    if k_pe.shape[:3] != c_kv.shape[:3] or kv.shape[-1] != latent_dim + rope_dim or norm.shape[-1] != latent_dim:
        raise ValueError(f"write_latents: c_kv {c_kv.shape}, k_pe {k_pe.shape}, kv {kv.shape}, norm {norm.shape} "
                         "do not match; expected [L, N, bs, C], [L, N, bs, R], [T, C + R], [Ln, C]")
    kernel = functools.partial(_write_kernel, latent_dim=latent_dim, rope_dim=rope_dim, eps=eps,
                               cos_sin_scale=cos_sin_scale, interleave=interleave, block_size=block_size,
                               num_slots=num_blocks * block_size)
    return pl.pallas_call(
        kernel,
        grid=(kv.shape[0],),
        out_shape=(jax.ShapeDtypeStruct(c_kv.shape, c_kv.dtype), jax.ShapeDtypeStruct(k_pe.shape, k_pe.dtype)),
        input_output_aliases={7: 0, 8: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="write_latents",
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(norm_index, jnp.int32).reshape(1), slots.astype(jnp.int32), positions.astype(jnp.int32),
      kv.astype(jnp.float32), norm, jnp.asarray(np.asarray(inv_freq, np.float32)), c_kv, k_pe)


def write_latents_reference(c_kv, k_pe, kv, slots, positions, layer, norm, norm_index, *, eps: float, inv_freq, cos_sin_scale,
                            interleave: bool):
    """``write_latents`` in plain jnp (dsjax.model.norms.RMSNorm and dsjax.model.rope.apply_rope's math)."""
    dtype, latent_dim, block_size = c_kv.dtype, c_kv.shape[-1], c_kv.shape[2]
    kv = kv.astype(dtype).astype(jnp.float32)
    c = kv[:, :latent_dim]
    c = norm[norm_index] * (c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps)).astype(dtype)
    r = kv[:, latent_dim:]
    x1, x2 = (r[:, 0::2], r[:, 1::2]) if interleave else jnp.split(r, 2, axis=-1)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(np.asarray(inv_freq, np.float32))
    cos, sin = jnp.cos(freqs) * cos_sin_scale, jnp.sin(freqs) * cos_sin_scale
    r = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    blocks, offsets = slots // block_size, slots % block_size
    return (c_kv.at[layer, blocks, offsets].set(c.astype(dtype), mode="drop"),
            k_pe.at[layer, blocks, offsets].set(r.astype(dtype), mode="drop"))
