"""Grouped expert GEMMs over expert-sorted rows: the fused gate/up SwiGLU and the down projection.

Rows arrive sorted by expert (``group_sizes[e]`` consecutive rows per expert, see
``moe_sort.sort_by_expert``). Each program locates its own M tile from group_sizes (``locate_tile``):
each expert's rows are cut into M tiles of block_m rows that never straddle experts, a tile starting
at its expert's first row plus a multiple of block_m and masking rows past its expert's end, so no
padded copy of the activations is needed. The grid has a static worst-case length; tiles past the
real count do nothing. Empty experts get no tiles and read no weights. In the MoE layer the token
gather (SwiGLU) and the scatter back to (token, slot) order (down projection) happen inside the
kernels too, so only the combine runs outside them.

Program order puts the N tiles of one M tile next to each other and the M tiles of one expert next to
each other: an expert held in one M tile (decode, with the table's block_m) reads each weight tile from
HBM exactly once; one spread over several M tiles runs them together, so the repeats hit L2. An
activation tile is reused from L2 across its N tiles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import dot_precision, shrink_for_itemsize, swiglu_accumulators


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Picked by the average rows per expert (M / E), first row whose bound is not exceeded. Decode is
# weight-bandwidth bound: block_m sized so most experts fit one M tile (their weights stream from
# HBM once per N tile), narrow N tiles so enough programs keep every SM streaming. Prefill is MMA
# bound: 128-row tiles (SwiGLU: two 128x128 f32 accumulators, 8 warps).
SWIGLU_TILES = (
    (8, TileConfig(16, 64, 128, 4, 4)),
    (16, TileConfig(32, 64, 128, 4, 4)),
    (64, TileConfig(32, 128, 64, 4, 4)),  # H200 sweep, V2-Lite T=256: 3.76 TB/s of weights
    (None, TileConfig(128, 128, 64, 8, 4)),  # H200 sweep, V2-Lite T=8192: 481 TFLOP/s
)
DOWN_TILES = (
    (8, TileConfig(16, 64, 128, 4, 4)),
    (16, TileConfig(32, 64, 128, 4, 4)),
    # H200 sweep, V2-Lite T=256: 3.39-3.43 TB/s for block_m 32 or 64; 32 as in SWIGLU_TILES lets the
    # MoE layer compute one tile schedule for both kernels.
    (64, TileConfig(32, 128, 64, 4, 4)),
    (None, TileConfig(128, 256, 64, 8, 3)),  # H200 sweep, V2-Lite T=8192: 476 TFLOP/s
)
# (benchmarks/results/moe_h200.json holds the whole sweep.)


def pick_config(table, num_rows: int, num_experts: int, width: int, depth: int, itemsize: int = 2,
                **overrides) -> TileConfig:
    """Table entry for M rows over E experts of [depth, width] weights, explicit overrides applied,
    blocks clamped to the problem (at least 16, Triton's smallest dot)."""
    rows_per_expert = num_rows / max(num_experts, 1)
    config = next(c for bound, c in table if bound is None or rows_per_expert <= bound)
    block_k, num_stages = shrink_for_itemsize(config.block_k, config.num_stages, itemsize)
    config = config._replace(block_k=block_k, num_stages=num_stages)
    config = config._replace(**{k: v for k, v in overrides.items() if v is not None})
    fit = lambda block, dim: max(16, min(block, pl.next_power_of_2(dim)))
    return config._replace(block_m=fit(config.block_m, num_rows),
                           block_n=fit(config.block_n, width), block_k=fit(config.block_k, depth))


def locate_tile(group_sizes, tile, *, block_m: int, num_rows: int, num_experts: int):
    """group_sizes i32[E'] (entries past E zero), M tile index -> (expert, first row, end row).

    Each expert takes cdiv(size, block_m) consecutive M tiles, in expert order: a tile starts at its
    expert's first row plus a multiple of block_m and ends (exclusive) at the expert's end, so no tile
    straddles experts. Tiles past the last get (0, 0, 0): no rows. Plain jnp on an [E'] vector, so each
    kernel program locates its own tile (one cumsum and a few sums over E: no schedule array, and no
    XLA op between the expert sort and the kernel) and ``tile_schedule`` lays out the same for tests.
    """
    sizes = group_sizes.astype(jnp.int32)
    expert_id = jnp.arange(sizes.shape[0], dtype=jnp.int32)
    tiles = (sizes + block_m - 1) // block_m
    before = jnp.cumsum(tiles) <= tile  # experts whose tiles all come earlier: a prefix of them
    expert = jnp.sum(jnp.where(before, 1, 0))
    start = jnp.sum(jnp.where(before, sizes, 0))
    first = start + (tile - jnp.sum(jnp.where(before, tiles, 0))) * block_m
    end = jnp.minimum(start + jnp.sum(jnp.where(expert_id == expert, sizes, 0)), num_rows)
    used = expert < num_experts
    return jnp.where(used, expert, 0), jnp.where(used, first, 0), jnp.where(used, end, 0)


def num_m_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static worst case of sum_e cdiv(size_e, block_m) <= (M + n(block_m-1)) / block_m, with
    n = min(E, M) non-empty experts: the grid's M extent (tiles past the real count do nothing)."""
    return max(1, (num_rows + min(num_experts, num_rows) * (block_m - 1)) // block_m)


def tile_schedule(group_sizes, num_rows: int, block_m: int):
    """group_sizes i32[E] -> i32[3, num_tiles]: (expert, first row, end row) of every M tile, as the
    kernel programs locate them."""
    num_experts = group_sizes.shape[0]
    locate = functools.partial(locate_tile, group_sizes, block_m=block_m, num_rows=num_rows,
                               num_experts=num_experts)
    tiles = jnp.arange(num_m_tiles(num_rows, num_experts, block_m), dtype=jnp.int32)
    return jnp.stack(jax.vmap(locate)(tiles))


def _load_weight_tile(w_ref, expert, k0, n0, *, block_k, block_n, depth, width):
    """w_ref [E, K, N] -> [block_k, block_n] at (expert, k0, n0), zero past K and N."""
    window = w_ref.at[expert, pl.ds(k0, block_k), pl.ds(n0, block_n)]
    mask = None
    if depth % block_k:
        mask = (k0 + jnp.arange(block_k) < depth)[:, None]
    if width % block_n:
        col_ok = (n0 + jnp.arange(block_n) < width)[None, :]
        mask = col_ok if mask is None else mask & col_ok
    if mask is None:
        return plgpu.load(window)
    return plgpu.load(window, mask=mask, other=0)


def _program_tile(group_sizes_ref, offset_ref, *, num_n_tiles, block_m, num_rows):
    """This program's expert (weights index), first row, rows [bm] and row mask, N tile, and whether
    the tile has rows.

    Unused tiles (the grid is sized for the worst case) skip all work under ``pl.when``: they load no
    weights and store nothing. (A data-dependent trip count would express the same, but the GPU's
    Triton rejects the mixed-type scf.for bounds Pallas emits for it.)
    """
    pid = pl.program_id(0)
    tile, n_tile = pid // num_n_tiles, pid % num_n_tiles
    num_experts = group_sizes_ref.shape[0]
    padded = pl.next_power_of_2(num_experts)  # Triton vectors have power-of-two lengths
    window = group_sizes_ref.at[pl.ds(0, padded)]
    sizes = (plgpu.load(window) if padded == num_experts
             else plgpu.load(window, mask=jnp.arange(padded) < num_experts, other=0))
    expert, first, end = locate_tile(sizes, tile, block_m=block_m, num_rows=num_rows,
                                     num_experts=num_experts)
    if offset_ref is not None:
        expert = expert + offset_ref[0]
    rows = first + jnp.arange(block_m)
    return expert, first, rows, rows < end, n_tile, first < end


def _optional_refs(refs, *present):
    """The kernel refs after the fixed ones: one per flag (None where absent), then the output."""
    refs = list(refs)
    taken = [refs.pop(0) if p else None for p in present]
    (out_ref,) = refs
    return *taken, out_ref


def _grouped_swiglu_kernel(group_sizes_ref, x_ref, w_gate_ref, w_up_ref, *refs, block_m, block_n,
                           block_k, num_n_tiles, num_rows, top_k, gather, has_offset):
    # group_sizes_ref i32[E]; x_ref [M, D] sorted rows, or [T, D] when gather; w_gate_ref/w_up_ref
    # [E', D, I]; (order_ref i32[M] when gather: sorted row -> assignment, token = assignment // top_k);
    # (offset_ref i32[1]); out_ref [M, I]
    order_ref, offset_ref, out_ref = _optional_refs(refs, gather, has_offset)
    depth, width = w_gate_ref.shape[1:]
    expert, first, rows, row_ok, n_tile, active = _program_tile(
        group_sizes_ref, offset_ref, num_n_tiles=num_n_tiles, block_m=block_m, num_rows=num_rows)
    n0 = n_tile * block_n
    weight_tile = functools.partial(_load_weight_tile, expert=expert, n0=n0, block_k=block_k,
                                    block_n=block_n, depth=depth, width=width)

    @pl.when(active)
    def _():
        # Rows past the expert's end read a valid row (token 0, or the tile's first) and are never
        # stored, so the K loop needs no row mask.
        if gather:
            assignment = plgpu.load(order_ref.at[pl.ds(first, block_m)], mask=row_ok, other=0)
            x_rows = assignment // top_k
        else:
            x_rows = jnp.where(row_ok, rows, first)

        acc_gate, acc_up = swiglu_accumulators(x_ref, x_rows, lambda k0: weight_tile(w_gate_ref, k0=k0),
                                               lambda k0: weight_tile(w_up_ref, k0=k0), block_m=block_m,
                                               block_n=block_n, block_k=block_k, depth=depth)
        h = jax.nn.silu(acc_gate) * acc_up
        col_ok = n0 + jnp.arange(block_n) < width
        plgpu.store(out_ref.at[pl.ds(first, block_m), pl.ds(n0, block_n)], h.astype(out_ref.dtype),
                    mask=row_ok[:, None] & col_ok[None, :])


def _grouped_matmul_kernel(group_sizes_ref, h_ref, w_ref, *refs, block_m, block_n, block_k,
                           num_n_tiles, num_rows, scatter, scaled, has_offset):
    # group_sizes_ref i32[E]; h_ref [M, I] sorted rows; w_ref [E', I, D]; (order_ref i32[M] when
    # scatter: sorted row r -> output row order[r]); (row_scale_ref f32[M] when scaled, indexed like
    # the output rows); (offset_ref i32[1]); out_ref [M, D]
    order_ref, row_scale_ref, offset_ref, out_ref = _optional_refs(refs, scatter, scaled, has_offset)
    depth, width = w_ref.shape[1:]
    expert, first, rows, row_ok, n_tile, active = _program_tile(
        group_sizes_ref, offset_ref, num_n_tiles=num_n_tiles, block_m=block_m, num_rows=num_rows)
    h_rows = jnp.where(row_ok, rows, first)
    n0 = n_tile * block_n

    def body(kk, acc):  # acc f32[bm, bn]
        k0 = pl.multiple_of(kk * block_k, block_k)
        k_idx = k0 + jnp.arange(block_k)
        h_tile = h_ref.at[h_rows[:, None], k_idx[None, :]]
        if depth % block_k:
            h = plgpu.load(h_tile, mask=(k_idx < depth)[None, :], other=0)
        else:
            h = plgpu.load(h_tile)
        w = _load_weight_tile(w_ref, expert, k0, n0, block_k=block_k, block_n=block_n,
                              depth=depth, width=width)
        return acc + jnp.dot(h, w, preferred_element_type=jnp.float32, precision=dot_precision(h.dtype))

    @pl.when(active)
    def _():
        # Destination rows and scales load before the K loop, so their latency hides behind it.
        # Masked rows point past the output (interpret mode's scatter then drops them; the GPU's
        # masked lanes touch nothing).
        out_rows = (plgpu.load(order_ref.at[pl.ds(first, block_m)], mask=row_ok, other=out_ref.shape[0])
                    if scatter else rows)
        if scaled:
            scale = plgpu.load(row_scale_ref.at[out_rows], mask=row_ok, other=0.0).astype(jnp.float32)
        acc = jax.lax.fori_loop(0, pl.cdiv(depth, block_k), body, jnp.zeros((block_m, block_n), jnp.float32))
        if scaled:
            acc = acc * scale[:, None]
        cols = n0 + jnp.arange(block_n)
        plgpu.store(out_ref.at[out_rows[:, None], cols[None, :]], acc.astype(out_ref.dtype),
                    mask=row_ok[:, None] & (cols < width)[None, :])


def _check_groups(name, rows_arg, group_sizes, weights, expert_offset):
    num_groups = group_sizes.shape[0] if group_sizes.ndim == 1 else -1
    if expert_offset is None and group_sizes.shape != (weights.shape[0],):
        raise ValueError(f"{name}: group_sizes has shape {group_sizes.shape}; expected "
                         f"({weights.shape[0]},), one count per expert of the weights")
    if expert_offset is not None and (num_groups < 1 or weights.shape[0] % num_groups):
        raise ValueError(f"{name}: with expert_offset the weights hold several layers' experts, a "
                         f"multiple of len(group_sizes)={num_groups}; got {weights.shape[0]}")
    if rows_arg.shape[-1] != weights.shape[1]:
        raise ValueError(f"{name}: activations have {rows_arg.shape[-1]} features but the weights "
                         f"[E, K, N] have K={weights.shape[1]}")


def _optional_operands(order, *others, expert_offset):
    """Kernel operands after the fixed ones, those given, in order; expert_offset last as i32[1]."""
    offset = None if expert_offset is None else jnp.asarray(expert_offset, jnp.int32).reshape(1)
    order = None if order is None else order.astype(jnp.int32)
    return [op for op in (order, *others, offset) if op is not None]


@functools.partial(jax.jit, static_argnames=("top_k", "block_m", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def grouped_swiglu(x, group_sizes, w_gate, w_up, *, order=None, top_k: int = 1, expert_offset=None,
                   block_m=None, block_n=None, block_k=None, num_warps=None, num_stages=None,
                   interpret=False):
    """silu(x @ w_gate[e]) * (x @ w_up[e]) for each expert's rows, both GEMMs in one kernel.

    x [M, D] (rows sorted by expert), group_sizes i32[E] (sum <= M), w_gate/w_up [E, D, I]
    -> [M, I] in x.dtype. With ``order`` i32[M] (``moe_sort.sort_by_expert``'s), x is instead the
    tokens [T, D] and sorted row r is x[order[r] // top_k], gathered inside the kernel (saves writing
    the sorted copy). Rows past sum(group_sizes) are left unspecified. ``expert_offset`` (i32 scalar,
    may be traced): group e uses weights[e + expert_offset], so w_* can hold every layer's experts
    flattened [L*E, D, I] and a layer loop passes offset layer*E: a kernel operand cut out of a
    stacked array would be copied each layer, this way nothing is.
    """
    _check_groups("grouped_swiglu", x, group_sizes, w_gate, expert_offset)
    num_experts = group_sizes.shape[0]
    depth, width = w_gate.shape[1:]
    num_rows = x.shape[0] if order is None else order.shape[0]
    config = pick_config(SWIGLU_TILES, num_rows, num_experts, width, depth, w_gate.dtype.itemsize,
                         block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                         num_stages=num_stages)
    num_n_tiles = pl.cdiv(width, config.block_n)
    kernel = functools.partial(_grouped_swiglu_kernel, block_m=config.block_m,
                               block_n=config.block_n, block_k=config.block_k,
                               num_n_tiles=num_n_tiles, num_rows=num_rows, top_k=top_k,
                               gather=order is not None, has_offset=expert_offset is not None)
    return pl.pallas_call(
        kernel,
        grid=(num_m_tiles(num_rows, num_experts, config.block_m) * num_n_tiles,),
        out_shape=jax.ShapeDtypeStruct((num_rows, width), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="grouped_swiglu",
    )(group_sizes.astype(jnp.int32), x, w_gate, w_up,
      *_optional_operands(order, expert_offset=expert_offset))


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def grouped_matmul(h_sorted, group_sizes, w, *, order=None, row_scale=None, out_dtype=None,
                   expert_offset=None, block_m=None, block_n=None, block_k=None, num_warps=None,
                   num_stages=None, interpret=False):
    """(h @ w[e]) * row_scale for each expert's rows: the MoE down projection.

    h_sorted [M, I] (rows sorted by expert), group_sizes i32[E], w [E, I, D] -> [M, D] in out_dtype
    (default h.dtype). Without ``order`` the output rows stay sorted; with ``order`` i32[M]
    (``moe_sort.sort_by_expert``'s) sorted row r is stored at row order[r], back in (token, slot)
    order, so the MoE combine needs no gather. row_scale f32[M] or None is indexed like the output
    rows (the routing weight of each, applied to the f32 accumulator). Output rows no group row maps
    to are left unspecified. ``expert_offset``: as in ``grouped_swiglu``.
    """
    _check_groups("grouped_matmul", h_sorted, group_sizes, w, expert_offset)
    num_experts = group_sizes.shape[0]
    depth, width = w.shape[1:]
    num_rows = h_sorted.shape[0]
    config = pick_config(DOWN_TILES, num_rows, num_experts, width, depth, w.dtype.itemsize,
                         block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                         num_stages=num_stages)
    num_n_tiles = pl.cdiv(width, config.block_n)
    kernel = functools.partial(_grouped_matmul_kernel, block_m=config.block_m,
                               block_n=config.block_n, block_k=config.block_k,
                               num_n_tiles=num_n_tiles, num_rows=num_rows, scatter=order is not None,
                               scaled=row_scale is not None, has_offset=expert_offset is not None)
    return pl.pallas_call(
        kernel,
        grid=(num_m_tiles(num_rows, num_experts, config.block_m) * num_n_tiles,),
        out_shape=jax.ShapeDtypeStruct((num_rows, width), out_dtype or h_sorted.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(group_sizes.astype(jnp.int32), h_sorted, w,
      *_optional_operands(order, row_scale, expert_offset=expert_offset))


def _row_experts(group_sizes, num_rows):
    """i32[M]: expert of each sorted row; E for rows past sum(group_sizes)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.sum(ends[None, :] <= jnp.arange(num_rows)[:, None], axis=1)


def grouped_swiglu_reference(x_sorted, group_sizes, w_gate, w_up):
    """Per-expert loop in plain jnp (every expert over all rows, then masked); zeros past the groups."""
    row_experts = _row_experts(group_sizes, x_sorted.shape[0])
    out = jnp.zeros((x_sorted.shape[0], w_gate.shape[2]), jnp.float32)
    for e in range(w_gate.shape[0]):
        gate = jnp.dot(x_sorted, w_gate[e], preferred_element_type=jnp.float32)
        up = jnp.dot(x_sorted, w_up[e], preferred_element_type=jnp.float32)
        out = jnp.where((row_experts == e)[:, None], jax.nn.silu(gate) * up, out)
    return out.astype(x_sorted.dtype)


def grouped_matmul_reference(h_sorted, group_sizes, w, row_scale=None, out_dtype=None):
    """Per-expert loop in plain jnp; zeros past the groups."""
    row_experts = _row_experts(group_sizes, h_sorted.shape[0])
    out = jnp.zeros((h_sorted.shape[0], w.shape[2]), jnp.float32)
    for e in range(w.shape[0]):
        y = jnp.dot(h_sorted, w[e], preferred_element_type=jnp.float32)
        out = jnp.where((row_experts == e)[:, None], y, out)
    if row_scale is not None:
        out = out * row_scale.astype(jnp.float32)[:, None]
    return out.astype(out_dtype or h_sorted.dtype)
