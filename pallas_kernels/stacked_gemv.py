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
SM, so even one token keeps every SM streaming. Several weights that take the same rows (a layer's
q and kv_a projections; its router and shared experts' gate and up) share one launch, and the
sublayer's RMSNorm rides along (``stacked_gemvs``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import dot_precision, inv_rms, scale_rows, shrink_for_itemsize

MAX_ROWS = 64  # token rows a call takes (the engine uses it up to dispatch.STACKED_GEMV_MAX_TOKENS)
NUM_SMS = 132  # H100 / H200 SXM
TARGET_WAVES = 2
# H200 sweep (2026-12-01, one token, V2-Lite q_proj / o_proj / kv_a / shared-expert shapes, nine tile
# configs): the best per shape beat these by 3-6% (15% less time at the shared experts' 2816 -> 2048 down
# projection, with 128 x 128 tiles and 8 splits), and none was best everywhere; these are the ones the
# GPU tests and the engine numbers ran with. The kernel alone streams ~3.4 TB/s at q_proj's 12.6 MB;
# summing the partials adds ~1 µs. In the compiled batch-1 step (decode_profile.md round 14: 2.309 ms
# as built) no other tile or split knob was faster, and one row's products as multiply-adds instead of
# padded dots cost 2.350-2.448 ms (code in git 75b3671).
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 128, 4, 3
# A launch with the RMSNorm folded in and at least this many output columns in all takes 128-column
# tiles: H200, one token (2026-12-01, kernels_gemv.fused_launches): norm + q + kv_a 9.4 µs against 12.2
# at 64 columns, norm + router + shared gate / up 13.6 against 15.9.
WIDE_BLOCK_N, WIDE_MIN_WIDTH = 128, 2048


class _Weight(NamedTuple):
    """One weight's share of a ``stacked_gemvs`` grid: programs [start, start + tiles * splits)."""
    start: int
    tiles: int
    width: int
    block_k: int
    k_per_split: int


def _gemvs_kernel(layer_ref, x_ref, *refs, weights, splits, block_m, block_n, num_rows, depth, scaled):
    # layer_ref i32[1]; x_ref [M, K]; then (every layer's norm weights g [L, K]) when scaled; one stacked
    # w_ref [L, K, N_i] per weight; outputs: f32[S * M, N_i] per weight (split s's partial at rows
    # s*M..), then (f32[S * M]: split s's sum of x*x per row) when scaled. Scaled, the products are of
    # x * g: the caller applies each row's 1 / rms once the splits are summed.
    refs = list(refs)
    norm_ref = refs.pop(0) if scaled else None
    w_refs, o_refs = refs[:len(weights)], refs[len(weights):2 * len(weights)]
    pid, layer = pl.program_id(0), layer_ref[0]
    rows = jnp.arange(block_m)
    row_ok = rows < num_rows
    safe_rows = jnp.where(row_ok, rows, 0)[:, None]

    for w_ref, o_ref, weight in zip(w_refs, o_refs, weights):
        @pl.when((pid >= weight.start) & (pid < weight.start + weight.tiles * splits))
        def _(w_ref=w_ref, o_ref=o_ref, weight=weight):
            local = pid - weight.start
            n_tile, split = local // splits, local % splits
            n0 = n_tile * block_n
            cols = n0 + jnp.arange(block_n)
            k_start = split * weight.k_per_split
            block_k = weight.block_k

            def body(i, carry):  # acc f32[block_m, block_n], sum of squares f32[block_m]
                acc, squares = carry
                k0 = pl.multiple_of(k_start + i * block_k, block_k)
                ks = k0 + jnp.arange(block_k)
                k_ok = ks < depth
                x = plgpu.load(x_ref.at[safe_rows, ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
                if scaled:
                    x32 = x.astype(jnp.float32)
                    squares = squares + jnp.sum(x32 * x32, axis=1)
                    x = plgpu.load(norm_ref.at[layer, ks], mask=k_ok, other=0)[None, :] * x
                mask = k_ok[:, None] if weight.width % block_n == 0 else k_ok[:, None] & (cols < weight.width)[None, :]
                w = plgpu.load(w_ref.at[layer, pl.ds(k0, block_k), pl.ds(n0, block_n)], mask=mask, other=0)
                return acc + _dot(x, w), squares

            acc, squares = jax.lax.fori_loop(
                0, weight.k_per_split // block_k, body,
                (jnp.zeros((block_m, block_n), jnp.float32), jnp.zeros((block_m,), jnp.float32)))
            # Padding rows point past this split's rows (into the next split's, or past the array): masked
            # off. (Aliasing them onto row 0 would let interpret mode's masked scatter write row 0 back.)
            out_rows = split * num_rows + rows
            plgpu.store(o_ref.at[out_rows[:, None], cols[None, :]], acc,
                        mask=row_ok[:, None] & (cols < weight.width)[None, :])
            if scaled and weight.start == 0:  # the first weight's first column tile reports the squares
                plgpu.store(refs[-1].at[out_rows], squares, mask=row_ok & (n_tile == 0))


def _dot(x, w):
    """f32 products of a [block_m, block_k] row tile and a [block_k, block_n] weight tile."""
    if w.dtype == jnp.float32 and x.dtype == jnp.bfloat16:
        # A f32 weight (the router) against bf16 rows, which are exact in bf16: w = hi + lo, both bf16,
        # keeps ~16 of w's 24 mantissa bits on the tensor cores. IEEE f32 products run on the CUDA
        # cores, and the router's few programs then became the launch's tail at 64 rows.
        hi = w.astype(jnp.bfloat16)
        lo = (w - hi.astype(jnp.float32)).astype(jnp.bfloat16)
        return (jnp.dot(x, hi, preferred_element_type=jnp.float32)
                + jnp.dot(x, lo, preferred_element_type=jnp.float32))
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32, precision=dot_precision(w.dtype))


def _k_per_split(depth: int, splits: int, block_k: int) -> int:
    """K rows each of ``splits`` programs covers: a whole number of block_k steps."""
    return pl.cdiv(pl.cdiv(depth, splits), block_k) * block_k


def default_splits(depth: int, width: int, block_n: int, block_k: int) -> int:
    """Smallest power of two of K splits that gives the grid TARGET_WAVES programs an SM, but never a
    split shorter than one block_k step. ``width``: the summed output columns of every weight."""
    n_tiles = pl.cdiv(width, block_n)
    max_splits = max(1, depth // block_k)
    splits = 1
    while n_tiles * splits < TARGET_WAVES * NUM_SMS and splits * 2 <= max_splits:
        splits *= 2
    return splits


@functools.partial(jax.jit, static_argnames=("eps", "num_splits", "block_n", "block_k", "num_warps", "num_stages",
                                             "partials", "interpret"))
def stacked_gemvs(x, ws, layer, norm=None, *, eps=None, num_splits=None, block_n=None, block_k=BLOCK_K,
                  num_warps=NUM_WARPS, num_stages=NUM_STAGES, partials=False, interpret=False):
    """x [M, K] (M <= ``MAX_ROWS``) @ w[layer] for each stacked w [L, K, N_i] of ``ws`` (any float
    dtypes), one launch for all -> tuple of f32[M, N_i]. The layer's weights are read in place (no slice
    copy), once for all M rows.

    With ``norm`` (every layer's RMSNorm weights g [L, K]) and ``eps``, the products are of
    RMSNorm(x) (``dsjax.model.norms.RMSNorm``), and the normed rows [M, K] come back as a last element:
    the kernel streams x * g and each row's sum of squares (no pass over x before the weights), and the
    1 / rms scale multiplies the summed products; equal to norm-then-product up to the rounding of x's
    dtype. Tiles of 4-byte weights are half as deep (the same bytes in shared memory). Unset, block_n
    is ``WIDE_BLOCK_N`` for a normed launch of ``WIDE_MIN_WIDTH`` columns or more, else ``BLOCK_N``.

    ``partials``: the unsummed split-K partials come back instead, f32[S * M, N_i] per weight (split s's
    rows at s * M), then with ``norm`` the rows' partial sums of squares f32[S * M] (of x, not x * g),
    for a consumer that adds them itself (``latent_write.write_latents``)."""
    ws = tuple(ws)
    num_rows, depth = x.shape
    for w in ws:
        if w.ndim != 3 or w.shape[1] != depth or w.shape[0] != ws[0].shape[0]:
            raise ValueError(f"stacked_gemvs: w has shape {w.shape}; expected [L={ws[0].shape[0]}, K={depth}, N]")
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"stacked_gemvs: x has {num_rows} rows; accepted 1 to {MAX_ROWS} (decode sizes)")
    if (norm is None) != (eps is None) or (norm is not None and norm.shape != (ws[0].shape[0], depth)):
        raise ValueError(f"stacked_gemvs: norm needs eps and shape [L, K={depth}]; got "
                         f"{None if norm is None else norm.shape}, eps={eps}")
    blocks_k = [shrink_for_itemsize(block_k, num_stages, w.dtype.itemsize)[0] for w in ws]
    width = sum(w.shape[2] for w in ws)
    block_n = block_n or (WIDE_BLOCK_N if norm is not None and width >= WIDE_MIN_WIDTH else BLOCK_N)
    splits = num_splits or default_splits(depth, width, block_n, max(blocks_k))
    weights, start = [], 0
    for w, bk in zip(ws, blocks_k):
        tiles = pl.cdiv(w.shape[2], block_n)
        weights.append(_Weight(start, tiles, w.shape[2], bk, _k_per_split(depth, splits, bk)))
        start += tiles * splits
    kernel = functools.partial(_gemvs_kernel, weights=tuple(weights), splits=splits,
                               block_m=max(16, pl.next_power_of_2(num_rows)), block_n=block_n, num_rows=num_rows,
                               depth=depth, scaled=norm is not None)
    out_shape = [jax.ShapeDtypeStruct((splits * num_rows, w.shape[2]), jnp.float32) for w in ws]
    if norm is not None:
        out_shape.append(jax.ShapeDtypeStruct((splits * num_rows,), jnp.float32))
    outs = pl.pallas_call(
        kernel,
        grid=(start,),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"stacked_gemv{len(ws) if len(ws) > 1 else ''}{'_norm' if norm is not None else ''}_s{splits}",
    )(jnp.asarray(layer, jnp.int32).reshape(1), x, *([norm] if norm is not None else []), *ws)
    if partials:
        return tuple(outs)
    products = tuple(p.reshape(splits, num_rows, -1).sum(axis=0) for p in outs[:len(ws)])
    if norm is None:
        return products
    # RMSNorm(x) @ w = (1 / rms) * ((x * g) @ w): each row's scale, once the splits' squares are summed.
    scale = inv_rms(outs[-1].reshape(splits, num_rows).sum(axis=0), depth, eps)[:, None]
    g = jax.lax.dynamic_index_in_dim(norm, layer, keepdims=False)
    return tuple(scale * p for p in products) + (scale_rows(x, g, scale),)


def stacked_gemv(x, w, layer, **options):
    """x [M, K] @ w[layer] for one stacked w [L, K, N] -> f32[M, N] (``stacked_gemvs`` with one weight)."""
    return stacked_gemvs(x, (w,), layer, **options)[0]


def stacked_gemv_reference(x, w, layer):
    return jnp.dot(x, w[layer], preferred_element_type=jnp.float32)


def _head_kernel(layer_ref, x_ref, w_ref, o_ref, *, block_m, block_n, block_k, k_per_split, num_rows, depth,
                 width, contract_rows):
    # x_ref [M, H * K] (head h's K inputs at columns h*K..); w_ref [L, R, H * C]; o_ref f32[S * M, H * N].
    # contract_rows: K = R, N = C (w's rows against the inputs); else K = C, N = R (w's head columns).
    head, n_tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    rows = jnp.arange(block_m)
    row_ok = rows < num_rows
    cols = n_tile * block_n + jnp.arange(block_n)
    col_ok = cols < width
    k_start = split * k_per_split

    def body(i, acc):
        ks = k_start + i * block_k + jnp.arange(block_k)
        k_ok = ks < depth
        x = plgpu.load(x_ref.at[jnp.where(row_ok, rows, 0)[:, None], (head * depth + ks)[None, :]],
                       mask=row_ok[:, None] & k_ok[None, :], other=0)
        if contract_rows:  # tile [block_k, block_n] of w[layer, ks, head's columns]
            w = plgpu.load(w_ref.at[layer, ks[:, None], (head * width + cols)[None, :]],
                           mask=k_ok[:, None] & col_ok[None, :], other=0)
        else:  # tile [block_n, block_k] of w[layer, cols, head's columns ks], used transposed
            w = plgpu.load(w_ref.at[layer, cols[:, None], (head * depth + ks)[None, :]],
                           mask=col_ok[:, None] & k_ok[None, :], other=0).T
        return acc + _dot(x, w)

    acc = jax.lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(o_ref.at[(split * num_rows + rows)[:, None], (head * width + cols)[None, :]], acc.astype(o_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


# K rows a head-product step streams, by direction (contract_rows): H200, one token, V2-Lite
# (2026-12-01, kernels_gemv.head_products): w_uk 1.84 µs at 128 (one split of its 128-deep heads) against
# 2.87 at 64; w_uv 3.0 at 64.
HEAD_BLOCK_K = {False: 128, True: 64}


@functools.partial(jax.jit, static_argnames=("contract_rows", "num_splits", "block_n", "block_k", "num_warps",
                                             "num_stages", "out_dtype", "interpret"))
def stacked_head_gemv(x, w, layer, *, contract_rows: bool, num_splits=None, block_n=BLOCK_N, block_k=None,
                      num_warps=NUM_WARPS, num_stages=NUM_STAGES, out_dtype=jnp.float32, interpret=False):
    """Per-head products of a few token rows with one layer of a stacked per-head weight w [L, R, H, C],
    read in place: x [M, H, R] -> f32[M, H, C] contracting w's rows (``contract_rows``; MLA's w_uv: the
    attended latent to each head's values), else x [M, H, C] -> f32[M, H, R] contracting each head's C
    columns (w_uk: a head's nope query into the latent space). One program per (head, output tile, K
    split); the splits' partials are summed outside, or with one split the kernel stores ``out_dtype``
    itself. block_k unset: ``HEAD_BLOCK_K`` of the direction."""
    num_rows, num_heads = x.shape[:2]
    if w.ndim != 4 or w.shape[2] != num_heads or x.ndim != 3 or x.shape[2] != w.shape[1 if contract_rows else 3]:
        raise ValueError(f"stacked_head_gemv: x {x.shape} and w {w.shape} do not match; expected x [M, H, "
                         f"{'R' if contract_rows else 'C'}] and w [L, R, H, C]")
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"stacked_head_gemv: x has {num_rows} rows; accepted 1 to {MAX_ROWS} (decode sizes)")
    depth = x.shape[2]
    width = w.shape[3] if contract_rows else w.shape[1]
    block_k = block_k or HEAD_BLOCK_K[contract_rows]
    n_tiles = pl.cdiv(width, block_n)
    splits = num_splits or default_splits(depth, num_heads * width, block_n, block_k)
    k_per_split = _k_per_split(depth, splits, block_k)
    kernel = functools.partial(_head_kernel, block_m=max(16, pl.next_power_of_2(num_rows)), block_n=block_n,
                               block_k=block_k, k_per_split=k_per_split, num_rows=num_rows, depth=depth, width=width,
                               contract_rows=contract_rows)
    partials = pl.pallas_call(
        kernel,
        grid=(num_heads, n_tiles, splits),
        out_shape=jax.ShapeDtypeStruct((splits * num_rows, num_heads * width), jnp.float32 if splits > 1 else out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"stacked_head_gemv_s{splits}",
    )(jnp.asarray(layer, jnp.int32).reshape(1), x.reshape(num_rows, -1), w.reshape(*w.shape[:2], -1))
    if splits == 1:
        return partials.reshape(num_rows, num_heads, width)
    return partials.reshape(splits, num_rows, num_heads, width).sum(axis=0).astype(out_dtype)


def stacked_head_gemv_reference(x, w, layer, *, contract_rows: bool):
    spec = "mhr,rhc->mhc" if contract_rows else "mhc,rhc->mhr"
    return jnp.einsum(spec, x, w[layer], preferred_element_type=jnp.float32)
