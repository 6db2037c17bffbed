"""A decode step's new latents into the paged MLA cache, in one launch and in place.

What the cache stores for a token is kv_a_proj's output split in two: the latent, RMS-normalized
(kv_a_norm), and the rope key, rotated at the token's position. In XLA that is a norm (two fusions),
a rope fusion and, per pool, a bounds-checked scatter (a read of the old row, then the write): ~10 µs a
layer at batch 1 for a few KB (benchmarks/results/decode_profile.md, round 5). Here one program per
token normalizes, rotates and stores both rows at its slot; the pools are aliased in and out (no
copy), and padding tokens (slots past the pool) store nothing.

It can also take kv_a's (and q's) products as ``stacked_gemvs``'s unsummed split-K partials of the
attention's RMSNorm-scaled rows, with each row's sums of squares: it then adds the partials and applies
the norm's 1 / rms itself, and with q it also returns the queries (the nope part, and the rope part
rotated), one more program per head. That replaces four small XLA fusions a layer (the squares' sum,
the kv and q epilogues, the q rope) with no launch of its own: on the H200 at batch 1 (V2-Lite), 140
µs a step of fusions gone for 28 µs more in this kernel (benchmarks/results/decode_profile.md, round 6).

``store_rows`` stores rows that are already finished (the batch-1 step kernel's latent and rope key of every MoE
layer) at one slot, one program a layer, in place of XLA's scatter (decode_profile.md round 31).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import dot_precision, inv_rms, rms_norm, rotate, rotate_pair
from pallas_kernels.stacked_gemv import stacked_head_gemv_reference

# Programs a head's absorbed query takes (``w_uk``): each multiplies the nope query into C / 4 latent
# columns (V2-Lite: a 128 x 128 slice of the head's W_UK, 32 KB); a step of one token, C / 8. H200,
# V2-Lite compiled decode step (decode_profile.md round 14): 8 tiles 2.299 ms at batch 1 against 2.311
# for 4 and 2.322 for 16; at batch 8, 5.573 against 5.551 for 4.
ABSORB_TILES, ONE_TOKEN_ABSORB_TILES = 4, 8
MIN_ABSORB_COLUMNS = 16  # a tile's latent columns (a dot's N)


def absorb_tiles(num_tokens: int, latent_dim: int) -> int:
    """Programs a head's absorbed query takes at ``num_tokens`` tokens: ``ONE_TOKEN_ABSORB_TILES`` for
    one, else ``ABSORB_TILES``, at most latent_dim / ``MIN_ABSORB_COLUMNS``."""
    tiles = ONE_TOKEN_ABSORB_TILES if num_tokens == 1 else ABSORB_TILES
    return max(1, min(tiles, latent_dim // MIN_ABSORB_COLUMNS))


def _write_kernel(layer_ref, norm_index_ref, slots_ref, positions_ref, kv_ref, norm_ref, inv_freq_ref, *refs,
                  latent_dim, rope_dim, eps, cos_sin_scale, interleave, block_size, num_slots, num_tokens, splits,
                  rms, q_heads, absorb_tiles):
    # layer, norm_index i32[1]; slots, positions i32[T]; kv f32[S * T, C + R] (kv_a_proj's output: S partial
    # sums, split s's rows at s*T..); norm [Ln, C]; inv_freq f32[R / 2]; then (squares f32[S * T] when rms),
    # (q f32[S * T, H * Dqk] when q_heads), (w_uk [Ln, C, H * Dn] when absorb_tiles), c_kv_in, k_pe_in, and
    # the outputs c_kv_ref [L, N, bs, C], k_pe_ref [L, N, bs, R] (aliased to c_kv_in / k_pe_in), (q_nope
    # [T, H, Dn] or with absorb_tiles q_latent [T, H, C], and q_pe [T, H, R] when q_heads).
    refs = list(refs)
    squares_ref = refs.pop(0) if rms else None
    q_ref = refs.pop(0) if q_heads else None
    w_uk_ref = refs.pop(0) if absorb_tiles else None
    del refs[:2]  # c_kv_in, k_pe_in: the same buffers as the outputs
    c_kv_ref, k_pe_ref, *q_out = refs
    token, part = pl.program_id(0), pl.program_id(1)
    layer, position = layer_ref[0], positions_ref[token].astype(jnp.float32)
    dtype = c_kv_ref.dtype
    half = rope_dim // 2
    if rms:
        row_scale = inv_rms(sum(squares_ref[s * num_tokens + token] for s in range(splits)), *rms)

    def load(ref, cols, ok):
        """This token's row of ref at cols: the partials added (and 1 / rms applied), rounded to the model
        dtype as the unfused path rounds a projection's output, in f32."""
        row = sum(plgpu.load(ref.at[s * num_tokens + token, cols], mask=ok, other=0) for s in range(splits))
        return (row * row_scale if rms else row).astype(dtype).astype(jnp.float32)

    def store_rotated(load_at, store_at):
        """rope of the R values load_at(idx, ok) at this token's position -> store_at(idx, value, ok), in
        the layout apply_rope keeps for q and k alike: [rotated evens | rotated odds]."""
        pairs = jnp.arange(pl.next_power_of_2(half))
        ok = pairs < half
        x1, x2 = (load_at(2 * pairs, ok), load_at(2 * pairs + 1, ok)) if interleave else \
            (load_at(pairs, ok), load_at(pairs + half, ok))
        first, second = rotate_pair(x1, x2, position * plgpu.load(inv_freq_ref.at[pairs], mask=ok, other=0),
                                    cos_sin_scale)
        store_at(pairs, first.astype(dtype), ok)
        store_at(half + pairs, second.astype(dtype), ok)

    slot = slots_ref[token]
    num_heads = q_heads[0] if q_heads else 0
    q_parts = num_heads * (absorb_tiles or 1)  # programs of the queries: a head each, or a head's latent tiles

    @pl.when((part == q_parts) & (slot < num_slots))  # the latents; padding tokens point past the pool
    def _():
        block, offset = slot // block_size, slot % block_size
        cols = jnp.arange(pl.next_power_of_2(latent_dim))
        c_ok = cols < latent_dim
        c = load(kv_ref, cols, c_ok)  # then kv_a_norm in f32
        inv_c = inv_rms(jnp.sum(c * c), latent_dim, eps)
        g = plgpu.load(norm_ref.at[norm_index_ref[0], cols], mask=c_ok, other=0)
        plgpu.store(c_kv_ref.at[layer, block, offset, cols], (g * (c * inv_c).astype(dtype)).astype(dtype),
                    mask=c_ok)
        store_rotated(lambda idx, ok: load(kv_ref, latent_dim + idx, ok),
                      lambda idx, value, ok: plgpu.store(k_pe_ref.at[layer, block, offset, idx], value, mask=ok))

    if q_heads:
        nope = q_heads[1]
        queries_ref, q_pe_ref = q_out  # queries: q_nope, or q_latent when absorbed
        head, tile = (part // absorb_tiles, part % absorb_tiles) if absorb_tiles else (part, 0)
        base = head * (nope + rope_dim)
        cols = jnp.arange(pl.next_power_of_2(nope))
        n_ok = cols < nope

        @pl.when((part < q_parts) & (tile == 0))  # head ``head``'s rope query
        def _():
            store_rotated(lambda idx, ok: load(q_ref, base + nope + idx, ok),
                          lambda idx, value, ok: plgpu.store(q_pe_ref.at[token, head, idx], value, mask=ok))

        @pl.when(part < q_parts)  # its nope query, or a latent tile of it through W_UK
        def _():
            q_nope = load(q_ref, base + cols, n_ok).astype(dtype)
            if not absorb_tiles:
                plgpu.store(queries_ref.at[token, head, cols], q_nope, mask=n_ok)
                return
            block_c = pl.next_power_of_2(pl.cdiv(latent_dim, absorb_tiles))
            rows = tile * block_c + jnp.arange(block_c)
            r_ok = rows < latent_dim
            w = plgpu.load(w_uk_ref.at[norm_index_ref[0], rows[:, None], (head * nope + cols)[None, :]],
                           mask=r_ok[:, None] & n_ok[None, :], other=0)  # [block_c, Dn]
            first_row = (jnp.arange(16) == 0)[:, None]
            x = jnp.where(first_row, q_nope[None, :], 0).astype(dtype)  # [16, Dn]: the query in row 0
            latent = jnp.dot(x, w.T.astype(dtype), preferred_element_type=jnp.float32,
                             precision=dot_precision(dtype))
            plgpu.store(queries_ref.at[token, head, rows], jnp.sum(jnp.where(first_row, latent, 0.0), axis=0)
                        .astype(dtype), mask=r_ok)


@functools.partial(jax.jit, static_argnames=("eps", "inv_freq", "cos_sin_scale", "interleave", "row_rms", "q_heads",
                                             "interpret"), donate_argnums=(0, 1))
def write_latents(c_kv, k_pe, kv, slots, positions, layer, norm, norm_index, *, eps: float, inv_freq: tuple[float, ...],
                  cos_sin_scale: float, interleave: bool, squares=None, row_rms: tuple[int, float] | None = None,
                  q=None, q_heads: tuple[int, int] | None = None, w_uk=None, interpret: bool = False):
    """c_kv [L, N, bs, C], k_pe [L, N, bs, R] (donated: updated in place) <- the step's tokens at layer
    ``layer``: kv f32[T, C + R] (kv_a_proj's output), slots i32[T] (block * bs + offset; >= N * bs:
    padding, not stored), positions i32[T], kv_a_norm's weights ``norm[norm_index]`` (``norm``: a layer
    stack's [Ln, C]; ``layer`` counts all the cache's layers, ``norm_index`` the stack's). Stores
    RMSNorm(kv[:, :C]) and rope(kv[:, C:]) as ``write_latents_reference`` -> (c_kv, k_pe).

    Split-K partials (``stacked_gemvs(..., partials=True)``): kv holds S partial sums [S * T, C + R] of
    products with RMSNorm-scaled rows, ``squares`` f32[S * T] the rows' partial sums of squares and
    ``row_rms`` = (the norm's depth, its eps): the partials are added and scaled by 1 / rms here. ``q``
    [S * T, H * (Dn + R)] with ``q_heads`` = (H, Dn): the same partials of the queries; then -> (c_kv,
    k_pe, q_nope [T, H, Dn], q_pe [T, H, R] rotated), in the pools' dtype. With ``w_uk`` (the layer
    stack's [Ln, C, H, Dn], read at ``norm_index``) the nope queries come back absorbed, q_latent [T, H,
    C] = q_nope W_UK (MLA's absorbed query): ``absorb_tiles(T, C)`` programs a head, each a tile of C."""
    num_blocks, block_size, latent_dim = c_kv.shape[1:]
    rope_dim = k_pe.shape[-1]
    num_tokens = slots.shape[0]
    splits = kv.shape[0] // num_tokens
    if (k_pe.shape[:3] != c_kv.shape[:3] or kv.shape[-1] != latent_dim + rope_dim or norm.shape[-1] != latent_dim
            or kv.shape[0] != splits * num_tokens or (splits > 1 and row_rms is None)
            or (squares is None) != (row_rms is None)):
        raise ValueError(f"write_latents: c_kv {c_kv.shape}, k_pe {k_pe.shape}, kv {kv.shape}, norm {norm.shape} "
                         f"do not match; expected [L, N, bs, C], [L, N, bs, R], [T, C + R] (or [S * T, C + R] "
                         f"with squares and row_rms) for T={num_tokens} tokens, [Ln, C]")
    if (q is None) != (q_heads is None) or (q is not None and (
            q.shape != (kv.shape[0], q_heads[0] * (q_heads[1] + rope_dim)) or row_rms is None)):
        raise ValueError(f"write_latents: q {None if q is None else q.shape} with q_heads={q_heads}; expected "
                         f"[{kv.shape[0]}, H * (Dn + {rope_dim})] with q_heads (H, Dn), and squares / row_rms")
    if w_uk is not None and (q is None or w_uk.shape[1:] != (latent_dim, *q_heads)):
        raise ValueError(f"write_latents: w_uk {w_uk.shape} comes with q and q_heads={q_heads}; expected "
                         f"[Ln, C={latent_dim}, H, Dn]")
    tiles = absorb_tiles(num_tokens, latent_dim) if w_uk is not None else 0
    kernel = functools.partial(_write_kernel, latent_dim=latent_dim, rope_dim=rope_dim, eps=eps,
                               cos_sin_scale=cos_sin_scale, interleave=interleave, block_size=block_size,
                               num_slots=num_blocks * block_size, num_tokens=num_tokens, splits=splits,
                               rms=row_rms, q_heads=q_heads, absorb_tiles=tiles)
    extra = ([squares.astype(jnp.float32)] if row_rms is not None else []) + \
        ([q.astype(jnp.float32)] if q is not None else []) + \
        ([w_uk.reshape(*w_uk.shape[:2], -1)] if w_uk is not None else [])
    out_shape = [jax.ShapeDtypeStruct(c_kv.shape, c_kv.dtype), jax.ShapeDtypeStruct(k_pe.shape, k_pe.dtype)]
    if q is not None:
        queries = latent_dim if w_uk is not None else q_heads[1]
        out_shape += [jax.ShapeDtypeStruct((num_tokens, q_heads[0], queries), c_kv.dtype),
                      jax.ShapeDtypeStruct((num_tokens, q_heads[0], rope_dim), c_kv.dtype)]
    first_pool = 7 + len(extra)
    return tuple(pl.pallas_call(
        kernel,
        grid=(num_tokens, 1 + (q_heads[0] * (tiles or 1) if q is not None else 0)),
        out_shape=out_shape,
        input_output_aliases={first_pool: 0, first_pool + 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="write_latents" + ("_q" if q is not None else "") + ("_uk" if w_uk is not None else ""),
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(norm_index, jnp.int32).reshape(1), slots.astype(jnp.int32),
      positions.astype(jnp.int32), kv.astype(jnp.float32), norm, jnp.asarray(np.asarray(inv_freq, np.float32)), *extra,
      c_kv, k_pe))


def _rope_at(r, positions, inv_freq, cos_sin_scale, interleave):
    """f32 r [T, ..., R] rotated at positions i32[T]."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(np.asarray(inv_freq, np.float32))
    return rotate(r, freqs.reshape(freqs.shape[:1] + (1,) * (r.ndim - 2) + freqs.shape[1:]), cos_sin_scale, interleave)


def write_latents_reference(c_kv, k_pe, kv, slots, positions, layer, norm, norm_index, *, eps: float, inv_freq, cos_sin_scale,
                            interleave: bool, squares=None, row_rms=None, q=None, q_heads=None, w_uk=None):
    """``write_latents`` in plain jnp (the model's RMSNorm and rope: pallas_kernels.common)."""
    dtype, latent_dim, block_size = c_kv.dtype, c_kv.shape[-1], c_kv.shape[2]
    num_tokens = slots.shape[0]

    def finish(rows):  # partials added, 1 / rms, rounded to the model dtype, in f32
        rows = rows.reshape(-1, num_tokens, rows.shape[-1]).sum(axis=0)
        if row_rms is not None:
            rows = rows * inv_rms(squares.reshape(-1, num_tokens).sum(axis=0), *row_rms)[:, None]
        return rows.astype(dtype).astype(jnp.float32)

    kv = finish(kv)
    c = rms_norm(kv[:, :latent_dim].astype(dtype), norm[norm_index], eps)  # kv is already dtype-rounded
    r = _rope_at(kv[:, latent_dim:], positions, inv_freq, cos_sin_scale, interleave)
    blocks, offsets = slots // block_size, slots % block_size
    pools = (c_kv.at[layer, blocks, offsets].set(c.astype(dtype), mode="drop"),
             k_pe.at[layer, blocks, offsets].set(r.astype(dtype), mode="drop"))
    if q is None:
        return pools
    num_heads, nope = q_heads
    q = finish(q).reshape(num_tokens, num_heads, -1)
    q_pe = _rope_at(q[..., nope:], positions, inv_freq, cos_sin_scale, interleave)
    q_nope = q[..., :nope].astype(dtype)
    if w_uk is not None:  # the absorbed query, rounded as the stacked per-head GEMV stores it
        q_nope = stacked_head_gemv_reference(q_nope, w_uk, norm_index, contract_rows=False).astype(dtype)
    return pools + (q_nope, q_pe.astype(dtype))


def _rows_kernel(slot_ref, *refs, latent_dim, rope_dim, block_size, num_slots, counts):
    # slot i32[1]; the row arrays [L_i, C + R] of consecutive layers (``counts``: their L_i); c_in / k_in: the same
    # buffers as the outputs c_ref [L', N, bs, C] and k_ref [L', N, bs, R]; program l stores layer l's row
    *row_refs, _, _, c_ref, k_ref = refs
    layer, slot = pl.program_id(0), slot_ref[0]
    block, offset = slot // block_size, slot % block_size
    first = 0
    for rows_ref, count in zip(row_refs, counts):
        # a padding slot points past the pool: nothing stored
        @pl.when((slot >= 0) & (slot < num_slots) & (layer >= first) & (layer < first + count))
        def _(rows_ref=rows_ref, first=first):
            for start, width, pool in ((0, latent_dim, c_ref), (latent_dim, rope_dim, k_ref)):
                cols = jnp.arange(pl.next_power_of_2(width))
                ok = cols < width
                row = plgpu.load(rows_ref.at[layer - first, start + cols], mask=ok, other=0)
                plgpu.store(pool.at[layer, block, offset, cols], row.astype(pool.dtype), mask=ok)
        first += count


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0, 1))
def store_rows(c_kv, k_pe, rows, slot, *, interpret: bool = False):
    """c_kv [L', N, bs, C], k_pe [L', N, bs, R] (donated: updated in place) <- rows [L, C + R] (L <= L')
    at one token's ``slot`` (block * bs + offset) of layers 0..L-1: the latent (already normed) and the
    rope key (already rotated) of each layer, as the step kernel returns them. ``rows`` may be a tuple of such
    arrays, the layers of each after the one before's (kernels' rows stored together, no concatenation). A slot
    outside the pools (padding) stores nothing. One launch, a program a layer, in place of XLA's bounds-checked
    scatter (a read of the old rows, a select and an update per pool). -> (c_kv, k_pe)."""
    latent_dim, rope_dim = c_kv.shape[-1], k_pe.shape[-1]
    parts = tuple(rows) if isinstance(rows, (tuple, list)) else (rows,)
    num_layers = sum(part.shape[0] for part in parts)
    if (k_pe.shape[:3] != c_kv.shape[:3] or num_layers > c_kv.shape[0]
            or any(part.ndim != 2 or part.shape[1] != latent_dim + rope_dim for part in parts)):
        raise ValueError(f"store_rows: c_kv {c_kv.shape}, k_pe {k_pe.shape}, rows {[p.shape for p in parts]} do not "
                         f"match; expected [L', N, bs, C], [L', N, bs, R] and rows [L_i, C + R], sum of L_i <= L'")
    num_blocks, block_size = c_kv.shape[1:3]
    kernel = functools.partial(_rows_kernel, latent_dim=latent_dim, rope_dim=rope_dim, block_size=block_size,
                               num_slots=num_blocks * block_size, counts=tuple(part.shape[0] for part in parts))
    return tuple(pl.pallas_call(
        kernel,
        grid=(num_layers,),
        out_shape=[jax.ShapeDtypeStruct(c_kv.shape, c_kv.dtype), jax.ShapeDtypeStruct(k_pe.shape, k_pe.dtype)],
        input_output_aliases={1 + len(parts): 0, 2 + len(parts): 1},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="store_rows",
    )(jnp.asarray(slot, jnp.int32).reshape(1), *parts, c_kv, k_pe))


def store_rows_reference(c_kv, k_pe, rows, slot):
    """``store_rows`` in plain jnp (a scatter that drops a slot outside the pools)."""
    if isinstance(rows, (tuple, list)):
        rows = jnp.concatenate([part.astype(rows[0].dtype) for part in rows])
    latent_dim, block_size = c_kv.shape[-1], c_kv.shape[2]
    num_slots = c_kv.shape[1] * block_size
    slot = jnp.where((slot >= 0) & (slot < num_slots), slot, num_slots)  # negative: dropped, not wrapped
    block, offset, layers = slot // block_size, slot % block_size, rows.shape[0]
    write = lambda pool, part: pool.at[:layers, block, offset].set(part.astype(pool.dtype), mode="drop")
    return write(c_kv, rows[:, :latent_dim]), write(k_pe, rows[:, latent_dim:])
