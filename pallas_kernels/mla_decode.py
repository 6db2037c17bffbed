"""Multi-head latent attention over the paged latent cache (absorbed form).

Every head of a sequence reads the same cache: the latent c_kv [kv_lora_rank] and the shared rope key
k_pe [rope_dim] of each token. Queries arrive already absorbed: q_latent = q_nope @ W_UK.

The kernel is flash-decoding on the Triton lowering. A program owns (head tile, context split,
sequence): it reads each cache token of its split once for all ``block_h`` heads of the tile and keeps
an f32 online softmax (m, l, acc). Splits cut each query's own context (not the longest possible one)
into equal runs of whole iterations. With one split the program writes the output directly; otherwise
a second small kernel merges the per-split partials. Each iteration gathers ``block_k`` cache rows
through the block table, one row per token, so any page size works (4 … 64, or a whole sequence).

On Hopper, with a head count that is a multiple of 64 (DeepSeek-V3's 128), the Mosaic GPU kernel in
``mla_decode_mgpu.py`` (TMA, wgmma; bf16 caches, and 8-bit ones with a scale a token) replaces this
one: there decode is compute-bound and needs the tensor cores at full width. With few heads (V2-Lite's
16) an 8-bit cache goes to ``mla_decode_8bit_mgpu.py``. ``impl`` picks ("auto", "triton", "mosaic").

An 8-bit latent cache (int8 or fp8, ``pallas_kernels/kv_quant.py``) comes with f32 scales
c_kv_scale [N, bs, G], one per C/G latent elements of a token. The kernel reads the 8-bit rows and
their scales, converts the rows to the dot's operand dtype on the way into the dot (exact), and
applies the scales to the scores and to the probabilities (dot(p * scale, rows)): no dequantized
cache is ever written, so the bytes read per token are the compressed ones. The operand dtype
(``dot_dtype``) is the query's, except for bf16 queries over an fp8 cache in one pool: float16,
which Hopper converts e4m3 to in one instruction (bf16 takes two): 137 against 163 µs at V2-Lite
B64 ctx4096 (H200, ``python -m benchmarks.kvquant --decode-sweep``). Its 10-bit mantissa holds the
bf16 queries' values exactly within f16's range (|q| < 65504). The int8 rows gain nothing from it
(139 µs either way, 1.2 TB/s on the compressed bytes against 3.0 for bf16 rows): where the 8-bit
kernel's time goes is not the conversion's instruction count. A suspect is the operands' layout: 8-bit
tiles have no transposing shared-memory load into the tensor cores' layout, which 16-bit ones do.
``paired=True`` tests that: the rows are read as 16-bit byte pairs and the kernel works on each
group's even and odd columns apart (the query split the same way, the output stored back
interleaved), unpacking the bytes with shifts (int8) or moving e4m3 bits into f16 (fp8) on the loaded
tile. On the H200 it helps int8 (133 -> 120 us, 1.41 TB/s) and fp8 with scale groups (158 -> 148),
not per-token fp8 (139 either way), and is the default for one 8-bit pool: the layout explains some
of the gap to bf16 rows, not most of it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import mla_decode_8bit_mgpu, mla_decode_mgpu
from pallas_kernels.common import dot_precision
from pallas_kernels.kv_quant import dequantize_latent

NUM_SMS = 132  # H100 / H200 SXM
# Splits grow (by powers of two) until the grid has this many programs: one wave over the SMs.
TARGET_PROGRAMS = NUM_SMS
# Combine kernel: splits x latent columns held per program (f32 elements, ~64 registers a thread).
_COMBINE_TILE = 8192
# Running max before any key: finite, so an empty split merges as weight-0 without inf - inf.
_M_INIT = float(jnp.finfo(jnp.float32).min)
_LOG2E = math.log2(math.e)


class DecodeBlocks(NamedTuple):
    block_h: int  # heads per program; >= 16 for the tensor-core dot (fewer heads are padded)
    block_k: int  # cache tokens per inner iteration
    num_warps: int
    num_stages: int


# Keyed by (cache itemsize, smallest head count it serves); the last entry whose head count <= H wins.
# At C=512, R=64 for sm_90 (Triton 3.8): 16 heads x 64 keys, 4 warps is 92 KiB of shared memory and
# ~206 registers; 32 x 64, 8 warps is 112 KiB and ~190: two programs an SM, no spills. 64 heads spill
# the f32 accumulator [block_h, 512]. The bf16 rows are the H200 sweep's best (2026-11-30,
# benchmarks/results/attention_h200_decode.json): 3.23 TB/s at V2-Lite B64 ctx4096, 0.66 at V3 B128
# (where impl="auto" takes the Mosaic GPU kernel instead: 1.62 TB/s).
DECODE_BLOCKS = {
    (2, 1): DecodeBlocks(block_h=16, block_k=64, num_warps=4, num_stages=3),
    (2, 64): DecodeBlocks(block_h=32, block_k=32, num_warps=4, num_stages=3),
    (4, 1): DecodeBlocks(block_h=16, block_k=32, num_warps=4, num_stages=2),
}


# One or two head tiles in all (batch 1 at V2-Lite's 16 heads): latency, not bandwidth. The context is
# spread over as many programs as there are SMs, each one short iteration with nothing to pipeline
# (H200, B1 ctx4096 H16, kernel time per call: 32 keys, 1 stage, 128 splits 4.8 us + combine; the
# throughput row's 64 keys, 3 stages, 64 splits 6.4 us).
LATENCY_BLOCKS = DecodeBlocks(block_h=16, block_k=32, num_warps=4, num_stages=1)
LATENCY_MAX_TILES = 2


def decode_blocks(num_heads: int, itemsize: int, batch: int | None = None) -> DecodeBlocks:
    """The tuned blocks for this head count and cache itemsize; a bf16 decode of at most
    ``LATENCY_MAX_TILES`` (query, head tile) programs before splitting gets ``LATENCY_BLOCKS``."""
    fits = [k for k in DECODE_BLOCKS if k[0] == itemsize and k[1] <= num_heads]
    if not fits:
        fits = [k for k in DECODE_BLOCKS if k[0] == 2 and k[1] <= num_heads]
    blocks = DECODE_BLOCKS[max(fits)]
    if (batch is not None and itemsize == 2
            and batch * pl.cdiv(num_heads, LATENCY_BLOCKS.block_h) <= LATENCY_MAX_TILES):
        return LATENCY_BLOCKS
    return blocks


def default_num_splits(batch: int, num_heads: int, max_context: int, block_h: int, block_k: int) -> int:
    """Smallest power of two that fills ``TARGET_PROGRAMS``, but never a split shorter than one
    ``block_k`` iteration of the longest possible context (more splits would only add empty programs
    and partials to merge)."""
    programs = batch * pl.cdiv(num_heads, block_h)
    max_splits = max(1, pl.cdiv(max_context, block_k))
    splits = 1
    while programs * splits < TARGET_PROGRAMS and splits * 2 <= max_splits:
        splits *= 2
    return splits


def split_range(length, split, num_splits: int, block_k: int, *, maximum=max, minimum=min):
    """Keys [start, end) of split ``split`` of a query with ``length`` keys: its own context cut into
    num_splits equal runs of whole block_k iterations (trailing splits may be empty), so a short
    context spreads over the splits as a long one does. (Runs sized by the longest possible context
    left a 128-token context at batch 1 in one program of 4 iterations, 7 programs idle.) Python ints
    or, inside the kernel, traced ones (with jnp's maximum / minimum)."""
    per_split = pl.cdiv(pl.cdiv(maximum(length, 1), num_splits), block_k) * block_k
    start = split * per_split
    return start, minimum(start + per_split, length)


def _decode_kernel(
    tables_ref,  # i32[S * W]: every block table row, flattened
    seq_ids_ref,  # i32[B]: block-table row of each query
    lengths_ref,  # i32[B]: keys 0..length-1 are attended, length = lengths_ref[b] + length_offset
    q_latent_ref,  # [block_h, C]
    q_pe_ref,  # [block_h, R]
    c_kv_ref,  # [N * bs, C]: the whole latent cache, one row per token slot (8-bit when quantized)
    k_pe_ref,  # [N * bs, R]
    *refs,  # (scale f32[N * bs * G] when quantized); (layer i32[1] with two pools or layer_pages);
    #         (compressed [L * Nc * bs, C] 8-bit, its scales f32[L * Nc * bs * G] when two pools); then
    #         the outputs: one split:
    #         o [block_h, C]; else m f32[block_h], l f32[block_h], acc f32[block_h, C]
    block_size: int,
    table_width: int,
    block_k: int,
    num_splits: int,
    scale_log2e: float,
    num_groups: int,
    quantized: bool,
    pools: tuple[int, int] | None,
    dot_dtype,
    length_offset: int,
    layer_pages: int | None,
    paired: str | None,
    uniform_pages: bool,
):
    refs = list(refs)
    kscale_ref = refs.pop(0) if quantized else None
    layer_ref = refs.pop(0) if pools or layer_pages else None
    comp_ref, comp_scale_ref = (refs.pop(0), refs.pop(0)) if pools else (None,) * 2
    out_refs = refs
    split, b = pl.program_id(1), pl.program_id(2)
    seq_id = seq_ids_ref[b]
    length = lengths_ref[b] + length_offset
    start, end = split_range(length, split, num_splits, block_k, maximum=jnp.maximum, minimum=jnp.minimum)
    num_iters = pl.cdiv(jnp.maximum(end - start, 0), block_k)

    # The latent splits into num_groups column groups of one scale each (one group unquantized).
    compute_dtype = jnp.dtype(dot_dtype or q_pe_ref.dtype)
    q_pe = q_pe_ref[...].astype(compute_dtype)
    block_h, latent_dim = q_latent_ref.shape
    rope_dim = q_pe_ref.shape[1]
    group = latent_dim // num_groups
    group_cols = lambda g: pl.ds(g * group, group)
    if paired:  # c_kv_ref holds byte pairs [N * bs, C / 2] i16: each group is two parts, its even and
        # its odd columns (the pairs' low and high bytes), so the keys need no byte shuffle
        heads = jnp.arange(block_h)[:, None]
        part_cols = [g * group + 2 * jnp.arange(group // 2) + half for g in range(num_groups) for half in (0, 1)]
        q_groups = [plgpu.load(q_latent_ref.at[heads, cols[None, :]]).astype(compute_dtype) for cols in part_cols]
    else:
        q_groups = [q_latent_ref[:, group_cols(g)].astype(compute_dtype) for g in range(num_groups)]  # [block_h, C/G]
    latent_cols = jnp.arange(group // 2 if paired else group)[None, :]
    rope_cols = jnp.arange(rope_dim)[None, :]
    contract_last = (((1,), (1,)), ((), ()))
    if pools:  # two pools: global block ids [0, Nf) full precision, [Nf, Nf + Nc) compressed; this layer's
        # rows sit at layer * (pool size) in each flattened pool, k_pe spans both pools
        num_full, num_compressed = pools
        layer = layer_ref[0]

    def load_latent(slots_or_rows, g, valid, ref):
        width = latent_cols.shape[1]  # a group's columns, or its byte pairs
        window = ref.at[slots_or_rows[:, None], g * width + latent_cols]
        if jnp.dtype(ref.dtype) == jnp.float8_e4m3fn:
            # Triton cannot splat a fill value into fp8: masked lanes read a valid slot instead
            # (page 0's, or this layer's first compressed block's), finite, and get weight 0
            return plgpu.load(window)
        return plgpu.load(window, mask=valid[:, None], other=0)

    def body(i, carry):
        m, l, accs = carry  # f32[block_h] (log2 units), f32[block_h], G x f32[block_h, C/G]
        token = start + i * block_k + jnp.arange(block_k)  # i32[block_k]
        valid = token < end
        # Masked lanes read page 0 / zeros: no out-of-range table column, no stale NaN in the cache.
        page = plgpu.load(tables_ref.at[seq_id * table_width + token // block_size],
                          mask=valid, other=0)
        offset = token % block_size
        if pools:
            is_full = page < num_full
            slots = (layer * num_full + jnp.where(is_full, page, 0)) * block_size + offset  # full pool
            comp_slots = (layer * num_compressed + jnp.where(is_full, 0, page - num_full)) * block_size + offset
            pe_slots = (layer * (num_full + num_compressed) + page) * block_size + offset
        else:
            if layer_pages:  # layer-local page ids into every layer's pages
                page = page + layer_ref[0] * layer_pages
            slots = pe_slots = page * block_size + offset  # [block_k]
        keys_pe = plgpu.load(k_pe_ref.at[pe_slots[:, None], rope_cols], mask=valid[:, None],
                             other=0).astype(compute_dtype)
        precision = dot_precision(compute_dtype)
        scores = lambda q, keys: jax.lax.dot_general(q, keys, contract_last, preferred_element_type=jnp.float32,
                                                     precision=precision)  # [block_h, block_k]
        s = scores(q_pe, keys_pe)
        keys, kscales = [], []
        if uniform_pages:  # the iteration's keys lie in one page, so in one pool: read only that one
            first_page = tables_ref[seq_id * table_width + (start + i * block_k) // block_size]

            def read(ref, rows, scales):
                return (tuple(load_latent(rows, g, valid, ref).astype(compute_dtype) for g in range(num_groups)),
                        tuple(jnp.ones((block_k,), jnp.float32) if scales is None else
                              plgpu.load(scales.at[rows * num_groups + g], mask=valid, other=0.0)
                              for g in range(num_groups)))

            pool_keys, pool_scales = jax.lax.cond(first_page < num_full, lambda: read(c_kv_ref, slots, None),
                                                  lambda: read(comp_ref, comp_slots, comp_scale_ref))
        for g in range(num_groups):
            if uniform_pages:
                k_g, kscale = pool_keys[g], pool_scales[g]
            elif pools:  # each lane reads one pool (masked); the other load of a lane is masked off or,
                # for fp8, a re-read of one L2-resident row
                k_full = load_latent(slots, g, valid & is_full, c_kv_ref).astype(compute_dtype)
                k_comp = load_latent(comp_slots, g, valid & ~is_full, comp_ref).astype(compute_dtype)
                k_g = jnp.where(is_full[:, None], k_full, k_comp)
                kscale = plgpu.load(comp_scale_ref.at[comp_slots * num_groups + g], mask=valid & ~is_full,
                                    other=0.0)
                kscale = jnp.where(is_full, 1.0, kscale)
            elif paired:  # [block_k, C/G/2] pairs -> the group's even and odd columns, exact
                kscale = plgpu.load(kscale_ref.at[slots * num_groups + g], mask=valid, other=0.0)  # f32[bk]
                halves, kscale = _unpack_pairs(load_latent(slots, g, valid, c_kv_ref), paired, kscale)
                s_g = sum(scores(q_groups[2 * g + h], halves[h].astype(compute_dtype)) for h in (0, 1))
                s = s + s_g * kscale[None, :]
                keys += [k.astype(compute_dtype) for k in halves]
                kscales += [kscale, kscale]
                continue
            else:
                k_g = load_latent(slots, g, valid, c_kv_ref).astype(compute_dtype)  # [block_k, C/G]; exact
                if quantized:
                    kscale = plgpu.load(kscale_ref.at[slots * num_groups + g], mask=valid, other=0.0)  # f32[bk]
            s_g = scores(q_groups[g], k_g)
            if quantized or pools:
                s_g = s_g * kscale[None, :]
                kscales.append(kscale)
            s = s + s_g
            keys.append(k_g)
        s = jnp.where(valid[None, :], s * scale_log2e, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        correction = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * correction + p.sum(axis=1)
        accs = tuple(
            acc * correction[:, None]
            + jnp.dot((p * kscales[g][None, :] if kscales else p).astype(compute_dtype), keys[g],
                      preferred_element_type=jnp.float32, precision=precision)
            for g, acc in enumerate(accs))
        return m_new, l, accs

    init = (jnp.full((block_h,), _M_INIT, jnp.float32), jnp.zeros((block_h,), jnp.float32),
            tuple(jnp.zeros(q.shape, jnp.float32) for q in q_groups))
    m, l, accs = jax.lax.fori_loop(0, num_iters, body, init)

    def store(ref, part, value):  # part ``part``'s columns of a [block_h, C] output
        if paired:
            plgpu.store(ref.at[heads, part_cols[part][None, :]], value.astype(ref.dtype))
        else:
            ref[:, group_cols(part)] = value.astype(ref.dtype)

    if len(out_refs) == 1:
        (o_ref,) = out_refs
        # l == 0 only for an empty context (length 0, e.g. a padding token): output zeros.
        denom = jnp.where(l == 0, 1.0, l)[:, None]
        for part, acc in enumerate(accs):
            store(o_ref, part, acc / denom)
    else:
        m_ref, l_ref, acc_ref = out_refs
        m_ref[...] = m
        l_ref[...] = l
        for part, acc in enumerate(accs):
            store(acc_ref, part, acc)


def _unpack_pairs(pairs, stored: str, kscale):
    """i16 byte pairs [bk, n] of an 8-bit cache -> ((low bytes, high bytes) as [bk, n] values, kscale):
    int8 bytes sign-extended by shifts; fp8 e4m3 bytes moved bit for bit into f16 (sign, then exponent and
    mantissa shifted 7 places: the f16 reads 2^-8 of the e4m3 value, subnormals included, which kscale
    takes back). Both are elementwise on the loaded tile, so the dot operands need no byte shuffle."""
    shift = lambda x, n: jax.lax.shift_right_arithmetic(x, jnp.int16(n))
    low, high = shift(pairs << jnp.int16(8), 8), shift(pairs, 8)  # sign-extended bytes
    if stored == "int8":
        return (low, high), kscale
    to_f16 = lambda b: jax.lax.bitcast_convert_type(((b & jnp.int16(0x80)) << jnp.int16(8))
                                                    | ((b & jnp.int16(0x7F)) << jnp.int16(7)), jnp.float16)
    return (to_f16(low), to_f16(high)), kscale * 256.0


def _combine_kernel(
    m_ref,  # f32[num_splits] (log2 units)
    l_ref,  # f32[num_splits]
    acc_ref,  # f32[num_splits, block_c]
    o_ref,  # [block_c]
):
    m = m_ref[...]
    weight = jnp.exp2(m - m.max())  # empty splits: l = 0 and acc = 0, so their weight is moot
    denom = (weight * l_ref[...]).sum()
    o = (weight[:, None] * acc_ref[...]).sum(axis=0)
    o_ref[...] = (o / jnp.where(denom == 0, 1.0, denom)).astype(o_ref.dtype)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _mla_attention(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, lengths, scale, *,
                   c_kv_scale, num_splits, block_h, block_k, num_warps, num_stages, interpret,
                   compressed=None, pools=None, impl="auto", dot_dtype=None, length_offset=0,
                   layer=None, layer_pages=None, paired=None, uniform_pages=None):
    """Shared body of mla_decode / mla_paged: query b attends keys 0..lengths[b]+length_offset-1 of
    table row seq_ids[b]. q_latent [B, H, C], q_pe [B, H, R] -> [B, H, C] in q_latent.dtype. With
    ``layer_pages`` the tables hold layer ``layer``'s page ids and c_kv / k_pe every layer's pages, layer
    l's page p at row l * layer_pages + p (added inside the kernel, as the lengths' offset is).
    ``paired`` (an 8-bit cache in one pool): the kernel reads the latent rows as 16-bit byte pairs and
    works on their even and odd columns apart (``_unpack_pairs``). ``uniform_pages`` (two pools, pages a
    multiple of block_k tokens): each iteration reads only the pool its page lies in (a branch), not
    both pools masked. None (the default) turns each on wherever it applies: on the H200 (V2-Lite,
    batch 64, 4k context; benchmarks/results/kvquant_kernels_h200.json) byte pairs take int8 from 133
    to 120 us and fp8 with 128-wide scale groups from 158 to 148 (per-token fp8 even, 139 us); a pool
    per page takes the two-pool path from 428 to 141 us (int8) and from 510 to 158 (fp8).

    Two pools (``pools`` = (Nf, Nc) static, ``compressed`` = (c_kv 8-bit [L * Nc, bs, C], scales
    f32[L * Nc, bs, G], layer i32)): c_kv is the full-precision pool [L * Nf, bs, C], k_pe spans both
    [L * (Nf + Nc), bs, R], and the tables hold global block ids (no layer offset)."""
    batch, num_heads, latent_dim = q_latent.shape
    triton_options = bool(block_h or block_k or paired or dot_dtype)  # tuning knobs of the Triton kernel
    if pools:
        comp_c_kv, comp_scale, layer = compressed
        num_groups = comp_scale.shape[-1]
        if c_kv_scale is not None:
            raise ValueError("two pools keep the full-precision pool unquantized: c_kv_scale must be None")
    quantized = c_kv_scale is not None
    if not pools:
        num_groups = c_kv_scale.shape[-1] if quantized else 1
    if quantized and (c_kv_scale.shape[:2] != c_kv.shape[:2] or latent_dim % num_groups):
        raise ValueError(f"c_kv_scale has shape {c_kv_scale.shape}; expected [N, bs, G] = "
                         f"[{c_kv.shape[0]}, {c_kv.shape[1]}, G] with G dividing kv_lora_rank={latent_dim}")
    if not quantized and jnp.dtype(c_kv.dtype).itemsize == 1:
        raise ValueError(f"an 8-bit latent cache ({c_kv.dtype}) needs its c_kv_scale")
    q_pe = q_pe.astype(q_latent.dtype)
    rope_dim = q_pe.shape[-1]
    num_pages, block_size = c_kv.shape[:2]
    table_width = block_tables.shape[1]
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not supported; accepted: {', '.join(IMPLS)}")
    if interpret and impl != "mosaic":  # "auto" in interpret mode: the Triton kernel
        why_not = "interpret mode"
    elif pools:
        why_not = "two pools"
    elif quantized and q_latent.dtype != jnp.bfloat16:
        why_not = f"{jnp.dtype(q_latent.dtype).name} queries (its dots take bf16)"
    else:
        why_not = mosaic_why_not(num_heads, latent_dim, rope_dim, block_size, c_kv.dtype, num_groups,
                                 interpret=interpret)
    if impl == "mosaic" and why_not:
        raise ValueError(f"impl='mosaic' cannot run here: {why_not}")
    # "auto" takes a Mosaic kernel where it runs and beats the Triton one: bf16 caches, 8-bit ones with
    # many heads, and with few heads those in mla_decode_8bit_mgpu.AUTO_DTYPES (int8, fp8; its docstring
    # has the numbers).
    few_head_8bit = _few_head_8bit(num_heads, c_kv.dtype)
    faster = not few_head_8bit or jnp.dtype(c_kv.dtype).name in mla_decode_8bit_mgpu.AUTO_DTYPES
    if impl == "mosaic" or (impl == "auto" and not why_not and not triton_options and faster):
        if layer_pages:
            block_tables = block_tables + layer * layer_pages
        lengths = lengths + length_offset
        if few_head_8bit:
            return _mla_attention_8bit_mosaic(q_latent, q_pe, c_kv, k_pe, c_kv_scale, block_tables, seq_ids,
                                              lengths, scale, num_splits=num_splits, interpret=interpret)
        return _mla_attention_mosaic(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, lengths, scale,
                                     num_splits=num_splits, c_kv_scale=c_kv_scale, interpret=interpret)
    if (dot_dtype is None and jnp.dtype(c_kv.dtype) == jnp.float8_e4m3fn and not pools
            and q_latent.dtype == jnp.bfloat16):
        dot_dtype = "float16"  # see the module docstring
    blocks = decode_blocks(num_heads, jnp.dtype(c_kv.dtype).itemsize, batch)
    block_h = block_h or blocks.block_h
    block_k = block_k or blocks.block_k
    num_warps = num_warps or blocks.num_warps
    num_stages = num_stages or blocks.num_stages
    max_context = table_width * block_size
    num_splits = num_splits or default_num_splits(batch, num_heads, max_context, block_h, block_k)
    if not interpret:
        for name, value in (("kv_lora_rank", latent_dim), ("rope_dim", rope_dim),
                            ("block_h", block_h), ("block_k", block_k), ("scale groups", num_groups)):
            if not _is_pow2(value):
                raise ValueError(f"mla_decode on the Triton lowering needs {name} to be a power of "
                                 f"two, got {value}")
    if num_splits > 1 and not _is_pow2(num_splits):
        raise ValueError(f"num_splits must be a power of two (the combine loads all splits at "
                         f"once), got {num_splits}")

    head_tiles = pl.cdiv(num_heads, block_h)
    padded_heads = head_tiles * block_h
    if padded_heads != num_heads:  # zero queries: finite scores, rows dropped below
        pad = ((0, 0), (0, padded_heads - num_heads), (0, 0))
        q_latent, q_pe = jnp.pad(q_latent, pad), jnp.pad(q_pe, pad)

    if paired is None:
        paired = quantized and not pools
    if uniform_pages is None:
        uniform_pages = bool(pools) and block_size % block_k == 0
    if uniform_pages and (not pools or block_size % block_k):
        raise ValueError(f"uniform_pages=True reads two pools with pages a multiple of block_k; got pools={pools}, "
                         f"page size {block_size}, block_k={block_k}")
    stored = None
    latent_rows = c_kv.reshape(num_pages * block_size, latent_dim)
    if paired:
        if not quantized or pools:
            raise ValueError("paired=True reads an 8-bit cache in one pool (with c_kv_scale) as byte pairs")
        stored = "fp8" if jnp.dtype(c_kv.dtype) == jnp.float8_e4m3fn else "int8"
        latent_rows = jax.lax.bitcast_convert_type(latent_rows.reshape(-1, latent_dim // 2, 2), jnp.int16)
    kernel = functools.partial(
        _decode_kernel, block_size=block_size, table_width=table_width, block_k=block_k,
        num_splits=num_splits, scale_log2e=scale * _LOG2E, num_groups=num_groups,
        quantized=quantized, pools=pools, dot_dtype=dot_dtype, length_offset=length_offset,
        layer_pages=None if pools else layer_pages, paired=stored, uniform_pages=uniform_pages)
    whole = pl.BlockSpec()  # indexed by hand inside the kernel
    f32 = jnp.float32
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((batch, padded_heads, latent_dim), q_latent.dtype)
        out_specs = pl.BlockSpec((None, block_h, latent_dim), lambda h, s, b: (b, h, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((batch, padded_heads, num_splits), f32),
                     jax.ShapeDtypeStruct((batch, padded_heads, num_splits), f32),
                     jax.ShapeDtypeStruct((batch, padded_heads, num_splits, latent_dim), f32))
        out_specs = (pl.BlockSpec((None, block_h, None), lambda h, s, b: (b, h, s)),
                     pl.BlockSpec((None, block_h, None), lambda h, s, b: (b, h, s)),
                     pl.BlockSpec((None, block_h, None, latent_dim), lambda h, s, b: (b, h, s, 0)))
    # Head tiles vary fastest in launch order: the tiles of one (split, sequence) run together and
    # share its cache pages through L2.
    partials = pl.pallas_call(
        kernel,
        grid=(head_tiles, num_splits, batch),
        in_specs=[whole, whole, whole,
                  pl.BlockSpec((None, block_h, latent_dim), lambda h, s, b: (b, h, 0)),
                  pl.BlockSpec((None, block_h, rope_dim), lambda h, s, b: (b, h, 0)),
                  whole, whole, *([whole] if quantized else []), *([whole] if pools or layer_pages else []),
                  *([whole] * 2 if pools else [])],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"mla_decode_h{block_h}_k{block_k}_s{num_splits}" + (f"_q{num_groups}" if quantized else "")
        + (f"_pools{num_groups}" if pools else "") + ("_paired" if paired else ""),
    )(block_tables.reshape(-1), seq_ids, lengths, q_latent, q_pe, latent_rows,
      k_pe.reshape(-1, rope_dim),  # free reshapes: contiguous rows
      *([c_kv_scale.reshape(-1).astype(jnp.float32)] if quantized else []),
      *([jnp.asarray(layer, jnp.int32).reshape(1)] if pools or layer_pages else []),
      *([comp_c_kv.reshape(-1, latent_dim), comp_scale.reshape(-1).astype(jnp.float32)] if pools else []))
    if num_splits == 1:
        return partials[:, :num_heads]

    m, l, acc = partials
    return combine_splits(m, l, acc, q_latent.dtype, splits_axis=2, num_heads=num_heads, interpret=interpret)


def _few_head_8bit(num_heads: int, cache_dtype) -> bool:
    """Whether the Mosaic GPU kernel for these shapes is ``mla_decode_8bit_mgpu`` (an 8-bit cache, heads
    not a multiple of 64) rather than ``mla_decode_mgpu``."""
    return jnp.dtype(cache_dtype).itemsize == 1 and num_heads % mla_decode_mgpu.BLOCK_H != 0


def mosaic_why_not(num_heads: int, latent_dim: int, rope_dim: int, block_size: int, cache_dtype,
                    num_groups: int = 1, interpret: bool = False) -> str | None:
    """None when a Mosaic GPU kernel runs a one-pool cache of these shapes (``mla_decode_mgpu`` for bf16
    caches and heads a multiple of 64, ``mla_decode_8bit_mgpu`` for 8-bit caches with fewer heads), else
    why not; ``interpret``: in interpret mode (any machine)."""
    kernel = mla_decode_8bit_mgpu if _few_head_8bit(num_heads, cache_dtype) else mla_decode_mgpu
    return kernel.supports(num_heads, latent_dim, rope_dim, block_size, cache_dtype, num_groups, interpret=interpret)


def _mla_attention_mosaic(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, lengths, scale, *, num_splits,
                          c_kv_scale=None, interpret=False):
    """The Mosaic GPU kernel (Hopper, H a multiple of 64; a bf16 or an 8-bit cache) with its splits and
    their merge."""
    batch, num_heads = q_latent.shape[:2]
    block = mla_decode_mgpu.BLOCK_K
    max_context = block_tables.shape[1] * c_kv.shape[1]
    # One CTA an SM (the kernel fills shared memory): splits grow until the grid covers the SMs.
    num_splits = num_splits or default_num_splits(batch, num_heads, max_context, mla_decode_mgpu.BLOCK_H, block)
    tokens_per_split = pl.cdiv(pl.cdiv(max_context, num_splits), block) * block
    out = mla_decode_mgpu.mla_decode_mgpu(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, lengths, scale,
                                          num_splits=num_splits, tokens_per_split=tokens_per_split,
                                          c_kv_scale=c_kv_scale, interpret=interpret)
    if num_splits == 1:
        return out.astype(q_latent.dtype)
    return combine_splits(*out, q_latent.dtype, splits_axis=1, interpret=interpret)


def _mla_attention_8bit_mosaic(q_latent, q_pe, c_kv, k_pe, c_kv_scale, block_tables, seq_ids, lengths, scale, *,
                               num_splits, interpret=False):
    """The Mosaic GPU kernel over an 8-bit cache (Hopper, a scale a token, few heads): it writes O^T
    (tokens on wgmma's M side), so its output and partials are transposed back here."""
    batch, num_heads = q_latent.shape[:2]
    block = mla_decode_8bit_mgpu.BLOCK_K
    max_context = block_tables.shape[1] * c_kv.shape[1]
    # One CTA a query and split, one CTA an SM: the most splits (a power of two) that keep the grid within
    # one wave (H200, V2-Lite batch 64, 4k context: 2 splits 94-97 us, 4 splits 99-105).
    if not num_splits:
        num_splits = 1
        while batch * num_splits * 2 <= NUM_SMS and num_splits * 2 <= pl.cdiv(max_context, block):
            num_splits *= 2
    out = mla_decode_8bit_mgpu.mla_decode_8bit_mgpu(q_latent, q_pe, c_kv, k_pe, c_kv_scale, block_tables, seq_ids,
                                                    lengths, scale, num_splits=num_splits, interpret=interpret)
    if num_splits == 1:
        return out.swapaxes(1, 2).astype(q_latent.dtype)
    m, l, acc = out
    return combine_splits(m, l, acc.swapaxes(2, 3), q_latent.dtype, splits_axis=1, interpret=interpret)


def combine_splits(m, l, acc, dtype, *, splits_axis: int, num_heads: int | None = None, interpret: bool = False):
    """Merges flash-decoding partials: m, l f32 (log2-unit running max, softmax denominator) and acc f32
    (unnormalized output), laid out [B, H, S] / [B, H, S, C] (splits_axis=2, the Triton kernel) or
    [B, S, H] / [B, S, H, C] (splits_axis=1, the Mosaic kernel) -> [B, H, C] in ``dtype``; only the first
    ``num_heads`` heads (the rest are padding)."""
    if splits_axis == 2:
        batch, _, num_splits, latent_dim = acc.shape
        row, row_block = (lambda h, c, b: (b, h, 0)), (None, None, num_splits)
        tile = lambda h, c, b: (b, h, 0, c)
        tile_block = lambda block_c: (None, None, num_splits, block_c)
    else:
        batch, num_splits, _, latent_dim = acc.shape
        row, row_block = (lambda h, c, b: (b, 0, h)), (None, num_splits, None)
        tile = lambda h, c, b: (b, 0, h, c)
        tile_block = lambda block_c: (None, num_splits, None, block_c)
    num_heads = num_heads or acc.shape[3 - splits_axis]
    # Columns a program: all splits of block_c columns in registers, but halved (down to 32) until the
    # grid covers the SMs (H200 batch 1, 16 heads, 64 splits: 128 columns 2.8 us, 32 columns 2.1 us).
    block_c = min(latent_dim, max(1, _COMBINE_TILE // num_splits))
    while block_c > 32 and num_heads * batch * pl.cdiv(latent_dim, block_c) < NUM_SMS:
        block_c //= 2
    return pl.pallas_call(
        _combine_kernel,
        grid=(num_heads, pl.cdiv(latent_dim, block_c), batch),
        in_specs=[pl.BlockSpec(row_block, row), pl.BlockSpec(row_block, row),
                  pl.BlockSpec(tile_block(block_c), tile)],
        out_specs=pl.BlockSpec((None, None, block_c), lambda h, c, b: (b, h, c)),
        out_shape=jax.ShapeDtypeStruct((batch, num_heads, latent_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mla_decode_combine",
    )(m, l, acc)


_STATIC = ("scale", "num_splits", "block_h", "block_k", "num_warps", "num_stages", "interpret", "impl", "dot_dtype",
           "paired")
# "auto": a Mosaic GPU kernel where it runs (Hopper, pages a multiple of 64 tokens; heads a multiple of 64
# with a bf16 cache or an 8-bit one with a scale a token, mla_decode_mgpu.supports; or an 8-bit cache with
# a scale a token and 16 or 32 heads, mla_decode_8bit_mgpu.supports), else the Triton one. "triton" /
# "mosaic" force one.
IMPLS = ("auto", "triton", "mosaic")
_STATIC_PAGED = (*_STATIC, "pools", "layer_pages", "uniform_pages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mla_decode(q_latent, q_pe, c_kv, k_pe, block_tables, lengths, scale, *, c_kv_scale=None, num_splits=None,
               block_h=None, block_k=None, num_warps=None, num_stages=None, interpret=False, impl="auto",
               dot_dtype=None, paired=None):
    """One query token per sequence; the semantics of ``mla_decode_reference``.

    q_latent [B, H, C], q_pe [B, H, R], c_kv [N, bs, C], k_pe [N, bs, R], block_tables i32[B, W],
    lengths i32[B] (the new token's key included; 0 gives zeros) -> [B, H, C] in q_latent.dtype.
    ``scale`` is a Python float. An 8-bit c_kv (int8 / float8_e4m3fn) comes with c_kv_scale
    f32[N, bs, G]. Unset tuning arguments come from ``DECODE_BLOCKS`` and ``default_num_splits``;
    num_splits must be a power of two. ``interpret``: on the CPU, the Triton kernel, or with
    impl="mosaic" the Mosaic one (``mgpu_interpret``).
    """
    batch = q_latent.shape[0]
    return _mla_attention(q_latent, q_pe, c_kv, k_pe, block_tables,
                          jnp.arange(batch, dtype=jnp.int32), lengths.astype(jnp.int32), scale,
                          c_kv_scale=c_kv_scale, num_splits=num_splits, block_h=block_h, block_k=block_k,
                          num_warps=num_warps, num_stages=num_stages, interpret=interpret, impl=impl,
                          dot_dtype=dot_dtype, paired=paired)


@functools.partial(jax.jit, static_argnames=_STATIC_PAGED)
def mla_paged(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale, *, c_kv_scale=None,
              compressed=None, pools=None, layer=None, layer_pages=None, num_splits=None, block_h=None, block_k=None,
              num_warps=None, num_stages=None, interpret=False, impl="auto", dot_dtype=None, paired=None,
              uniform_pages=None):
    """The engine's entry; the semantics of ``mla_paged_reference``.

    q_latent [T, H, C], q_pe [T, H, R], c_kv [N, bs, C], k_pe [N, bs, R], block_tables i32[S, W],
    seq_ids i32[T], positions i32[T] -> [T, H, C]. Each token is one decode query over keys
    0..positions[t] of row seq_ids[t]: chunked-prefill tokens re-read their shared context, which
    is cheap next to the prefill's own FLOPs. A negative position (padding) gives zeros, not NaN.
    An 8-bit c_kv comes with c_kv_scale f32[N, bs, G]. Two pools (distance-aware precision): see
    ``mla_paged_pools_reference``; ``compressed`` = (c_kv_compressed, compressed_scale, layer),
    ``pools`` = (Nf, Nc). With ``layer_pages`` (one pool), c_kv / k_pe hold every layer's pages
    [L * layer_pages, bs, ...] and the tables layer ``layer``'s page ids (the kernel adds the offset).
    """
    return _mla_attention(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids.astype(jnp.int32),
                          positions.astype(jnp.int32), scale, compressed=compressed, pools=pools, length_offset=1,
                          layer=layer, layer_pages=layer_pages,
                          c_kv_scale=c_kv_scale, num_splits=num_splits, block_h=block_h, block_k=block_k,
                          num_warps=num_warps, num_stages=num_stages, interpret=interpret, impl=impl,
                          dot_dtype=dot_dtype, paired=paired, uniform_pages=uniform_pages)


def mla_paged_reference(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale, c_kv_scale=None):
    """Ragged paged attention, one query token at a time.

    q_latent [T, H, C], q_pe [T, H, R]; c_kv [N, bs, C], k_pe [N, bs, R] (the paged caches);
    block_tables i32[S, W]; seq_ids i32[T] (row of block_tables per token); positions i32[T].
    Token t attends to the keys at positions 0..positions[t] of sequence seq_ids[t], which the caller
    has already written (this covers decode, chunked prefill and prefix-cache hits alike). An 8-bit
    c_kv comes with its scales c_kv_scale f32[N, bs, G] (each block dequantized as it is read).
    Returns the latent context [T, H, C] in q_latent.dtype. Online softmax over blocks in f32, looping
    only as far as the longest context in the batch.
    """
    num_tokens, num_heads, latent_dim = q_latent.shape
    block_size = c_kv.shape[1]
    tables = block_tables[seq_ids]  # [T, W]
    q_latent32 = q_latent.astype(jnp.float32)
    q_pe32 = q_pe.astype(jnp.float32)
    num_blocks = jnp.max(positions) // block_size + 1

    def body(j, carry):
        m, l, acc = carry  # [T, H], [T, H], [T, H, C]
        blocks = tables[:, j]
        if c_kv_scale is None:
            keys = c_kv[blocks].astype(jnp.float32)  # [T, bs, C]
        else:
            keys = dequantize_latent(c_kv[blocks], c_kv_scale[blocks])
        keys_pe = k_pe[blocks].astype(jnp.float32)  # [T, bs, R]
        s = (jnp.einsum("thc,tkc->thk", q_latent32, keys)
             + jnp.einsum("thr,tkr->thk", q_pe32, keys_pe)) * scale
        key_pos = j * block_size + jnp.arange(block_size)
        s = jnp.where(key_pos[None, None, :] <= positions[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum("thk,tkc->thc", p, keys)
        return m_new, l, acc

    # *_like: the carries take the query's varying mesh axes when this runs inside a shard_map.
    init = (jnp.full_like(q_latent32[..., 0], -jnp.inf), jnp.zeros_like(q_latent32[..., 0]),
            jnp.zeros_like(q_latent32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    return (acc / l[..., None]).astype(q_latent.dtype)


def pool_views(c_kv, k_pe, compressed, pools, block_tables):
    """One layer's view of two pools as a single 8-bit-or-not cache for the reference: the blocks of
    both pools dequantized to f32 and concatenated [Nf + Nc, bs, C], indexed by the global ids of the
    tables; plus this layer's k_pe [Nf + Nc, bs, R]. (References may materialize; kernels do not.)"""
    comp_c_kv, comp_scale, layer = compressed
    num_full, num_compressed = pools
    take = lambda a, n: jax.lax.dynamic_slice_in_dim(a, layer * n, n, axis=0)
    latent = jnp.concatenate([take(c_kv, num_full).astype(jnp.float32),
                              dequantize_latent(take(comp_c_kv, num_compressed), take(comp_scale, num_compressed))])
    return latent, take(k_pe, num_full + num_compressed), block_tables


def mla_paged_pools_reference(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale, compressed,
                              pools):
    """mla_paged_reference over two pools: global block ids [0, Nf) in the full-precision pool c_kv
    [L * Nf, bs, C], [Nf, Nf + Nc) in the 8-bit compressed[0] [L * Nc, bs, C] with scales compressed[1]
    [L * Nc, bs, G]; k_pe [L * (Nf + Nc), bs, R]; compressed[2] the layer (i32)."""
    latent, layer_k_pe, tables = pool_views(c_kv, k_pe, compressed, pools, block_tables)
    return mla_paged_reference(q_latent, q_pe, latent, layer_k_pe, tables, seq_ids, positions, scale)


def mla_decode_reference(q_latent, q_pe, c_kv, k_pe, block_tables, lengths, scale, c_kv_scale=None):
    """One query token per sequence at position lengths-1.

    q_latent [B, H, C], q_pe [B, H, R], c_kv [N, bs, C], k_pe [N, bs, R], block_tables i32[B, W],
    lengths i32[B] (>= 1, the new token's key included) -> [B, H, C].
    """
    batch = q_latent.shape[0]
    return mla_paged_reference(q_latent, q_pe, c_kv, k_pe, block_tables,
                               jnp.arange(batch, dtype=jnp.int32), lengths - 1, scale, c_kv_scale)
