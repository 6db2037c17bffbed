"""Paged MLA decode on Hopper through Mosaic GPU (TMA + wgmma): the kernel for many heads.

The semantics are ``mla_paged_reference`` (pallas_kernels/mla_decode.py), restricted to a bf16 or an
8-bit cache (a scale a token) with pages of a multiple of 64 tokens and a head count that is a multiple
of 64. At DeepSeek-V3's 128 heads decode is compute-bound (every 1,152-byte cache token meets 128
heads: 2 x 128 x (576 + 512) FLOPs, ~242 FLOPs a byte), so the tensor cores must do the work: the
Triton kernel's per-program dots reach ~150 TFLOP/s there. Here one CTA owns 64 heads of one query and
one context split, and three warpgroups share it:

- the memory warpgroup walks the block table and TMA-loads each 64-token slab of the latent cache
  (c_kv [64, 512] and k_pe [64, 64]) into a two-stage ring;
- compute warpgroup 0 holds the queries in shared memory, computes the scores S = q_latent c_kv^T +
  q_pe k_pe^T (wgmma, f32), the online softmax (log2 units), hands P (bf16) and the rescale factor to
  warpgroup 1 through shared memory, and accumulates P c_kv[:, :256];
- compute warpgroup 1 accumulates P c_kv[:, 256:].

The cache slab is read from HBM once per 64 heads and used twice (keys and values are the same
latent). With one split the CTA writes the bf16 output; with several it writes f32 partials (m, l,
unnormalized acc) that ``combine_splits`` merges, as for the Triton kernel.

Tokens of a page past the context are masked in the scores (weight 0); the pool they come from is
finite (zero-initialized, written only with real latents), as the kernel's P x V relies on.

An 8-bit cache (int8 or fp8 e4m3, one f32 scale a token: ``c_kv_scale``) runs the same compute
pipeline over 16-bit slabs that the memory warpgroup makes: it loads each slab's 8-bit rows from HBM
into registers (issued before its ring slot is free, so their latency overlaps the wait), converts them
(exact: int8 -> bf16, e4m3 -> f16, the dots' operand type; the queries are cast to it) into the 16-bit
ring and TMA-loads k_pe and the scales beside them. The scale goes onto the scores' columns,
q . (stored x scale) = (q . stored) x scale with the rope part added unscaled, and into P (P x scale)
for the values. q_pe comes from HBM straight into registers (P's buffer holds the dots' type, not bf16).

Measured on the H200 (DeepSeek-V3 shape, 128 heads, batch 128, 2k context; ``python -m
benchmarks.mla_8bit_probe --many-heads``, 2026-12-01, ``benchmarks/results/mla8_many_h200.txt``):
int8 315 us, fp8 305 us, bf16 rows 186 us. The compute warpgroups converting instead (each its half of
the columns, into one shared 16-bit slab beside an 8-bit ring: two converted slabs do not fit beside the
queries) took 403 / 400 us in the same call (384 / 378 in ``kvquant.json``), the conversion between one
step's value products and the next step's scores; the Triton kernel's byte pairs take 517 / 583 us.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu_interpret
from pallas_kernels.common import why_not_hopper

BLOCK_H = 64  # heads per CTA: one wgmma M tile
BLOCK_K = 64  # cache tokens per pipeline step
STAGES = 2  # cache slabs in flight: 2 x 72 KiB, with the 72 KiB of queries, fills shared memory
LATENT_DIM = 512
ROPE_DIM = 64
_HALF = LATENT_DIM // 2  # output columns per compute warpgroup
CACHE_DTYPES = (jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn)
CHUNK = 128  # 8-bit caches: latent columns loaded and converted at a time
# Registers a thread, (compute warpgroup 0, compute warpgroup 1, memory warpgroup), by whether the cache
# is 8-bit: at most 504 together (a CTA of 384 threads starts at 168 each); the memory warpgroup that
# converts holds a slab's 8-bit rows.
_REGISTERS = {False: (232, 232, 40), True: (232, 160, 112)}
_PROFILE_EVENTS = 128  # words of a warpgroup's trace with profile_dir (an event is 2, warpgroup 0 makes 8 a step)
_M_INIT = float(jnp.finfo(jnp.float32).min)
_LOG2E = math.log2(math.e)


def supports(num_heads: int, latent_dim: int, rope_dim: int, block_size: int, dtype, num_groups: int = 1, *,
             interpret: bool = False) -> str | None:
    """None when the Mosaic kernel takes these shapes, else why not (the caller falls back). An 8-bit
    cache (``CACHE_DTYPES``) comes with one scale a token (``num_groups`` 1). ``interpret``: the shapes
    only (interpret mode needs no Hopper GPU)."""
    if not interpret and (why_not := why_not_hopper()):
        return why_not
    if num_heads % BLOCK_H:
        return f"num_heads={num_heads} is not a multiple of {BLOCK_H}"
    if (latent_dim, rope_dim) != (LATENT_DIM, ROPE_DIM):
        return f"latent/rope dims {latent_dim}/{rope_dim} are not {LATENT_DIM}/{ROPE_DIM}"
    if block_size % BLOCK_K:
        return f"block_size={block_size} is not a multiple of {BLOCK_K}"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CACHE_DTYPES]:
        return f"cache dtype {jnp.dtype(dtype).name} is not one of bfloat16, int8, float8_e4m3fn"
    if jnp.dtype(dtype).itemsize == 1 and num_groups != 1:
        return f"{num_groups} scale groups a token (this kernel takes one scale a token)"
    return None


def _kernel(tables_ref, seq_ids_ref, lengths_ref, q_ref, qpe_ref, ckv_ref, kpe_ref, *refs,
            table_width: int, slabs_per_page: int, tokens_per_split: int, scale_log2e: float,
            num_splits: int, quantized: bool):
    outs, scratch = refs[:-1], refs[-1]
    (q_smem, p_smem, rows_smem, union,
     ckv_bars, kpe_bars, q_bars, consumed_bars, p_ready, p_free, compute_sync, *scales) = scratch
    if quantized:  # an 8-bit cache: its scales (see mla_decode_mgpu)
        ks_ref, outs = outs[0], outs[1:]
        ks_smem, ks_bars = scales
    # the ring of 16-bit slabs: read from HBM (bf16), or converted by the memory warpgroup (8-bit)
    (ckv_smem, kpe_smem), out16_smem, out32_smem = union
    dot_dtype = ckv_smem.dtype
    head_tile, split, t = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("t")
    wg = lax.axis_index("wg")
    h0 = head_tile * BLOCK_H
    seq_id = seq_ids_ref[t]
    length = lengths_ref[t]
    start = split * tokens_per_split
    end = jnp.minimum(start + tokens_per_split, length)
    num_steps = lax.div(jnp.maximum(end - start, 0) + (BLOCK_K - 1), jnp.int32(BLOCK_K))

    def init_row(value):
        return plgpu.layout_cast(jnp.full((BLOCK_H,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))

    def init_acc():
        return plgpu.layout_cast(jnp.zeros((BLOCK_H, _HALF), jnp.float32), plgpu.Layout.WGMMA)

    def pv(acc, p, step_slot, half: int):
        def body(acc_ref):
            cols = pl.ds(half * _HALF, _HALF)
            plgpu.wgmma(acc_ref, p, ckv_smem.at[step_slot, :, cols])
        return pl.run_state(body)(plgpu.ACC.init(acc))

    def _sync():  # the two compute warpgroups meet; after the first meeting neither reads the
        # cache ring again, so the output staging may reuse it
        plgpu.barrier_arrive(compute_sync)
        plgpu.barrier_wait(compute_sync)

    def _write(acc, l, half):
        cols = pl.ds(half * _HALF, _HALF)
        if num_splits == 1:
            (o_ref,) = outs
            denom = jnp.where(l == 0, 1.0, l)  # an empty context (padding) outputs zeros
            out16_smem.at[half][...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [0])).astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out16_smem.at[half], o_ref.at[t, pl.ds(h0, BLOCK_H), cols])
        else:
            m_ref, l_ref, acc_ref = outs
            out32_smem.at[half][...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out32_smem.at[half], acc_ref.at[t, split, pl.ds(h0, BLOCK_H), cols])
            if half == 0:
                plgpu.copy_smem_to_gmem(rows_smem.at[0], m_ref.at[t, split, pl.ds(h0, BLOCK_H)])
                plgpu.copy_smem_to_gmem(rows_smem.at[1], l_ref.at[t, split, pl.ds(h0, BLOCK_H)])
        plgpu.wait_smem_to_gmem(0)

    registers = _REGISTERS[quantized]

    @pl.when(wg == 0)
    def _scores_and_first_half():
        plgpu.set_max_registers(registers[0], action="increase")
        plgpu.copy_gmem_to_smem(q_ref.at[t, pl.ds(h0, BLOCK_H)], q_smem, q_bars.at[0])
        if quantized:  # q_pe from HBM straight into registers (P's buffer holds the dots' type)
            q_pe = plgpu.load(qpe_ref.at[t, pl.ds(h0, BLOCK_H)], layout=plgpu.Layout.WGMMA, optimized=False)
        else:
            plgpu.copy_gmem_to_smem(qpe_ref.at[t, pl.ds(h0, BLOCK_H)], p_smem, q_bars.at[1])
            plgpu.barrier_wait(q_bars.at[1])
            # q_pe stays in registers (an A operand), so its staging reuses P's buffer (shared memory is full)
            q_pe = plgpu.load(p_smem, layout=plgpu.Layout.WGMMA)
        plgpu.barrier_wait(q_bars.at[0])

        def step(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, jnp.int32(STAGES))
            with jax.named_scope("wait"):
                plgpu.barrier_wait(ckv_bars.at[slot])  # the slab landed (8-bit: converted)
                if quantized:
                    plgpu.barrier_wait(ks_bars.at[slot])
                plgpu.barrier_wait(kpe_bars.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, ckv_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma(acc_ref, q_pe, kpe_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            def latent(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, ckv_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            def rope(acc_ref):
                plgpu.wgmma(acc_ref, q_pe, kpe_smem.at[slot].transpose((1, 0)))

            with jax.named_scope("scores"):
                if quantized:  # q . (stored x scale) = (q . stored) x scale, the rope part added unscaled
                    kscale = plgpu.load(ks_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                    kscale = lax.broadcast_in_dim(kscale, (BLOCK_H, BLOCK_K), [1])
                    s = pl.run_scoped(latent, plgpu.ACC((BLOCK_H, BLOCK_K), jnp.float32)) * kscale
                    s = pl.run_state(rope)(plgpu.ACC.init(s))
                else:
                    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_K), jnp.float32))
            with jax.named_scope("softmax"):
                cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_H, BLOCK_K), 1, layout=plgpu.Layout.WGMMA)
                s = jnp.where(cols < end - (start + i * BLOCK_K), s * scale_log2e, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                p16 = (p * kscale if quantized else p).astype(dot_dtype)  # P x the tokens' scales: the values'

                @pl.when(i > 0)
                def _():  # warpgroup 1 is done with the previous P
                    plgpu.barrier_wait(p_free)

                p_smem[...] = p16
                rows_smem.at[0][...] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready)
            with jax.named_scope("values"):
                acc = pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p16, slot, 0)
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, num_steps, step, (init_acc(), init_row(_M_INIT), init_row(0.0)))
        _sync()  # warpgroup 1 has read its last rescale factor: the rows now carry m and l
        rows_smem.at[0][...] = m
        rows_smem.at[1][...] = l
        plgpu.commit_smem()
        _sync()
        _write(acc, l, 0)

    @pl.when(wg == 1)
    def _second_half():
        plgpu.set_max_registers(registers[1], action="increase" if registers[1] >= 168 else "decrease")

        def step(i, acc):
            slot = lax.rem(i, jnp.int32(STAGES))
            with jax.named_scope("wait"):
                plgpu.barrier_wait(ckv_bars.at[slot])
                plgpu.barrier_wait(p_ready)
            alpha = plgpu.load(rows_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
            with jax.named_scope("values"):
                acc = pv(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_smem, slot, 1)
            plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc

        acc = lax.fori_loop(0, num_steps, step, init_acc())
        _sync()
        _sync()
        l = plgpu.load(rows_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1))
        _write(acc, l, 1)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(registers[2], action="decrease")
        if quantized:  # the 8-bit rows into registers, converted into the ring; k_pe and the scales by TMA
            return convert_slabs(tables_ref, seq_id * table_width, start, num_steps, slabs_per_page, consumed_bars,
                                 ckv_ref, ckv_smem, ckv_bars,
                                 [(kpe_ref, kpe_smem, kpe_bars), (ks_ref, ks_smem, ks_bars)])
        load_slabs(tables_ref, seq_id * table_width, start, num_steps, slabs_per_page, consumed_bars,
                   [(ckv_ref, ckv_smem, ckv_bars), (kpe_ref, kpe_smem, kpe_bars)])


def slab_index(tables_ref, entry_base, token, slabs_per_page: int, block_k: int):
    """Row of a cache viewed as [pages * slabs_per_page, block_k, ...] that holds key ``token`` of the
    block-table row starting at flat offset ``entry_base``."""
    entry = entry_base + lax.div(token, jnp.int32(slabs_per_page * block_k))
    return tables_ref[entry] * slabs_per_page + lax.rem(lax.div(token, jnp.int32(block_k)), jnp.int32(slabs_per_page))


def load_slabs(tables_ref, table_row, start, num_steps, slabs_per_page: int, consumed_bars, rings, *,
               stages: int = STAGES, block_k: int = BLOCK_K, release_fence: bool = False):
    """A memory warpgroup's loop: walks a query's block-table row (at flat offset ``table_row``) from key
    ``start`` and TMA-loads each of its ``num_steps`` slabs of ``block_k`` tokens into slot
    step % stages of every ring, (gmem [pages * slabs_per_page, block_k, ...], smem ring, barriers),
    waiting for a slot's ``consumed_bars`` before reusing it. ``release_fence``: a proxy fence
    (``commit_smem``) after that wait, ordering the consumers' plain loads of the slot (the generic proxy)
    before the TMA (the async proxy) that overwrites it; consumers that read the ring only by wgmma (itself
    the async proxy) need none."""
    def load(i):
        slot = lax.rem(i, jnp.int32(stages))
        slab = slab_index(tables_ref, table_row, start + i * block_k, slabs_per_page, block_k)
        for gmem, ring, bars in rings:
            plgpu.copy_gmem_to_smem(gmem.at[slab], ring.at[slot], bars.at[slot])

    for i in range(stages):
        pl.when(i < num_steps)(functools.partial(load, jnp.int32(i)))

    @pl.loop(stages, jnp.maximum(num_steps, stages))
    def _(i):
        plgpu.barrier_wait(consumed_bars.at[lax.rem(i, jnp.int32(stages))])
        if release_fence:
            plgpu.commit_smem()
        load(i)


def convert_slabs(tables_ref, table_row, start, num_steps, slabs_per_page: int, consumed_bars, rows_gmem, ring,
                  ring_bars, rings, *, stages: int = STAGES, block_k: int = BLOCK_K, chunk: int = CHUNK):
    """A memory warpgroup's loop over an 8-bit cache: for each of a query's ``num_steps`` slabs (its
    block-table row at flat offset ``table_row``, from key ``start``), the slab's 8-bit rows of
    ``rows_gmem`` [pages * slabs_per_page, block_k, C] from HBM into registers (issued before the slot is
    free, so their latency overlaps the wait for ``consumed_bars``), converted exactly (int8 -> bf16,
    e4m3 -> f16: ``ring``'s dtype) into slot step % stages of ``ring``, arriving on ``ring_bars``; the
    ``rings`` beside it (gmem, smem ring, barriers: k_pe, scales) by TMA."""
    num_chunks = ring.shape[-1] // chunk

    @pl.loop(0, num_steps)
    def _(i):
        slab = slab_index(tables_ref, table_row, start + i * block_k, slabs_per_page, block_k)
        # chunk c of the slab's 8-bit rows, in the layout that upcasts to wgmma's
        rows = [plgpu.load(rows_gmem.at[slab, :, pl.ds(c * chunk, chunk)], layout=plgpu.Layout.WGMMA_UPCAST_2X,
                           optimized=False) for c in range(num_chunks)]
        slot = lax.rem(i, jnp.int32(stages))

        @pl.when(i >= stages)
        def _():
            with jax.named_scope("wait"):
                plgpu.barrier_wait(consumed_bars.at[slot])

        for gmem, smem, bars in rings:
            plgpu.copy_gmem_to_smem(gmem.at[slab], smem.at[slot], bars.at[slot])
        with jax.named_scope("convert"):
            for c, part in enumerate(rows):
                ring.at[slot, :, pl.ds(c * chunk, chunk)][...] = plgpu.layout_cast(part.astype(ring.dtype),
                                                                                  plgpu.Layout.WGMMA)
            plgpu.commit_smem()  # before wgmma (the async proxy) reads them
        plgpu.barrier_arrive(ring_bars.at[slot])


def mla_decode_mgpu(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, lengths, scale: float, *, num_splits: int,
                    tokens_per_split: int, c_kv_scale=None, profile_dir: str | None = None,
                    interpret: bool = False):
    """q_latent [T, H, 512], q_pe [T, H, 64] (bf16), c_kv [N, bs, 512], k_pe [N, bs, 64] (bf16),
    block_tables i32[S, W], seq_ids i32[T], lengths i32[T] (keys 0..length-1 attended) ->
    with one split the output [T, H, 512] bf16; else partials (m f32[T, splits, H] in log2 units,
    l f32[T, splits, H], acc f32[T, splits, H, 512]) for ``combine_splits``. ``tokens_per_split`` is a
    multiple of 64. An 8-bit c_kv (int8 | float8_e4m3fn) comes with ``c_kv_scale`` f32[N, bs, 1]. Shapes
    must pass ``supports``. ``profile_dir``: a folder where Mosaic GPU writes a per-warpgroup trace of the
    kernel's named scopes (a Perfetto JSON). ``interpret``: run on the CPU (``mgpu_interpret``)."""
    num_tokens, num_heads, latent_dim = q_latent.shape
    num_pages, block_size = c_kv.shape[:2]
    slabs_per_page = block_size // BLOCK_K
    if tokens_per_split % BLOCK_K:
        raise ValueError(f"tokens_per_split={tokens_per_split} must be a multiple of {BLOCK_K}")
    quantized = jnp.dtype(c_kv.dtype).itemsize == 1
    if quantized != (c_kv_scale is not None):
        raise ValueError(f"a {jnp.dtype(c_kv.dtype).name} cache takes c_kv_scale "
                         f"{'f32[N, bs, 1]' if quantized else 'None'}")
    tiling = lambda dtype: (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
                            plgpu.SwizzleTransform(128))
    bf16, f32 = jnp.bfloat16, jnp.float32
    # The dots' operand type: bf16; over an fp8 cache f16, the type e4m3 converts to exactly (the queries
    # in f16 are exact within its range, as in mla_decode_8bit_mgpu).
    dot_dtype = jnp.float16 if jnp.dtype(c_kv.dtype) == jnp.float8_e4m3fn else bf16
    smem = lambda shape, dtype: plgpu.SMEM(shape, dtype, transforms=tiling(dtype))
    scratch = [
        smem((BLOCK_H, LATENT_DIM), dot_dtype),  # q_latent
        smem((BLOCK_H, BLOCK_K), dot_dtype),  # (bf16 cache: before the loop q_pe); then P, warpgroup 0 -> 1
        plgpu.SMEM((2, BLOCK_H), f32),  # in the loop the step's rescale factor (0 -> 1); then m, l
        plgpu.RefUnion(  # the ring of 16-bit slabs; after the loop, the output staging
            (smem((STAGES, BLOCK_K, LATENT_DIM), dot_dtype), smem((STAGES, BLOCK_K, ROPE_DIM), bf16)),
            smem((2, BLOCK_H, _HALF), bf16),
            smem((2, BLOCK_H, _HALF), f32)),
        plgpu.Barrier(num_barriers=STAGES),  # c_kv slab landed
        plgpu.Barrier(num_barriers=STAGES),  # k_pe slab landed
        plgpu.Barrier(num_barriers=2),  # queries landed
        plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # both compute warpgroups done with a slot
        plgpu.Barrier(num_barriers=1),  # P ready
        plgpu.Barrier(num_barriers=1),  # P read
        plgpu.Barrier(num_arrivals=2),  # compute warpgroups in step
    ]
    if quantized:
        scratch += [plgpu.SMEM((STAGES, BLOCK_K), f32),  # the scales' ring
                    plgpu.Barrier(num_barriers=STAGES)]  # scales landed
    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct((num_tokens, num_heads, latent_dim), bf16)
    else:
        out_type = (jax.ShapeDtypeStruct((num_tokens, num_splits, num_heads), f32),
                    jax.ShapeDtypeStruct((num_tokens, num_splits, num_heads), f32),
                    jax.ShapeDtypeStruct((num_tokens, num_splits, num_heads, latent_dim), f32))
    kernel = functools.partial(
        _kernel, table_width=block_tables.shape[1], slabs_per_page=slabs_per_page,
        tokens_per_split=tokens_per_split, scale_log2e=scale * _LOG2E, num_splits=num_splits, quantized=quantized)
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=[scratch],
        grid=(num_heads // BLOCK_H, num_splits, num_tokens),
        grid_names=("h", "s", "t"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            **({"profile_space": _PROFILE_EVENTS, "profile_dir": profile_dir} if profile_dir else {})),
        interpret=mgpu_interpret.params() if interpret else False,
    )(block_tables.reshape(-1), seq_ids, lengths, q_latent.astype(dot_dtype), q_pe.astype(bf16),
      c_kv.reshape(num_pages * slabs_per_page, BLOCK_K, latent_dim),
      k_pe.reshape(num_pages * slabs_per_page, BLOCK_K, ROPE_DIM),
      *([c_kv_scale.astype(f32).reshape(num_pages * slabs_per_page, BLOCK_K)] if quantized else []))
