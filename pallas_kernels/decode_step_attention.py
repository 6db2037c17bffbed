"""The step kernel's attention half at one token: the weight layout it takes, its reference, and
``attention_chain``, the attention halves of L layers in one persistent Mosaic GPU kernel
(``docs/decode_step_kernel.md``, phases 1-5).

Rope without gathers. The model rotates the pairs of each rope slice: interleaved (x0, x1), (x2, x3), ...
in DeepSeek's checkpoints (``rope_interleave``), else (x_i, x_{i + R/2}). Either way it keeps the halves
layout [rotated evens | rotated odds] (``pallas_kernels.common.rotate``). A kernel's vector layouts take
contiguous halves, not strided gathers, so ``permute_rope_columns`` reorders the rope columns of q_proj and
kv_a once, when the weights are prepared: their products then come out as [evens | odds] already, and the
rotation is of two contiguous halves (``rotate_halves``). The values are the model's, bit for bit.

``attention_half_reference``: x_mid = x + the layer's attention of one token (V2-Lite's form: q_proj, no q
LoRA) over its paged context, the token's latent and rope key written into the cache first, in the model's
order and dtypes (``dsjax.model.mla.MLAttention.paged`` on the reference backend).

``attention_chain`` runs it for L layers in one kernel: 26.6-28.5 µs a layer at V2-Lite's shapes over 8
layers and contexts of 0-511 tokens, against ~30 µs for today's launches of the same work (one H200,
``python -m benchmarks.megakernel_probe --attention-chain 8``; decode_profile.md round 23; measured with phase
4 merging every state up to the block table's capacity, before the grouped merge). The new token's
latent and rope key come back for the caller to write into the cache; the kernel reads the cache before the
token and takes the new one as a chunk of its own, so it writes no cache and needs no aliasing.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cos_sin, reduced_cos_sin, rms_norm, rotate_by, why_not_hopper
from pallas_kernels.decode_step_mgpu import (HALF, RING, STEP, TOKEN_N, UNIT_K, _TILING, _arrive_and_wait,
                                             _build_tiles, _issue_box, _load_rows, _norm_tiles, _release, _round_rows,
                                             _strided, _unit_boxes, _unit_store, _unit_sums, _zero_rows, norm_rows_out,
                                             num_sms, proxy_fence, token_tiles)
from pallas_kernels.mla_decode import mla_paged_reference


class AttentionWeights(NamedTuple):
    """One layer's attention weights, rope columns permuted (``permute_rope_columns``)."""

    norm: object  # [D] the attention's RMSNorm (its weights bf16, or f32 taken as is: the kernel reads f32)
    q_proj: object  # [D, H, Dn + R]
    kv_a: object  # [D, C + R]
    kv_a_norm: object  # [C] (as norm)
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


# ---------------------------------------------------------------------------------------------------------------
# attention_chain: the attention half's phases in one persistent Mosaic GPU kernel

CHUNK = 64  # cache tokens a phase-3 CTA takes (its scores are one [64 heads, 64 tokens] wgmma tile)
NOPE, ROPE, LATENT, V_DIM = 128, 64, 512, 128  # the head dims the kernel is built for (DeepSeek-V2 / V3)
HEADS = 16  # the heads the kernel takes (V2-Lite's): phase 3's query windows are 16 rows apart
MERGE_GROUP = 8  # phase 4 merges the chunks' states this many at a time
# A diagnostic (rounds 41-42, timing only, values wrong): the named attention phases' CTAs leave out their work,
# their boxes still awaited and freed. "phase1": q_proj's and kv_a's products and sums (the norm stays); "phase2":
# all of phase 2, or a part: "wuk" the W_UK units' input, products and stores, "rope" the rope and latent CTAs'
# work; phase 3 from a point on: "chunk_states" (the states' stores), "chunk_values" (the value products and the
# stores), "chunk" (everything after the boxes land); "merge": phase 4's merge of the chunks' states (the new
# token's state alone); "phase4": all of phase 4. Batch-1 compiled step, routing fixed (decode_profile.md rounds
# 41-42): "chunk" 66 µs a step faster and "rope" 12.4 on the H200, "wuk" 0; on an H100 "phase2" 35.5, "phase4"
# 21.8, "chunk_values" 6.2, "merge" 5.2, "chunk_states" 4.2, "phase1" 0.
PROBE_PHASE_CUT: tuple = ()
PHASE_CUTS = ("phase1", "phase2", "wuk", "rope", "chunk_states", "chunk_values", "chunk", "merge", "phase4")
# Phase 3 reads the query windows by TMA (two copies, on the latent's barrier, which phase 2 alone uses) instead
# of the warpgroup's loads: one round trip, ~60 ops of code against ~550-1600. The loads took 3.0-3.8 µs of a
# chunk's ~8-16 traced (round 27); by TMA, 8 whole layers ran 61.76 / 64.3 µs a layer at positions 0 / 511
# against 62.6 / 65.47 (round 28, ``layer_chain_compact_h200.json``), and the engine's batch-1 compiled step
# 1.741 ms against 1.820 (round 29, ``step_ab_query_tma_b1_h200.json``). Read at trace time.
QUERY_TMA = True
# Phase 2's rope CTA computes the rope's cos and sin itself from the position and the inverse frequencies (its
# ``cs`` input f32[32, 32], the frequencies down each row; ``reduced_cos_sin``: angles taken to [-pi, pi] first,
# since the kernel's approximate cos / sin are accurate there only), instead of reading the [2, 32, 32] table the
# caller computed: one XLA launch a step fewer (round 34's ``loop_broadcast_fusion``, ~1.3 µs plus its
# boundary). Its reduction holds (~3e-7) for angles below 411k, positions at frequencies up to 1; the kernel takes
# contexts up to (its CTAs - 1) x 64 tokens (``attention_supports``). Timed with dispatch's kernel knobs (round
# 35: their batch-1 step 1.7034 ms against 1.7342). Read at trace time.
ROPE_IN_KERNEL = True
PHASES = 5  # grid barriers a layer


def attention_supports(hidden: int, num_heads: int, dims: tuple, block_size: int, capacity: int, dtype,
                       num_layers: int = 1) -> str | None:
    """None when ``attention_chain`` takes this attention (``dims`` = (nope, rope, latent, v) head dims; the
    context up to ``capacity`` tokens, pages of ``block_size``), else why not."""
    if why_not := why_not_hopper():
        return why_not
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return f"weights in {jnp.dtype(dtype).name} (this kernel takes bfloat16)"
    if tuple(dims) != (NOPE, ROPE, LATENT, V_DIM):
        return f"head dims (nope, rope, latent, v) {tuple(dims)}; this kernel takes {(NOPE, ROPE, LATENT, V_DIM)}"
    if hidden % UNIT_K:
        return f"hidden size {hidden} is not a multiple of {UNIT_K}"
    ctas = num_sms()
    if num_heads != HEADS:
        return f"{num_heads} heads (this kernel takes {HEADS}: the scores' rows hold them in 16-row windows)"
    if (units := num_heads * LATENT // HALF + 2) > ctas:
        return f"{num_heads} heads need {units} CTAs for the absorbed queries (this GPU runs {ctas})"
    if (units := hidden // HALF * (num_heads * V_DIM // UNIT_K)) > ctas:
        return f"o_proj of {num_heads * V_DIM} x {hidden} needs {units} CTAs (this GPU runs {ctas})"
    if block_size % CHUNK:
        return f"block_size {block_size} is not a multiple of {CHUNK}"
    if (states := pl.cdiv(capacity, CHUNK) + 1) > ctas:
        return (f"a context of {capacity} tokens needs {states} CTAs for its chunks and the new token (this GPU "
                f"runs {ctas})")
    if num_layers < 1:
        return f"{num_layers} layers (at least 1)"
    return None


class AttentionRefs(NamedTuple):
    """The attention phases' global memory (``attention_phases``). Inputs: pos i32[1] (the token's position),
    table i32[W] (its pages), cs f32[2, 32, 32] (rope's cos and sin, a copy a row; with ``ROPE_IN_KERNEL`` its
    inverse frequencies f32[32, 32], a copy a row), g f32[L, D / 64, 64] (the
    attention norm), wq bf16[L, D, H * 192] (q_proj, rope columns permuted), wkv bf16[L, D, 576] (kv_a, the
    same), knorm f32[L, 8, 64], wuk bf16[L, 512, H, 128], ckv bf16[L, N, bs, 512], kpe bf16[L, N, bs, 64], wuv
    bf16[L, 512, H, 128]. Outputs the phases write: qkv f32[L, 64, 64] (phase 1's sums: q's column tiles 0 ..
    3H - 1, then kv_a's 9), q bf16[L, 192, 64] (the absorbed query's 64-column chunk j and the rotated q_pe (j
    = 8) of head h at row 16 j + h, zeros past: three [64, 64] windows), kvnew bf16[9, 64, 64] (the new
    token's latent and rope key as row 0 of 9 [64, 64] chunks, zeros below: phase 3's last state takes it as a
    chunk of one token), kv_out bf16[L, 9, 64] (the same rows, for the caller's cache), ml f32[L, S, 2, 64]
    (each state's m in log2 units and l, a head a column), o f32[L, S, 512, H] (each state's unnormalized
    output, transposed), vctx f32[L, H * 2, 64] (the heads' outputs after W_UV, summed by TMA adds)."""

    pos: object
    table: object
    cs: object
    g: object
    wq: object
    wkv: object
    knorm: object
    wuk: object
    ckv: object
    kpe: object
    wuv: object
    qkv: object
    q: object
    kvnew: object
    kv_out: object
    ml: object
    o: object
    vctx: object


class AttentionScratch(NamedTuple):
    """The shared memory the phases take: the layer's input rows xin f32[D / 64, 64] (bf16 values) and the
    norm's weights g f32[D / 64, 64] (g_bar: landed); the token's tiles bf16[D / 8, 64], flat: the same bytes
    as rows [D / 64, 512] (``token_tiles``; tiles4's too, at their start), and rows f32[D / 64, 64]; phase 3's
    query windows q bf16[192, 64] and p bf16[64, 64]; phase 4's merged rows mrow f32[2, 64] and their tiles4
    bf16[64, 64]; phase 2's rope rows f32[32, 64], rotated rope16 bf16[32, 64], cs f32[2, 32, 32], the new
    latent lat f32[8, 64], knorm f32[8, 64], the normed latb bf16[8, 64]; part f32[2, 64] (TMA adds), qrow
    bf16[64]; zeros f32 and bf16 [8, 64]; rope_bar (num_heads + 2 arrivals), lat_bar (2)."""

    xin: object
    g: object
    g_bar: object
    tiles: object
    flat: object
    rows: object
    q: object
    p: object
    mrow: object
    tiles4: object
    rope: object
    rope16: object
    cs: object
    lat: object
    knorm: object
    latb: object
    part: object
    qrow: object
    zero: object
    zero16: object
    rope_bar: object
    lat_bar: object


def _boxes_skipped(full, free, base, boxes):
    """``PROBE_PHASE_CUT``'s stand-in for a unit's products: its ``boxes`` boxes at ring positions base, base + 1,
    ... awaited and their slots freed."""
    def one(i, _):
        slot = lax.rem(base + i, RING)
        plgpu.barrier_wait(full.at[slot])
        plgpu.barrier_arrive(free.at[slot])

    lax.fori_loop(0, boxes, one, None)


def chunk_scores(key, q_smem, p_smem, m_ref, l_ref, valid, scale_log2e: float):
    """Phase 3's scores and softmax over one chunk (the computing warpgroup, its operands in shared memory):
    ``key(j)`` the chunk's keys' 64-column slice j ([64 tokens, 64]: 8 of the latent, then the rope key), q_smem
    the query windows bf16[192, 64] (row 16 j + h: slice j of head h's query), ``valid()`` the chunk's tokens
    that count -> P^T into p_smem bf16[64, 64] (row h: head h's P over the tokens; rows past H unread), m (log2
    units) and l of every head into m_ref and l_ref f32[64] (entries past H unread); committed. S [64 rows, 64
    tokens] takes 64-row query windows, rows past H other windows' (finite). (Session 58 built the scores with the
    tokens on wgmma's M side, S^T [64 tokens, H] in 1, 3 or 9 accumulators: no faster in the step, round 42;
    removed, code in git cd849d3.)"""
    f32 = jnp.float32

    def scores(acc_ref):
        def product(j, _=None):
            keys = key(j)
            plgpu.wgmma(acc_ref, q_smem.at[pl.ds(j * 16, HALF)], keys.transpose((1, 0)))

        lax.fori_loop(0, 9, product, None)
        return acc_ref[...]

    s = pl.run_scoped(scores, plgpu.ACC((HALF, CHUNK), f32))
    num_valid = valid()
    cols = plgpu.broadcasted_iota(jnp.int32, (HALF, CHUNK), 1, layout=plgpu.Layout.WGMMA)
    s = jnp.where(cols < num_valid, s * scale_log2e, -jnp.inf)
    m = s.max(axis=1)
    p = jnp.exp2(s - lax.broadcast_in_dim(m, s.shape, [0]))
    m_ref[...] = m
    l_ref[...] = p.sum(axis=1)
    p_smem[...] = p.astype(p_smem.dtype)
    plgpu.commit_smem()


def chunk_values(key, p_smem, num_heads: int):
    """Phase 3's value products over one chunk: out^T [512, H] = the latents^T x P^T (``chunk_scores``' P^T in
    p_smem; ``key(j)`` the latent's 64-column slices j < 8) -> 8 accumulators' values, [64 latent rows, H]."""
    p_t = p_smem.at[pl.ds(0, num_heads)].transpose((1, 0))  # [64 tokens, H]

    def values(accs):
        for j in range(8):
            plgpu.wgmma(accs[j], key(j).transpose((1, 0)), p_t)

    zeros = plgpu.layout_cast(jnp.zeros((HALF, num_heads), jnp.float32), plgpu.Layout.WGMMA)
    return pl.run_state(values)(tuple(plgpu.ACC.init(zeros) for _ in range(8)))


def attention_phases(refs: AttentionRefs, scratch: AttentionScratch, ring, full, free, sem, *, num_layers: int,
                     num_heads: int, states: int, num_ctas: int, scale_log2e: float, eps: float, kv_eps: float,
                     block_size: int, barrier_count, cos_sin_scale: float, cache_layer: int = 0, next_norm=None):
    """Phases 1-4 of the attention half (``attention_chain``) inside a persistent kernel whose ring, grid
    semaphore and layer loop the caller owns -> (zero, loads, compute):

    - ``zero()`` (computing warpgroup, before the kernel's first barrier): the phases' outputs that start at
      zero, and layer 0's norm weights fetched.
    - ``loads(layer, count)`` (producer): the layer's boxes of phases 1-4 from ring position ``count`` -> the
      position after.
    - ``compute(layer, count)`` (computing warpgroup, the layer's input rows in ``scratch.xin``): the phases,
      phase p ending at the grid barrier ``barrier_count(layer, p)`` -> the ring position after. The heads'
      outputs after W_UV are then in ``refs.vctx[layer]``, for o_proj.

    Layer l reads the context from cache layer ``cache_layer`` + l (a stack that is not first in the caches).
    ``next_norm(layer)``: what phase 1 fetches into ``scratch.g`` once its norm has read it (on ``scratch.g_bar``);
    by default the next layer's norm weights. A kernel that shares g with another norm fetches that norm's."""
    if unknown := sorted(set(PROBE_PHASE_CUT) - set(PHASE_CUTS)):
        raise ValueError(f"PROBE_PHASE_CUT names {', '.join(map(repr, unknown))}; accepted: {', '.join(PHASE_CUTS)}")
    cut = lambda name: name in PROBE_PHASE_CUT
    rope_work = not (cut("phase2") or cut("rope"))  # the rope and latent CTAs' work (unless a diagnostic cuts it)
    r, sm = refs, scratch
    f32, bf16 = jnp.float32, jnp.bfloat16
    c = lax.axis_index("c")
    rows = sm.xin.shape[0]
    hidden = rows * HALF
    ksteps = hidden // STEP  # a column tile's boxes in phase 1
    q_tiles = num_heads * 3  # q_proj's column tiles (nope, nope, rope a head), then kv_a's 9
    p1_boxes = (q_tiles + 9) * ksteps
    n0, n1 = lax.div(c * p1_boxes, num_ctas), lax.div((c + 1) * p1_boxes, num_ctas)
    tile_a = lax.div(n0, ksteps)
    split = jnp.minimum(n1, (tile_a + 1) * ksteps)  # a CTA's boxes span at most two tiles: [n0, split), [split, n1)
    wuk_units = num_heads * (LATENT // HALF)  # phase 2: (head, 64 latent columns) a CTA
    rope_cta, latent_cta = wuk_units, wuk_units + 1
    nch = states - 1  # phase 3: CTA s < nch takes chunk s of the context, CTA nch the new token
    wuv_units = num_heads * 2 * (LATENT // STEP)  # phase 4: (head, 64 v columns, 128 latent rows) a CTA
    position = r.pos[0]
    num_chunks = jnp.minimum(lax.div(position + CHUNK - 1, CHUNK), nch)
    in_chunks = (c < num_chunks) | (c == nch)
    head, ct = lax.div(c, LATENT // HALF), lax.rem(c, LATENT // HALF)  # phase 2's unit
    v_head, v_tile, v_range = lax.div(c, 8), lax.rem(lax.div(c, 4), 2), lax.rem(c, 4)  # phase 4's unit
    p2_boxes = jnp.where(c < wuk_units, 1, 0)
    p3_boxes = jnp.where(in_chunks, 5, 0)
    p4_boxes = jnp.where(c < wuv_units, 1, 0)
    issue = functools.partial(_issue_box, ring, full, free)

    def zero():
        _zero_rows(sm.zero, r.qkv, c, num_ctas)
        _zero_rows(sm.zero, r.vctx, c, num_ctas)
        _zero_rows(sm.zero16, r.kvnew, c, num_ctas)  # the new token's chunk: zeros past its row
        _zero_rows(sm.zero16, r.q, c, num_ctas)  # the query windows' rows past the queries
        plgpu.copy_gmem_to_smem(r.g.at[0], sm.g, sm.g_bar.at[0])

    def p1_halves(layer, n, h):  # half h of q_proj's or kv_a's box n (column tile, K step): (view, condition)s
        tile, k = lax.div(n, ksteps), lax.rem(n, ksteps)
        return [(r.wq.at[layer, pl.ds(k * STEP + h * HALF, HALF), pl.ds(tile * HALF, HALF)], tile < q_tiles),
                (r.wkv.at[layer, pl.ds(k * STEP + h * HALF, HALF), pl.ds((tile - q_tiles) * HALF, HALF)],
                 tile >= q_tiles)]

    def loads(layer, count):
        def p1(n, count):  # q_proj's and kv_a's (column tile, K step) boxes
            issue(count, lambda h: p1_halves(layer, n, h))
            return count + 1

        count = lax.fori_loop(n0, n1, p1, count)
        pl.when(c < wuk_units)(lambda: issue(count, lambda h: [
            (r.wuk.at[layer, pl.ds(ct * HALF, HALF), head, pl.ds(h * HALF, HALF)], True)]))
        count = count + p2_boxes

        @pl.when(c < num_chunks)
        def _():  # the context's chunk c: 64 tokens of a page, the latents' 8 halves and the rope keys
            token = c * CHUNK
            page, t0 = r.table[lax.div(token, block_size)], lax.rem(token, block_size)
            at = cache_layer + layer
            lax.fori_loop(0, 4, lambda b, _: issue(count + b, lambda h: [
                (r.ckv.at[at, page, pl.ds(t0, CHUNK), pl.ds(b * STEP + h * HALF, HALF)], True)]), None)
            issue(count + 4, lambda h: [(r.kpe.at[at, page, pl.ds(t0, CHUNK)], True)])

        @pl.when(c == nch)
        def _():  # the new token's rows, once phase 2 has written them
            plgpu.semaphore_wait(sem, num_ctas * barrier_count(layer, 2), decrement=False, memory_scope="gpu")
            proxy_fence()
            lax.fori_loop(0, 4, lambda b, _: issue(count + b, lambda h: [(r.kvnew.at[2 * b + h], True)]), None)
            issue(count + 4, lambda h: [(r.kvnew.at[8], True)])

        count = count + p3_boxes
        pl.when(c < wuv_units)(lambda: issue(count, lambda h: [
            (r.wuv.at[layer, pl.ds(v_range * STEP + h * HALF, HALF), v_head, pl.ds(v_tile * HALF, HALF)], True)]))
        return count + p4_boxes

    def store_add(sums, dest, i=0):
        sm.part.at[i][...] = sums
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(sm.part.at[i], dest, reduction_op="add")

    zeros8 = lambda: plgpu.layout_cast(jnp.zeros((HALF, TOKEN_N), f32), plgpu.Layout.WGMMA)
    def phase1(layer, count):
        """RMSNorm(x) into the tiles (every CTA); the CTA's boxes of q_proj / kv_a, each tile's sums added."""
        plgpu.barrier_wait(sm.g_bar.at[0])
        with jax.named_scope("norm"):
            _norm_tiles(sm.xin, sm.g, sm.flat, eps)

        if next_norm is not None:
            next_norm(layer)
        else:
            pl.when(layer + 1 < num_layers)(lambda: plgpu.copy_gmem_to_smem(r.g.at[layer + 1], sm.g, sm.g_bar.at[0]))

        def column_tile(i, first, end):  # the CTA's boxes of one column tile, [first, end)
            @pl.when(end > first)
            def _():
                if cut("phase1"):
                    _boxes_skipped(full, free, count + first - n0, end - first)
                    return
                sums = _unit_sums(ring, full, free, sm.tiles, count + first - n0, end - first, zeros8(),
                                  first=lax.rem(first, ksteps))
                store_add(sums, r.qkv.at[layer, lax.div(first, ksteps)], i)

        with jax.named_scope("q_kv"):
            lax.fori_loop(0, 2, lambda i, _: column_tile(i, jnp.where(i == 0, n0, split), jnp.where(i == 0, split, n1)),
                          None)
        _arrive_and_wait(sem, num_ctas, barrier_count(layer, 1), "phase1")
        return count + n1 - n0

    def phase2(layer, count):
        """The absorbed queries (q_nope x W_UK, a (head, 64 latent columns) unit a CTA); rope of q_pe and of
        the new key (one CTA); the new latent's norm (one CTA)."""
        @pl.when(c < wuk_units)
        @jax.named_scope("w_uk")
        def _():
            if cut("phase2") or cut("wuk"):
                _boxes_skipped(full, free, count, 1)
                return
            _load_rows(r.qkv.at[layer, pl.ds(3 * head, 2)], sm.rows.at[pl.ds(0, 2)])
            _build_tiles(sm.rows.at[pl.ds(0, 2)], sm.flat)
            sums = _unit_sums(ring, full, free, sm.tiles, count, 1, zeros8(), transpose=False)
            sm.qrow[...] = sums.astype(bf16)  # the model's q_latent is bf16
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sm.qrow, r.q.at[layer, ct * 16 + head])

        @pl.when((c == rope_cta) & rope_work)
        @jax.named_scope("rope")
        def _():  # rows 0 .. H - 1: q_pe of each head; row H: the new rope key (rows past it: zeros)
            sm.rope.at[pl.ds(16, 16)][...] = jnp.zeros((16, HALF), f32)
            plgpu.commit_smem()
            rope_row = lambda h, _=None: plgpu.copy_gmem_to_smem(r.qkv.at[layer, 3 * h + 2], sm.rope.at[h],
                                                                  sm.rope_bar.at[0])
            lax.fori_loop(0, num_heads, rope_row, None)
            plgpu.copy_gmem_to_smem(r.qkv.at[layer, q_tiles + 8], sm.rope.at[num_heads], sm.rope_bar.at[0])
            plgpu.copy_gmem_to_smem(r.cs, sm.cs.at[0] if ROPE_IN_KERNEL else sm.cs, sm.rope_bar.at[0])
            plgpu.barrier_wait(sm.rope_bar.at[0])
            halves = plgpu.Layout.WG_STRIDED((32, ROPE // 2), vec_size=2)
            lo, hi = (plgpu.load(sm.rope.at[:, pl.ds(i * 32, 32)], layout=halves).astype(bf16).astype(f32)
                      for i in range(2))
            if ROPE_IN_KERNEL:  # the angles as the caller's rope_cos_sin has them (f32 position x frequency)
                angles = plgpu.load(sm.cs.at[0], layout=halves) * position.astype(f32)
                cos, sin = reduced_cos_sin(angles, cos_sin_scale)
            else:
                cos, sin = (plgpu.load(sm.cs.at[i], layout=halves) for i in range(2))
            sm.rope16.at[:, pl.ds(0, 32)][...] = (lo * cos - hi * sin).astype(bf16)
            sm.rope16.at[:, pl.ds(32, 32)][...] = (hi * cos + lo * sin).astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sm.rope16.at[pl.ds(0, num_heads)], r.q.at[layer, pl.ds(8 * 16, num_heads)])
            plgpu.copy_smem_to_gmem(sm.rope16.at[num_heads], r.kvnew.at[8, 0])
            plgpu.copy_smem_to_gmem(sm.rope16.at[num_heads], r.kv_out.at[layer, 8])

        @pl.when((c == latent_cta) & rope_work)
        @jax.named_scope("latent")
        def _():  # kv_a_norm of the new latent (as the model's RMSNorm)
            plgpu.copy_gmem_to_smem(r.qkv.at[layer, pl.ds(q_tiles, 8)], sm.lat, sm.lat_bar.at[0])
            plgpu.copy_gmem_to_smem(r.knorm.at[layer], sm.knorm, sm.lat_bar.at[0])
            plgpu.barrier_wait(sm.lat_bar.at[0])
            flat = plgpu.Layout.WG_STRIDED((8, HALF), vec_size=2)
            x = plgpu.load(sm.lat, layout=flat).astype(bf16).astype(f32)
            inv_rms = lax.rsqrt(jnp.sum(x * x) / LATENT + kv_eps)
            g = plgpu.load(sm.knorm, layout=flat)
            sm.latb[...] = ((x * inv_rms).astype(bf16).astype(f32) * g).astype(bf16)
            plgpu.commit_smem()
            for j in range(8):
                plgpu.copy_smem_to_gmem(sm.latb.at[j], r.kvnew.at[j, 0])
            plgpu.copy_smem_to_gmem(sm.latb, r.kv_out.at[layer, pl.ds(0, 8)])

        _arrive_and_wait(sem, num_ctas, barrier_count(layer, 2), "phase2")
        return count + p2_boxes

    def phase3(layer, count):
        """A chunk's partial softmax state for every head: scores [64 heads (the first H real), 64 tokens] =
        q [64, 576] x the chunk's keys^T (the q windows start 16 rows apart: rows past H are other windows'
        rows, finite, never read), P in bf16; out^T [512, H] = the latents^T x P^T, [64, H] a latent half;
        m, l and out^T stored by the warpgroup's own stores (the new token's CTA: a chunk of one token)."""
        @pl.when(in_chunks)
        @jax.named_scope("chunk")
        def _():
            def window(w, _=None):
                sm.q.at[pl.ds(w * HALF, HALF)][...] = plgpu.load(
                    r.q.at[layer, pl.ds(w * HALF, HALF)], layout=plgpu.Layout.WGMMA, optimized=False)

            with jax.named_scope("queries"):  # rows 16 j + h: chunk j of head h's query (three windows)
                if QUERY_TMA:  # two copies: lat_bar takes two arrivals
                    for rows in (pl.ds(0, 2 * HALF), pl.ds(2 * HALF, HALF)):
                        plgpu.copy_gmem_to_smem(r.q.at[layer, rows], sm.q.at[rows], sm.lat_bar.at[0])
                else:
                    lax.fori_loop(0, 3, window, None)
                    plgpu.commit_smem()
            slots = [lax.rem(count + b, RING) for b in range(5)]
            with jax.named_scope("chunk_wait"):  # the chunk's 5 boxes, issued by the producer ahead of the phase
                for slot in slots:
                    plgpu.barrier_wait(full.at[slot])
                if QUERY_TMA:
                    plgpu.barrier_wait(sm.lat_bar.at[0])

            def free_slots():
                for slot in slots:
                    plgpu.barrier_arrive(free.at[slot])

            if cut("chunk"):
                free_slots()
                return
            with jax.named_scope("scores"):  # the products, the softmax, P into shared memory
                chunk_scores(lambda j: ring.at[lax.rem(count + j // 2, RING), j % 2], sm.q, sm.p,
                             r.ml.at[layer, c, 0], r.ml.at[layer, c, 1],
                             lambda: jnp.where(c == nch, 1, jnp.minimum(CHUNK, position - c * CHUNK)), scale_log2e)
            if cut("chunk_values"):
                free_slots()
                return
            with jax.named_scope("values"):
                accs = chunk_values(lambda j: ring.at[slots[j // 2], j % 2], sm.p, num_heads)
            free_slots()
            if cut("chunk_states"):
                return
            with jax.named_scope("states_out"):  # out^T by the warpgroup's own stores
                for j, acc in enumerate(accs):
                    r.o.at[layer, c, pl.ds(j * HALF, HALF)][...] = acc

        _arrive_and_wait(sem, num_ctas, barrier_count(layer, 3), "phase3")
        return count + p3_boxes

    def phase4(layer, count):
        """A (head, 64 v columns, 128 latent rows) unit: the head's states merged over its latent rows (read
        by the warpgroup's own loads), as bf16 tiles, times W_UV's box; the sums added."""
        @pl.when(c < wuv_units)
        @jax.named_scope("w_uv")
        def _():
            if cut("phase4"):
                _boxes_skipped(full, free, count, 1)
                return
            # an online merge, the new token's state first, then the chunks' MERGE_GROUP at a time (each group's
            # loads issued together, so a group waits out L2's latency once); a group's entries past the context
            # read the new token's state in their place, weighted 0 (those states are never written)
            m_at = lambda s: r.ml[layer, s, 0, v_head]
            rows = lambda s, q: plgpu.load(r.o.at[layer, s, pl.ds(v_range * STEP + q * HALF, HALF), v_head],
                                           layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

            def group(g, carry):
                top, total, merged = carry
                at = [jnp.where(g * MERGE_GROUP + i < num_chunks, g * MERGE_GROUP + i, nch) for i in range(MERGE_GROUP)]
                m = [jnp.where(g * MERGE_GROUP + i < num_chunks, m_at(s), -jnp.inf) for i, s in enumerate(at)]
                new_top = functools.reduce(jnp.maximum, m, top)
                weights = [jnp.exp2(m_s - new_top) for m_s in m]
                keep = jnp.exp2(top - new_top)
                total = total * keep + sum(w * r.ml[layer, s, 1, v_head] for s, w in zip(at, weights))
                merged = tuple(merged[q] * keep + sum(rows(s, q) * w for s, w in zip(at, weights)) for q in range(2))
                return new_top, total, merged

            first = (m_at(nch), r.ml[layer, nch, 1, v_head], tuple(rows(nch, q) for q in range(2)))
            _, total, merged = first if cut("merge") else lax.fori_loop(0, pl.cdiv(num_chunks, MERGE_GROUP), group,
                                                                         first)
            for q in range(2):
                sm.mrow.at[q][...] = merged[q] / total
            plgpu.commit_smem()
            _build_tiles(sm.mrow, sm.flat)
            sums = _unit_sums(ring, full, free, sm.tiles4, count, 1, zeros8())
            store_add(sums, r.vctx.at[layer, 2 * v_head + v_tile])

        _arrive_and_wait(sem, num_ctas, barrier_count(layer, 4), "phase4")
        return count + p4_boxes

    def compute(layer, count):
        for phase in (phase1, phase2, phase3, phase4):
            count = phase(layer, count)
        return count

    return zero, loads, compute


def _attention_body(*refs, num_layers: int, num_heads: int, states: int, num_ctas: int, out_eps: float | None = None,
                    embedding: bool = False, launch_dependents: bool = False, **constants):
    # ``attention_phases``' refs (AttentionRefs) in order, x_ref f32[D / 64, 64] and wo_ref bf16[L, H * 128, D]
    # among them, out_ref f32[L, D / 64, 64] (x_mid of each layer: x + the TMA adds of o_proj's units) first of
    # the outputs; then the scratch. Phase 5 is o_proj (``gemv_chain``'s units) and the residual. ``out_eps``:
    # one more input last, an RMSNorm's weights gout_ref f32[D / 64, 64], and two more outputs last, [D / 64, 64]
    # each: x_L normed by it (bf16), and x_L rounded to bf16 (in bf16, or f32 for a launch that adds into it in
    # place) (CTA 0, after the last layer; the next sublayer's inputs).
    # ``embedding``: x_ref is the embedding table bf16[V, D / 64, 64] and one more input last, token_ref i32[1],
    # the token whose row is x (every CTA reads it from the table).
    # ``launch_dependents``: a launch after it that waits programmatically (``griddepcontrol.wait``) may be set up
    # from the start (the kernel itself is launched as usual).
    if launch_dependents:
        plgpu.griddepcontrol_launch_dependents()
    normed = out_eps is not None
    num_in, num_out = 13 + normed + embedding, 8 + 2 * normed
    (pos_ref, table_ref, cs_ref, x_ref, g_ref, wq_ref, wkv_ref, knorm_ref, wuk_ref, ckv_ref, kpe_ref, wuv_ref, wo_ref,
     *gout_ref) = refs[:num_in]
    token_ref = gout_ref.pop() if embedding else None
    out_ref, qkv_ref, q_ref, kvnew_ref, kv_out, ml_ref, o_ref, vctx_ref, *normed_ref = refs[num_in:num_in + num_out]
    (ring, xin_smem, g_smem, union, part_smem, qrow_smem, zero_smem, zero16_smem, full, free, g_bar, rope_bar,
     lat_bar) = refs[num_in + num_out:]
    c = lax.axis_index("c")
    rows = xin_smem.shape[0]
    hidden = rows * HALF
    o_ranges = num_heads * V_DIM // UNIT_K
    o_units = (hidden // HALF) * o_ranges
    o_tile, o_kq = lax.div(c, o_ranges), lax.rem(c, o_ranges)
    o_boxes = jnp.where(c < o_units, UNIT_K // STEP, 0)
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
    barrier_count = lambda layer, phase: 1 + PHASES * layer + phase  # the kernel's first barrier, then PHASES a layer
    (tiles_smem, row_smem), flat_smem, (q_smem, p_smem), (tiles4_smem, mrow_smem), rope_buffers = union
    refs = AttentionRefs(pos_ref, table_ref, cs_ref, g_ref, wq_ref, wkv_ref, knorm_ref, wuk_ref, ckv_ref, kpe_ref,
                         wuv_ref, qkv_ref, q_ref, kvnew_ref, kv_out, ml_ref, o_ref, vctx_ref)
    scratch = AttentionScratch(xin_smem, g_smem, g_bar, tiles_smem, flat_smem, row_smem, q_smem, p_smem, mrow_smem,
                               tiles4_smem, *rope_buffers, part_smem, qrow_smem, zero_smem, zero16_smem, rope_bar,
                               lat_bar)
    zero, phase_loads, phase_compute = attention_phases(
        refs, scratch, ring, full, free, sem, num_layers=num_layers, num_heads=num_heads, states=states,
        num_ctas=num_ctas, barrier_count=barrier_count, **constants)

    def loads():
        """Warpgroup 1: every phase's boxes of every layer, in the computing warpgroup's order."""
        def layer_loads(layer, count):
            count = phase_loads(layer, count)

            pl.when(c < o_units)(lambda: _unit_boxes(ring, full, free, count, wo_ref.at[layer], o_tile, o_kq))
            return count + o_boxes

        lax.fori_loop(0, num_layers, layer_loads, jnp.int32(0))

    def read_rows(source):
        """The layer's input rows (x_l) into xin_smem, rounded to bf16 as the model's residual stream is."""
        _load_rows(source, xin_smem)
        _round_rows(xin_smem)

    def read_embedding():
        """The token's row of the embedding table into xin_smem (f32), as the model's lookup (``jnp.take``): a
        negative id counts from the end, an id outside the table gives NaN."""
        vocab = x_ref.shape[0]
        token = token_ref[0]
        token = jnp.where(token < 0, token + vocab, token)
        inside = (token >= 0) & (token < vocab)
        row = plgpu.load(x_ref.at[jnp.clip(token, 0, vocab - 1)], layout=_strided((rows, HALF), 4))
        xin_smem[...] = row.astype(jnp.float32) + jnp.where(inside, 0.0, jnp.nan)
        plgpu.commit_smem()

    def compute():
        _zero_rows(zero_smem, out_ref, c, num_ctas)
        zero()
        read_embedding() if embedding else read_rows(x_ref)
        _arrive_and_wait(sem, num_ctas, 1)
        zeros8 = plgpu.layout_cast(jnp.zeros((HALF, TOKEN_N), jnp.float32), plgpu.Layout.WGMMA)

        def layer_body(layer, count):
            count = phase_compute(layer, count)

            @pl.when(c < o_units)
            @jax.named_scope("o_proj")
            def _():  # x_mid = x_l + v_ctx @ W_o: a GEMV unit a CTA, CTA 0 adds x_l
                chunks = UNIT_K // HALF
                _load_rows(vctx_ref.at[layer, pl.ds(o_kq * chunks, chunks)], row_smem.at[pl.ds(0, chunks)])
                _build_tiles(row_smem.at[pl.ds(0, chunks)], flat_smem)
                _unit_store(ring, full, free, tiles_smem, count, zeros8, part_smem.at[0], out_ref.at[layer, o_tile])

            pl.when(c == 0)(lambda: plgpu.copy_smem_to_gmem(xin_smem, out_ref.at[layer], reduction_op="add"))
            _arrive_and_wait(sem, num_ctas, barrier_count(layer, 5), "o_proj")

            @pl.when(layer + 1 < num_layers)
            def _():
                read_rows(out_ref.at[layer])
            return count + o_boxes

        lax.fori_loop(0, num_layers, layer_body, jnp.int32(0))
        if normed:
            pl.when(c == 0)(jax.named_scope("out_norm")(
                lambda: norm_rows_out(out_ref.at[num_layers - 1], gout_ref[0], normed_ref[0], out_eps, normed_ref[1])))
        _release(sem, c, num_ctas, barrier_count(num_layers - 1, PHASES))

    pl.when(lax.axis_index("wg") == 0)(compute)
    pl.when(lax.axis_index("wg") == 1)(loads)


def attention_operands(position, block_table, c_kv, k_pe, weights: AttentionWeights, spec: AttentionSpec,
                       cache_layer: int = 0):
    """What a kernel running ``attention_phases`` takes: (the 11 inputs of AttentionRefs, the 7 outputs' types,
    the phases' constants), the weights' layer l reading the caches' layer ``cache_layer`` + l."""
    num_layers, hidden = weights.norm.shape
    num_heads = weights.q_proj.shape[2]
    block_size = c_kv.shape[2]
    states = pl.cdiv(block_table.shape[0] * block_size, CHUNK) + 1
    f32, bf16 = jnp.float32, jnp.bfloat16
    if ROPE_IN_KERNEL:  # the frequencies, a constant of the program: whole rows (a broadcast would be a launch)
        cs = jnp.asarray(np.tile(np.asarray(spec.inv_freq, np.float32), (32, 1)))
    else:
        cos, sin = rope_cos_sin(position, spec.inv_freq, spec.cos_sin_scale)
        cs = jnp.broadcast_to(jnp.stack([cos, sin])[:, None, :], (2, 32, ROPE // 2)).astype(f32)
    inputs = (jnp.asarray(position, jnp.int32).reshape(1), block_table.astype(jnp.int32), cs,
              weights.norm.astype(f32).reshape(num_layers, hidden // HALF, HALF),
              weights.q_proj.reshape(num_layers, hidden, -1), weights.kv_a,
              weights.kv_a_norm.astype(f32).reshape(num_layers, 8, HALF), weights.w_uk, c_kv, k_pe, weights.w_uv)
    out_types = (jax.ShapeDtypeStruct((num_layers, HALF, HALF), f32),  # phase 1's sums
                 jax.ShapeDtypeStruct((num_layers, 3 * HALF, HALF), bf16),  # the queries: chunk j of head h at 16 j + h
                 jax.ShapeDtypeStruct((9, CHUNK, HALF), bf16),  # the new token as a chunk
                 jax.ShapeDtypeStruct((num_layers, 9, HALF), bf16),  # its rows, for the cache
                 jax.ShapeDtypeStruct((num_layers, states, 2, HALF), f32),  # the states' m and l
                 jax.ShapeDtypeStruct((num_layers, states, LATENT, num_heads), f32),  # their outputs, transposed
                 jax.ShapeDtypeStruct((num_layers, num_heads * V_DIM // HALF, HALF), f32))  # W_UV's sums
    constants = dict(num_heads=num_heads, states=states, scale_log2e=spec.scale * math.log2(math.e), eps=spec.eps,
                     kv_eps=spec.kv_eps, block_size=block_size, cos_sin_scale=spec.cos_sin_scale,
                     cache_layer=cache_layer)
    return inputs, out_types, constants


def attention_chain(x, position, block_table, c_kv, k_pe, weights: AttentionWeights, spec: AttentionSpec,
                    profile_dir: str | None = None, cache_layer: int = 0, out_norm=None, residual_dtype=None,
                    embedding=None, launch_dependents: bool = False):
    """L layers' attention halves at one token in one persistent kernel: x_{l+1} = x_l + layer l's attention of
    x_l over its paged context (``attention_half_reference``'s, up to the residual stream's rounding). x [D]
    bf16 at ``position`` (a scalar) of the sequence whose pages are block_table i32[W]; layer l's cache, layer
    ``cache_layer`` + l of c_kv [L', N, bs, 512] / k_pe [L', N, bs, 64], holds the tokens before it (the engine's
    dense layers sit after the MoE stack in its caches); ``weights`` stacked over layers, rope
    columns permuted (``permute_rope_columns``) -> (x_L [D] bf16, kv [L, 576] bf16: each layer's new latent and
    rope key, which the caller writes into the cache at the token's slot), and with ``out_norm`` (weights [D],
    eps) x_L RMSNorm'd by it third (the next sublayer's input, normed by CTA 0 after the last layer); x_L then
    comes in ``residual_dtype`` when given (f32: its bf16 values, for a launch that adds into it in place). With
    ``embedding`` (the table [V, D]), x is a token id (an i32 scalar) and the kernel reads its row from the table
    (the model's lookup, one launch fewer before it). ``launch_dependents``: a programmatic dependent launched
    after it (``dispatch.STEP_KERNEL_PDL``'s expert launch) may be set up from its start.

    A producer warpgroup streams each CTA's boxes of every phase through the ring; a grid barrier ends each of
    five phases a layer (``docs/decode_step_kernel.md``):

    1. RMSNorm(x) into the tiles in every CTA; q_proj and kv_a as (64-column tile, 128-row K step) boxes, ~7 a
       CTA, each tile's sums added by TMA.
    2. q_nope x W_UK, a (head, 64 latent columns) unit a CTA; one CTA rotates q_pe and the new rope key, one
       norms the new latent.
    3. Attention: CTA s takes the context's chunk s (64 tokens of a page), CTA S - 1 the new token as a chunk of
       one, each a partial softmax state of every head (scores and values by wgmma).
    4. The states merged a (head, 64 v columns, 128 latent rows) unit a CTA, times W_UV's box, summed by TMA.
    5. o_proj (``gemv_chain``'s units) and the residual.

    Shapes must pass ``attention_supports``."""
    num_layers, hidden = weights.norm.shape
    num_heads = weights.q_proj.shape[2]
    if embedding is not None:
        if embedding.ndim != 2 or embedding.shape[1] != hidden or jnp.size(x) != 1 or x.dtype != jnp.int32:
            raise ValueError(f"attention_chain: embedding {embedding.shape}, x {x.dtype}{list(x.shape)}; expected the "
                             f"table [V, D={hidden}] and x a token id (int32, one)")
        token, x = x, jax.ShapeDtypeStruct((hidden,), embedding.dtype)  # x: the row's type, for the checks below
    if (x.shape != (hidden,) or not 0 <= cache_layer <= c_kv.shape[0] - num_layers
            or k_pe.shape[:3] != c_kv.shape[:3]):
        raise ValueError(f"attention_chain: x {x.shape}, c_kv {c_kv.shape}, k_pe {k_pe.shape}, "
                         f"cache_layer={cache_layer}; expected x [D={hidden}] and caches [L', N, bs, ...] holding "
                         f"layers cache_layer .. cache_layer + {num_layers - 1}")
    num_ctas = num_sms()
    f32, bf16 = jnp.float32, jnp.bfloat16
    rows = hidden // HALF
    inputs, out_types, constants = attention_operands(position, block_table, c_kv, k_pe, weights, spec, cache_layer)
    if out_norm is not None and out_norm[0].shape != (hidden,):
        raise ValueError(f"attention_chain: out_norm weights {out_norm[0].shape}; expected [D={hidden}]")
    kernel = functools.partial(_attention_body, num_layers=num_layers, num_ctas=num_ctas,
                               out_eps=None if out_norm is None else float(out_norm[1]),
                               embedding=embedding is not None, launch_dependents=launch_dependents, **constants)
    out_type = (jax.ShapeDtypeStruct((num_layers, rows, HALF), f32), *out_types)  # x_mid's rows a layer first
    if residual_dtype is not None and out_norm is None:
        raise ValueError("attention_chain: residual_dtype comes with out_norm (CTA 0's tail writes both)")
    if out_norm is not None:  # x_L normed, and x_L rounded (the kernel's, in place of a conversion after it)
        out_type += (jax.ShapeDtypeStruct((rows, HALF), x.dtype),
                     jax.ShapeDtypeStruct((rows, HALF), residual_dtype or x.dtype))
    scratch = [
        plgpu.SMEM((RING, 2, HALF, HALF), bf16, transforms=_TILING),  # the ring of boxes
        plgpu.SMEM((rows, HALF), f32),  # the layer's input rows
        plgpu.SMEM((rows, HALF), f32),  # the attention norm's weights
        plgpu.RefUnion(  # a phase's buffers
            (plgpu.SMEM((rows * TOKEN_N, HALF), bf16, transforms=_TILING),  # 1, 2, 5: the token's tiles
             plgpu.SMEM((rows, HALF), f32)),  # a unit's input rows
            token_tiles(rows)[1],  # the tiles' bytes as flat rows (and tiles4's, at the start of theirs)
            (plgpu.SMEM((3 * HALF, HALF), bf16, transforms=_TILING),  # 3: the query windows
             plgpu.SMEM((HALF, CHUNK), bf16, transforms=_TILING)),  # P
            (plgpu.SMEM((HALF, HALF), bf16, transforms=_TILING),  # 4: the head's merged rows' tiles
             plgpu.SMEM((2, HALF), f32)),  # the rows
            (plgpu.SMEM((32, ROPE), f32),  # 2: the rope rows (q_pe of each head, the new key)
             plgpu.SMEM((32, ROPE), bf16),  # rotated
             plgpu.SMEM((2, 32, ROPE // 2), f32),  # cos, sin
             plgpu.SMEM((8, HALF), f32),  # the new latent
             plgpu.SMEM((8, HALF), f32),  # kv_a_norm's weights
             plgpu.SMEM((8, HALF), bf16))),  # the normed latent
        plgpu.SMEM((2, HALF), f32),  # partial sums for TMA adds
        plgpu.SMEM((HALF,), bf16),  # a unit's absorbed query columns
        plgpu.SMEM((8, HALF), f32),  # zeros
        plgpu.SMEM((8, HALF), bf16),  # bf16 zeros
        plgpu.Barrier(num_arrivals=2, num_barriers=RING),  # a box's two halves landed
        plgpu.Barrier(num_barriers=RING),  # a slot's products are done
        plgpu.Barrier(num_barriers=1),  # norm weights landed
        plgpu.Barrier(num_arrivals=num_heads + 2, num_barriers=1),  # the rope rows landed
        plgpu.Barrier(num_arrivals=2, num_barriers=1),  # the new latent and its norm's weights landed
    ]
    outs = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("c",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            # the trace's buffer is shared memory: 128 entries a warpgroup fit beside the kernel's (~3 layers)
            approx_math=True, **({"profile_space": 128, "profile_dir": profile_dir} if profile_dir else {})),
    )(*inputs[:3], x.astype(f32).reshape(rows, HALF) if embedding is None else embedding.reshape(-1, rows, HALF),
      *inputs[3:], weights.o_proj.reshape(num_layers, num_heads * V_DIM, hidden),
      *(() if out_norm is None else (out_norm[0].astype(f32).reshape(rows, HALF),)),
      *(() if embedding is None else (token.reshape(1),)))
    kv = outs[4].reshape(num_layers, LATENT + ROPE)
    if out_norm is None:
        return outs[0][-1].reshape(hidden).astype(x.dtype), kv
    return outs[-1].reshape(hidden), kv, outs[-2].reshape(hidden)


def attention_layer_reference(x, position, block_table, c_kv, k_pe, weights: AttentionWeights, spec: AttentionSpec,
                              layer: int, cache_layer: int = 0):
    """``attention_half_reference`` on layer ``layer`` of the stacked weights, over cache layer ``cache_layer`` +
    ``layer`` of the caches [L', ...] -> (x_mid, the row [576] it wrote into that cache layer: the new latent and
    rope key)."""
    block_size = c_kv.shape[2]
    page, offset = block_table[position // block_size], position % block_size
    at = cache_layer + layer
    x, c_l, k_l = attention_half_reference(x, position, block_table, c_kv[at], k_pe[at],
                                           AttentionWeights(*(w[layer] for w in weights)), spec)
    return x, jnp.concatenate([c_l[page, offset], k_l[page, offset]])


def attention_chain_reference(x, position, block_table, c_kv, k_pe, weights: AttentionWeights, spec: AttentionSpec,
                              cache_layer: int = 0, out_norm=None, residual_dtype=None, embedding=None):
    """The same chain with ``attention_half_reference`` a layer -> (x_L, kv [L, 576]: the rows each layer wrote
    into its cache), and with ``out_norm`` (weights [D], eps) x_L normed by it third, x_L in ``residual_dtype``;
    with ``embedding``, x is a token id and its row of the table (``jnp.take``) the chain's input."""
    if embedding is not None:
        x = jnp.take(embedding, jnp.reshape(x, ()), axis=0)
    rows = []
    for layer in range(weights.norm.shape[0]):
        x, row = attention_layer_reference(x, position, block_table, c_kv, k_pe, weights, spec, layer, cache_layer)
        rows.append(row)
    if out_norm is not None:
        return (x.astype(residual_dtype or x.dtype), jnp.stack(rows),
                rms_norm(x, out_norm[0].astype(x.dtype), out_norm[1]))
    return x, jnp.stack(rows)
