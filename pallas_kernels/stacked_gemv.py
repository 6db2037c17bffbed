"""Skinny products of a decode step: a few token rows times one layer's weight of a stacked [L, K, N]
array, read in place.

At decode sizes (a few rows) an attention projection is a weight stream. XLA lowers such a product
inside the layer scan as a reduction: for ``q_proj`` it transposes the whole stacked weight once a
step so the reduced axis is minor (327 MB written at V2-Lite, batch 1), for ``o_proj`` it
materializes the [H, V, D] elementwise product before reducing it, and ``kv_a_proj`` (576 outputs)
reduces at 0.5 TB/s on the H200 (``benchmarks/results/decode_profile.md``, round 4).

This kernel reads layer ``layer``'s [K, N] slice row-major where it lies. A program owns one N tile
and one K split: it streams block_k x block_n weight tiles, multiplies all token rows (up to 64,
zero-padded to a power of two of at least 16, Triton's smallest dot) into an f32 accumulator, and
stores its partial sum for the real rows; the K splits' partials are added outside (XLA fuses that
small sum into its consumer). Splits grow until the grid holds about ``TARGET_WAVES`` programs per
SM, so even one token keeps every SM streaming.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import dot_precision

MAX_ROWS = 64  # token rows a call takes (the engine uses it up to dispatch.STACKED_GEMV_MAX_TOKENS)
NUM_SMS = 132  # H100 / H200 SXM
TARGET_WAVES = 2
# H200 sweep (2026-12-01, one token, V2-Lite q_proj / o_proj / kv_a / shared-expert shapes, nine tile
# configs): the best per shape beat these by 3-6% (15% less time at the shared experts' 2816 -> 2048 down
# projection, with 128 x 128 tiles and 8 splits), and none was best everywhere; these are the ones the
# GPU tests and the engine numbers ran with. The kernel alone streams ~3.4 TB/s at q_proj's 12.6 MB;
# summing the partials adds ~1 µs.
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 128, 4, 3


def _gemv_kernel(layer_ref, x_ref, w_ref, o_ref, *, block_m, block_k, block_n, k_per_split, num_rows):
    # layer_ref i32[1]; x_ref [M, K]; w_ref [L, K, N]; o_ref f32[S * M, N]: split s's partial at rows s*M..
    n_tile, split = pl.program_id(0), pl.program_id(1)
    depth, width = w_ref.shape[1:]
    layer = layer_ref[0]
    n0 = n_tile * block_n
    cols = n0 + jnp.arange(block_n)
    rows = jnp.arange(block_m)
    row_ok = rows < num_rows
    k_start = split * k_per_split

    def body(i, acc):  # acc f32[block_m, block_n]
        k0 = pl.multiple_of(k_start + i * block_k, block_k)
        ks = k0 + jnp.arange(block_k)
        k_ok = ks < depth
        x = plgpu.load(x_ref.at[jnp.where(row_ok, rows, 0)[:, None], ks[None, :]],
                       mask=row_ok[:, None] & k_ok[None, :], other=0)
        mask = k_ok[:, None] if width % block_n == 0 else k_ok[:, None] & (cols < width)[None, :]
        w = plgpu.load(w_ref.at[layer, pl.ds(k0, block_k), pl.ds(n0, block_n)], mask=mask, other=0)
        return acc + jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32,
                             precision=dot_precision(w.dtype))

    acc = jax.lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
    # Padding rows point past this split's rows (into the next split's, or past the array): masked off.
    plgpu.store(o_ref.at[(split * num_rows + rows)[:, None], cols[None, :]], acc,
                mask=row_ok[:, None] & (cols < width)[None, :])


def default_splits(depth: int, width: int, block_n: int, block_k: int) -> int:
    """Smallest power of two of K splits that gives the grid TARGET_WAVES programs an SM, but never a
    split shorter than one block_k step."""
    n_tiles = pl.cdiv(width, block_n)
    max_splits = max(1, depth // block_k)
    splits = 1
    while n_tiles * splits < TARGET_WAVES * NUM_SMS and splits * 2 <= max_splits:
        splits *= 2
    return splits


@functools.partial(jax.jit, static_argnames=("num_splits", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def stacked_gemv(x, w, layer, *, num_splits=None, block_n=BLOCK_N, block_k=BLOCK_K, num_warps=NUM_WARPS,
                 num_stages=NUM_STAGES, interpret=False):
    """x [M, K] (M <= ``MAX_ROWS``) @ w[layer] for a stacked w [L, K, N] and a traced layer index ->
    f32[M, N]. The layer's weights are read in place (no slice copy), once for all M rows."""
    num_rows, depth = x.shape
    if w.ndim != 3 or w.shape[1] != depth:
        raise ValueError(f"stacked_gemv: w has shape {w.shape}; expected [L, K={depth}, N]")
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"stacked_gemv: x has {num_rows} rows; accepted 1 to {MAX_ROWS} (decode sizes)")
    width = w.shape[2]
    num_splits = num_splits or default_splits(depth, width, block_n, block_k)
    k_per_split = pl.cdiv(pl.cdiv(depth, num_splits), block_k) * block_k
    kernel = functools.partial(_gemv_kernel, block_m=max(16, pl.next_power_of_2(num_rows)), block_k=block_k,
                               block_n=block_n, k_per_split=k_per_split, num_rows=num_rows)
    partials = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(width, block_n), num_splits),
        out_shape=jax.ShapeDtypeStruct((num_splits * num_rows, width), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"stacked_gemv_s{num_splits}",
    )(jnp.asarray(layer, jnp.int32).reshape(1), x, w)
    return partials.reshape(num_splits, num_rows, width).sum(axis=0)


def stacked_gemv_reference(x, w, layer):
    return jnp.dot(x, w[layer], preferred_element_type=jnp.float32)
