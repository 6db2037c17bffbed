"""Paged MLA decode over an 8-bit latent cache (int8 or fp8, a scale a token), few heads, on Hopper
through Mosaic GPU (TMA + wgmma): ``mla_decode``'s choice for both 8-bit dtypes (``AUTO_DTYPES``).

The semantics are ``mla_paged_reference`` (pallas_kernels/mla_decode.py) with ``c_kv_scale`` [N, bs, 1]:
scores q . (stored * scale) and the value update p . (stored * scale), no dequantized cache in HBM.
With a few heads (V2-Lite: 16) decode is bandwidth-bound, so a kernel has to turn each 8-bit cache
slab into tensor-core operands about as fast as HBM delivers it; the Triton kernel reaches 1.2-1.4 TB/s
of compressed bytes against 3.1-3.2 for bf16 rows (``benchmarks/results/kvquant_kernels_h200.json``).

Here the token axis is wgmma's M side (64 cache tokens a slab) and the heads are N (16 or 32,
at most ``MAX_HEADS``), so nothing is padded to 64 heads. ``COMPUTE_WGS`` compute warpgroups share
each slab, warpgroup w owning latent columns [w * 512 / n, (w + 1) * 512 / n):

- S^T [64, H] = K [64, 512] q^T, each warpgroup its columns' part: its 8-bit rows are loaded from
  shared memory ``CHUNK`` columns at a time in the layout that upcasts to wgmma's A-register layout
  (32-bit loads, one shuffle), converted (int8 -> bf16, e4m3 -> f16: both exact) and fed to wgmma from
  registers; each converted chunk is also stored once into a 16-bit slab for the value product. The
  last warpgroup adds the rope part (bf16 k_pe, A from shared memory). Where the token's scale goes
  (``DEQUANTIZE``): onto the scores afterwards (the rope part in an accumulator of its own, which the
  scale must not touch, and P * scale for the values), or into the converted rows (f32 x scale -> bf16,
  one accumulator).
- The parts meet in shared memory (double-buffered by step parity, a barrier of n arrivals) and every
  warpgroup sums them in the same order, so all hold the same scores, statistics and P.
- The online softmax runs down the token axis (column statistics [H], log2 units; with ``defer_sum``
  the denominators stay per-token terms until the loop ends). Its cross-warp reductions go through
  each warpgroup's own shared memory (``_column_reduce``): jnp's reductions share one scratch area of
  the kernel, and two warpgroups reducing at once corrupted each other's statistics (the output
  stayed right with one split, the partials did not).
- O^T [512 / n, H] += V^T P^T over the warpgroup's own columns: A is the 16-bit slab read transposed
  (16-bit operands may be M-major), B is P^T, stored as P [H, 64] (a K-major B: wgmma refuses an
  N-major one 16 heads wide).

A memory warpgroup walks the block table and TMA-loads each slab (8-bit latent [64, 512], k_pe
[64, 64], scales [64]) into a ring of as many stages as fit (2 at 16 heads); a slot is released once
every compute warpgroup has read its scores. The output is O^T: [T, 512, H] with one split, else
partials (m, l [T, S, H], acc [T, S, 512, H]); ``mla_decode`` transposes and merges them.

Moving the conversion out of the compute warpgroups, as in the many-head kernel
(``mla_decode_mgpu.convert_slabs``, where it took 128-head decode from 403 to 315 us), was built and
measured, correct but slower (H200, same shapes, 2026-12-01; git history before the session-23
removal): one or two converting warpgroups loading each slab's 8-bit rows from HBM into registers and
converting them into a two-stage ring of 16-bit slabs, which both products read. int8 113-150 us, fp8
114-139 (1 or 2 compute warpgroups, with or without loading the next slab's rows while converting),
against this kernel's 92-101 in the same calls. Its trace: a converting warpgroup takes ~5 us a slab
(HBM latency in its chain), so the compute warpgroups wait for slabs ~30% of a step.

Splitting the context instead (warpgroup w taking steps w, w + 2, ..., every column of them, with a
converted slab and an online-softmax state of its own, merged at the end; k_pe read from HBM into
registers a step ahead to make two converted slabs fit) was built and measured, correct but slower:
int8 151 us, fp8 137 (H200, same shapes, 2026-12-01; git history before the session-22 removal). Two
converted slabs (128 KiB) leave room for two ring stages only, one a warpgroup, so each warpgroup waits
for its next slab's load behind its own step.

Measured on the H200 (V2-Lite, batch 64, 4k context; ``python -m benchmarks.mla_8bit_probe`` and
``benchmarks.kvquant --kernels-only``, 2026-12-01), relative error 0.1-0.7% against the reference:
two compute warpgroups, chunks of 128 columns, the scale on the scores, 2 splits: int8 96-98 us
(1.72-1.75 TB/s of compressed bytes), fp8 93-94 us (1.80-1.82), against the Triton kernel's 121 (int8
byte pairs) and 136-141 (fp8) and against one compute warpgroup's 143 / 120; four warpgroups 141 us
(int8). bf16 rows take 96 us (3.14 TB/s), so an 8-bit token still costs as much time as a bf16 one.
The default's trace (``profile_dir``, ``python -m benchmarks.mla_8bit_probe --trace``; int8, session 23):
~40% of a step in the scores phase, ~30% softmax (two thirds of it the cross-warp max and sum), ~11%
exchanging the parts, ~12% value product, ~4% waiting for slabs: each warpgroup runs its steps' phases
in sequence, and that chain, not HBM, sets the time of a step. Summing the softmax denominators once
after the loop (``DEFER_SUM``, 2026-12-02) took one of the two reductions out of it: int8 94 us (1.79
TB/s), fp8 90 (1.87), bf16 rows 95 in the same run (``kvquant_kernels_h200.json``).

Measured on the H200 and dropped (2026-12-02, ``benchmarks/results/mla8_overlap_h200.md``): paired
CTAs (a cluster a query and pair of splits, score parts through the other CTA's shared memory) 124-135
us; Pallas's store barriers left out, no change; each step's softmax with the next step's score
products in flight, 95-105 us (spills); the scores on the 8-bit tensor cores against two 8-bit parts of
the queries (``split_q``, code in git 27bdf49), 106-139 us against 91-94. A step's wgmma work is ~0.8
us of its ~2.8 (m64n16k16 costs ~13.5 ns an SM, ``benchmarks/wgmma_probe.py``) and its bytes 1.28 us at
the copy rate: the chain of phases sets it, and overlapping steps needs a second converted slab that
shared memory cannot hold.
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
from pallas_kernels.mla_decode_mgpu import load_slabs

BLOCK_K = 64  # cache tokens a slab: wgmma's M
MAX_STAGES = 4  # slabs in flight (40.25 KiB each), as many as fit
CHUNK = 128  # latent columns converted and multiplied at a time (16 registers a thread of A)
COMPUTE_WGS = 2  # compute warpgroups
MAX_HEADS = 32  # O^T [512 / n, H] f32 is 4H / n registers a thread of each of n compute warpgroups
SMEM_BYTES = 227 * 1024  # shared memory a block may have on Hopper
_SMEM_SLACK = 4096  # alignment of the swizzled buffers, barriers
# Registers a thread of each compute warpgroup, by their count: the 64K of an SM less the memory
# warpgroup's; with 4, 112 (what the arithmetic allows) hung on the H200 in setmaxnreg, 104 runs.
_COMPUTE_REGISTERS = {1: 232, 2: 232, 4: 104}
_MEMORY_REGISTERS = 40  # a thread of the memory warpgroup (it only issues TMA copies)
_PROFILE_EVENTS = 384  # a warpgroup's trace words with profile_dir: 32 steps of the default's scopes fit
_REDUCE_SCRATCH = 512  # f32 a compute warpgroup's cross-warp reductions go through (Mosaic GPU's default)
LATENT_DIM = 512
ROPE_DIM = 64
CACHE_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
# Where the scale goes, by cache dtype (H200, V2-Lite batch 64, 4k context, two compute warpgroups, chunks
# of 128, 2 splits; benchmarks/mla_8bit_probe.py): on the scores and probabilities for both, fp8 94.4 us
# against 101.3 with the rows dequantized in the conversion, int8 97.4 against 141.1.
DEQUANTIZE = {"int8": False, "float8_e4m3fn": False}
# Cache dtypes for which mla_decode's impl="auto" takes this kernel: where it beats the Triton one (same
# shapes, benchmarks/results/kvquant_kernels_h200.json: int8 98.2 us against the byte pairs' 120.8, fp8
# 93.8 against 138.5).
AUTO_DTYPES = ("int8", "float8_e4m3fn")
# The softmax denominators: summed down the tokens every step (False), or kept as each thread's
# per-token terms (8 registers a thread at 16 heads) and summed once after the loop (True), one of the
# step's two cross-warp reductions fewer. H200, V2-Lite batch 64, 4k context, 2 splits (2026-12-02,
# `python -m benchmarks.mla_8bit_probe --timings`): two compute warpgroups int8 99.6 -> 94.2 us, fp8
# 95.5 -> 90.4; one warpgroup int8 151.4 -> 146.8, fp8 146.5 -> 141.0.
DEFER_SUM = True
# The compute warpgroups read the 8-bit rows and scales with plain loads (the generic proxy) and release a
# slot by an mbarrier; the memory warpgroup's TMA (the async proxy) then reloads it. The PTX memory model
# orders the two proxies only across a proxy fence, and the GPU interpret mode's race detection
# (tests/pallas_kernels, session 53) flags the reload without one. The memory warpgroup fences after its
# wait (load_slabs' release_fence), as DeepEP did for the same LDS-then-TMA race (its PR 642, "performance
# preserved"). On since session 53; the timings quoted above are without it. Timed in session 55 (an H100,
# `bash benchmarks/run_h200.sh mla8-fence`, `benchmarks/results/mla8_fence_h100.txt`; V2-Lite batch 64, 4k
# context, unfenced / fenced in turns): 2 splits int8 93.9, 89.7 / 89.0, 90.6 us, fp8 85.9, 88.9 / 88.9, 87.8
# (within the run-to-run swing); 1 split ~1-3 us (1-2%) slower fenced.
RELEASE_FENCE = True
_M_INIT = float(jnp.finfo(jnp.float32).min)
_LOG2E = math.log2(math.e)


def supports(num_heads: int, latent_dim: int, rope_dim: int, block_size: int, dtype, num_groups: int, *,
             interpret: bool = False) -> str | None:
    """None when this kernel takes these shapes, else why not (the caller falls back to Triton).
    ``interpret``: the shapes only (interpret mode needs no Hopper GPU)."""
    if not interpret and (why_not := why_not_hopper()):
        return why_not
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CACHE_DTYPES]:
        return f"cache dtype {jnp.dtype(dtype).name} is not int8 or float8_e4m3fn"
    if num_groups != 1:
        return f"{num_groups} scale groups a token (this kernel takes one scale a token)"
    if num_heads % 16 or num_heads > MAX_HEADS:  # 8 heads failed on the H200 with one split (a 16-byte output row?)
        return f"num_heads={num_heads} is not 16 or 32 (a multiple of 16 up to {MAX_HEADS})"
    if (latent_dim, rope_dim) != (LATENT_DIM, ROPE_DIM):
        return f"latent/rope dims {latent_dim}/{rope_dim} are not {LATENT_DIM}/{ROPE_DIM}"
    if block_size % BLOCK_K:
        return f"block_size={block_size} is not a multiple of {BLOCK_K}"
    return None


def smem_bytes(num_heads: int, stages: int, compute_wgs: int, out_dtype=jnp.float32) -> int:
    """Shared memory the kernel asks for: queries, the ring (8-bit rows, k_pe, the scales), the converted
    slab (after the loop: the output staging), P, reduction scratch and the score parts of each compute
    warpgroup, some slack."""
    ring = BLOCK_K * (LATENT_DIM + 4 + ROPE_DIM * 2)
    staging = max(BLOCK_K * LATENT_DIM * 2, LATENT_DIM * num_heads * jnp.dtype(out_dtype).itemsize)
    per_wg = num_heads * BLOCK_K * (2 + 2 * 4) + _REDUCE_SCRATCH * 4
    return (num_heads * (LATENT_DIM + ROPE_DIM) * 2 + stages * ring + staging + compute_wgs * per_wg
            + 2 * num_heads * 4 + _SMEM_SLACK)


def _column_reduce(op: str, x, scratch):
    """x [64, H] f32 (WGMMA layout) reduced down the token axis ("max" or "add") -> [H], through
    ``scratch`` (f32[_REDUCE_SCRATCH] shared memory of the calling warpgroup). jnp's reductions use one
    scratch area of the whole kernel, which two compute warpgroups reducing at once would share."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((x.shape[1],), x.dtype, layout=plgpu.Layout.WGMMA.reduce(0)))
    @mgpu_interpret.stand_in(lambda x, _: (jnp.max if op == "max" else jnp.sum)(x, axis=0))
    def reduce(_, x, scratch):
        return x.reduce(op, 0, scratch=scratch)
    return reduce(x, scratch)


def _smem(shape, dtype):
    """Shared memory in the tiled, swizzled layout TMA and wgmma read: rows of the widest swizzle
    (32, 64 or 128 bytes) that the minor dimension fills."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, shape[-1] * itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def _kernel(tables_ref, seq_ids_ref, lengths_ref, q_ref, qpe_ref, c8_ref, kpe_ref, ks_ref, *refs,
            table_width: int, slabs_per_page: int, scale_log2e: float, num_splits: int, num_heads: int,
            stages: int, chunk: int, dequantize: bool, compute_wgs: int, defer_sum: bool,
            release_fence: bool):
    outs, sm = refs[:-1], refs[-1]  # sm: the shared memory and barriers, by name (see mla_decode_8bit_mgpu)
    split, t = lax.axis_index("s"), lax.axis_index("t")
    wg = lax.axis_index("wg")
    seq_id = seq_ids_ref[t]
    length = lengths_ref[t]
    # Splits cut the query's own context into equal runs of whole slabs (mla_decode.split_range).
    per_split = lax.div(lax.div(jnp.maximum(length, 1) + (num_splits - 1), jnp.int32(num_splits)) + (BLOCK_K - 1),
                        jnp.int32(BLOCK_K)) * BLOCK_K
    start = split * per_split
    end = jnp.minimum(start + per_split, length)
    num_steps = lax.div(jnp.maximum(end - start, 0) + (BLOCK_K - 1), jnp.int32(BLOCK_K))
    bf16, f32 = jnp.bfloat16, jnp.float32
    q_smem, ks_smem, kbf_smem = sm["q"], sm["ks"], sm["kbf"]  # kbf: the converted slab
    dot_dtype = q_smem.dtype  # the dots' operand type
    upcast_dtype = jnp.float16 if jnp.dtype(c8_ref.dtype) == jnp.float8_e4m3fn else jnp.bfloat16
    column = plgpu.Layout.WGMMA.reduce(0)  # a [H] vector of per-head statistics
    row = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector of per-token values
    width = LATENT_DIM // compute_wgs  # latent columns a warpgroup converts
    chunk = min(chunk, width)

    def compute(w: int):
        """Compute warpgroup w: latent columns [w * width, (w + 1) * width) of every slab, the last one
        also the rope part."""
        first = w * width  # the warpgroup's first latent column
        own = pl.ds(first, width)
        rope = w == compute_wgs - 1
        reduce_smem = sm["reduce"][w]
        plgpu.set_max_registers(_COMPUTE_REGISTERS[compute_wgs], action="increase")
        if w == 0:
            plgpu.copy_gmem_to_smem(q_ref.at[t], q_smem, sm["q_bars"].at[0])
            plgpu.copy_gmem_to_smem(qpe_ref.at[t], sm["qpe"], sm["q_bars"].at[1])
        plgpu.barrier_wait(sm["q_bars"].at[0])
        plgpu.barrier_wait(sm["q_bars"].at[1])

        def step(i, carry):
            # O^T f32[width, H] (this warpgroup's rows); m (log2 units) f32[H]; l f32[H], or with
            # defer_sum the per-token terms f32[64, H] (WGMMA layout) summed down the tokens after the loop
            acc, m, l = carry
            slot = lax.rem(i, jnp.int32(stages))
            with jax.named_scope("wait"):  # the slab landed
                plgpu.barrier_wait(sm["ckv_bars"].at[slot])
                plgpu.barrier_wait(sm["ks_bars"].at[slot])
                plgpu.barrier_wait(sm["kpe_bars"].at[slot])

            def scores(s_ref, rope_ref):
                kscale = plgpu.load(ks_smem.at[slot], layout=row) if dequantize else None
                for c in range(width // chunk):
                    cols = pl.ds(first + c * chunk, chunk)
                    keys = plgpu.load(sm["c8"].at[slot, :, cols], layout=plgpu.Layout.WGMMA_UPCAST_2X)
                    keys = plgpu.layout_cast(keys.astype(upcast_dtype), plgpu.Layout.WGMMA)  # exact
                    if dequantize:
                        keys = (keys.astype(f32) * lax.broadcast_in_dim(kscale, keys.shape, [0])).astype(dot_dtype)
                    kbf_smem[:, cols] = keys  # the value product's operand
                    plgpu.wgmma(s_ref, keys, q_smem.at[:, cols].transpose((1, 0)))
                if rope:
                    plgpu.wgmma(rope_ref, sm["kpe"].at[slot], sm["qpe"].transpose((1, 0)))
                return s_ref[...] if dequantize or not rope else (s_ref[...], rope_ref[...])

            with jax.named_scope("scores"):  # S^T [64, H], or this warpgroup's part of it
                acc_type = plgpu.ACC((BLOCK_K, num_heads), f32)
                if dequantize:  # the rows carry their scale: the rope part adds into the same accumulator
                    s = pl.run_scoped(lambda s_ref: scores(s_ref, s_ref), acc_type)
                elif rope:  # the latent part x the token's scale, the rope part unscaled: two accumulators
                    s, s_rope = pl.run_scoped(scores, acc_type, plgpu.ACC((BLOCK_K, num_heads), f32))
                else:
                    s = pl.run_scoped(lambda s_ref: scores(s_ref, None), acc_type)
                if not dequantize:
                    kscale = plgpu.load(ks_smem.at[slot], layout=row)
                    s = s * lax.broadcast_in_dim(kscale, s.shape, [0])
                    if rope:
                        s = s + s_rope
            plgpu.barrier_arrive(sm["consumed_bars"].at[slot])  # the slot's 8-bit rows (k_pe) and scales are read
            if compute_wgs > 1:
                with jax.named_scope("exchange"):  # every warpgroup sums the parts in the same order
                    parity = lax.rem(i, jnp.int32(2))
                    sm["sx"].at[parity, w][...] = s
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(sm["sx_bars"].at[parity])
                    plgpu.barrier_wait(sm["sx_bars"].at[parity])
                    parts = [s if v == w else plgpu.load(sm["sx"].at[parity, v], layout=plgpu.Layout.WGMMA)
                             for v in range(compute_wgs)]
                    s = functools.reduce(lambda a, b: a + b, parts)
            with jax.named_scope("softmax"):  # (its parts as scopes of their own in a kernel trace)
                tokens = plgpu.broadcasted_iota(jnp.int32, (BLOCK_K, num_heads), 0, layout=plgpu.Layout.WGMMA)
                s = jnp.where(tokens < end - (start + i * BLOCK_K), s * scale_log2e, -jnp.inf)
                with jax.named_scope("max"):
                    m_new = jnp.maximum(m, _column_reduce("max", s, reduce_smem))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
                if defer_sum:  # each thread keeps its tokens' terms: no cross-warp round in the step
                    l = l * lax.broadcast_in_dim(alpha, l.shape, [1]) + p
                else:
                    with jax.named_scope("sum"):
                        l = l * alpha + _column_reduce("add", p, reduce_smem)
                if not dequantize:
                    p = p * lax.broadcast_in_dim(kscale, s.shape, [0])
                with jax.named_scope("store_p"):
                    sm["p"].at[w].transpose((1, 0))[...] = p.astype(dot_dtype)
                    plgpu.commit_smem()  # the 16-bit slab and P^T, before wgmma reads them

            def values(acc_ref):
                plgpu.wgmma(acc_ref, kbf_smem.at[:, own].transpose((1, 0)), sm["p"].at[w].transpose((1, 0)))

            with jax.named_scope("values"):
                acc = pl.run_state(values)(plgpu.ACC.init(acc * lax.broadcast_in_dim(alpha, acc.shape, [1])))
            return acc, m_new, l

        init = (plgpu.layout_cast(jnp.zeros((width, num_heads), f32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((num_heads,), _M_INIT, f32), column),
                plgpu.layout_cast(jnp.zeros((BLOCK_K, num_heads) if defer_sum else (num_heads,), f32),
                                  plgpu.Layout.WGMMA if defer_sum else column))
        acc, m, l = lax.fori_loop(0, num_steps, step, init)
        if defer_sum:
            l = _column_reduce("add", l, reduce_smem)
        rows_smem = sm["rows"]
        if compute_wgs > 1:  # nobody reads the converted slab any more: the output staging may reuse it
            plgpu.barrier_arrive(sm["done_bar"])
            plgpu.barrier_wait(sm["done_bar"])
        out_smem = sm["out"]
        if num_splits == 1:
            (o_ref,) = outs
            denom = jnp.where(l == 0, 1.0, l)  # an empty context (padding) outputs zeros
            out_smem.at[own][...] = (acc / lax.broadcast_in_dim(denom, acc.shape, [1])).astype(bf16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[own], o_ref.at[t, own])
        else:
            m_ref, l_ref, acc_ref = outs
            out_smem.at[own][...] = acc
            if w == 0:  # with shared columns every compute warpgroup holds the same m and l
                rows_smem.at[0][...] = m
                rows_smem.at[1][...] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[own], acc_ref.at[t, split, own])
            if w == 0:
                plgpu.copy_smem_to_gmem(rows_smem.at[0], m_ref.at[t, split])
                plgpu.copy_smem_to_gmem(rows_smem.at[1], l_ref.at[t, split])
        plgpu.wait_smem_to_gmem(0)

    for w in range(compute_wgs):
        pl.when(wg == w)(functools.partial(compute, w))

    @pl.when(wg == compute_wgs)
    def _memory():
        plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
        rings = [(c8_ref, sm["c8"], sm["ckv_bars"]), (ks_ref, ks_smem, sm["ks_bars"]),
                 (kpe_ref, sm["kpe"], sm["kpe_bars"])]
        load_slabs(tables_ref, seq_id * table_width, start, num_steps, slabs_per_page, sm["consumed_bars"], rings,
                   stages=stages, block_k=BLOCK_K, release_fence=release_fence)


def mla_decode_8bit_mgpu(q_latent, q_pe, c_kv, k_pe, c_kv_scale, block_tables, seq_ids, lengths, scale: float, *,
                         num_splits: int, stages: int | None = None, chunk: int = CHUNK,
                         dequantize: bool | None = None, compute_wgs: int = COMPUTE_WGS,
                         defer_sum: bool = DEFER_SUM, release_fence: bool = RELEASE_FENCE,
                         profile_dir: str | None = None, interpret: bool = False):
    """q_latent [T, H, 512], q_pe [T, H, 64] (bf16), c_kv [N, bs, 512] int8 | float8_e4m3fn, k_pe
    [N, bs, 64] bf16, c_kv_scale f32[N, bs, 1], block_tables i32[S, W], seq_ids i32[T], lengths i32[T]
    (keys 0..length-1 attended) -> with one split O^T [T, 512, H] bf16; else partials (m f32[T, splits,
    H] in log2 units, l f32[T, splits, H], acc f32[T, splits, 512, H]). Shapes must pass ``supports``.
    ``stages``: slabs in flight (None: as many as fit, up to ``MAX_STAGES``); ``chunk``: latent columns
    converted at a time; ``dequantize``: the scale applied to the converted rows (bf16 operands, one
    score accumulator) rather than to the scores and probabilities (None: per ``DEQUANTIZE``);
    ``compute_wgs``: compute warpgroups (1, 2 or 4), each taking 512 / n latent columns of every slab;
    ``defer_sum``: the softmax denominators kept as per-token terms in registers and summed down the
    tokens once, after the loop (one cross-warp reduction a step fewer), else summed every step;
    ``release_fence``: a proxy fence before each ring slot's reload (``RELEASE_FENCE``); ``profile_dir``:
    a folder where Mosaic GPU writes a per-warpgroup trace of the kernel's named scopes (a Perfetto JSON);
    ``interpret``: run on the CPU (``mgpu_interpret``)."""
    if dequantize is None:
        dequantize = DEQUANTIZE[jnp.dtype(c_kv.dtype).name]
    num_tokens, num_heads, latent_dim = q_latent.shape
    num_pages, block_size = c_kv.shape[:2]
    slabs_per_page = block_size // BLOCK_K
    bf16, f32 = jnp.bfloat16, jnp.float32
    # The dots' operand type: int8 -> bf16 is exact; e4m3 converts only to f16 in hardware (exact too),
    # so over fp8 rows left scaled afterwards the latent queries, the converted slab and P are f16 (the
    # queries' values are exact in f16 within its range, |q| < 65504; P * scale's smallest terms turn
    # subnormal, an absolute error under 1e-7). Dequantized rows (f16 -> f32 x scale -> bf16) and the
    # rope product are bf16.
    dot_dtype = jnp.float16 if jnp.dtype(c_kv.dtype) == jnp.float8_e4m3fn and not dequantize else bf16
    if compute_wgs not in _COMPUTE_REGISTERS:
        raise ValueError(f"compute_wgs={compute_wgs} is not one of {tuple(_COMPUTE_REGISTERS)}")
    width = LATENT_DIM // compute_wgs
    if chunk % 128 or width % min(chunk, width):
        raise ValueError(f"chunk={chunk} is not a multiple of 128 (an 8-bit row tile) dividing the "
                         f"{width} latent columns of a compute warpgroup")
    out_dtype = bf16 if num_splits == 1 else f32
    need = lambda n: smem_bytes(num_heads, n, compute_wgs, out_dtype)
    if stages is None:
        stages = max([n for n in range(1, MAX_STAGES + 1) if need(n) <= SMEM_BYTES], default=1)
    if need(stages) > SMEM_BYTES:
        raise ValueError(f"stages={stages} with compute_wgs={compute_wgs} and {num_heads} "
                         f"heads needs {need(stages)} bytes of shared memory, more than the {SMEM_BYTES} a block has")
    # (scratch by name: the keys' sorted order, a pytree's, is the order shared memory is laid out in)
    sm = dict(
        q=_smem((num_heads, LATENT_DIM), dot_dtype),  # q_latent: B of the scores, read transposed
        qpe=_smem((num_heads, ROPE_DIM), bf16),
        c8=_smem((stages, BLOCK_K, LATENT_DIM), c_kv.dtype),  # the 8-bit ring
        ks=plgpu.SMEM((stages, BLOCK_K), f32),  # scales
        p=_smem((compute_wgs, num_heads, BLOCK_K), dot_dtype),  # P (x scale) of each compute warpgroup: B of
        # its values, read transposed
        reduce=[plgpu.SMEM((_REDUCE_SCRATCH,), f32) for _ in range(compute_wgs)],  # each one's reductions
        rows=plgpu.SMEM((2, num_heads), f32),  # m, l of a split
        ckv_bars=plgpu.Barrier(num_barriers=stages),  # 8-bit slab landed
        ks_bars=plgpu.Barrier(num_barriers=stages),  # scales landed
        q_bars=plgpu.Barrier(num_barriers=2),  # queries landed
        consumed_bars=plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=stages),  # slot read by every compute
        # warpgroup
        done_bar=plgpu.Barrier(num_arrivals=compute_wgs),  # the loops are done (the output staging reuses the slab)
        # the converted slab (A of the values, read transposed); after the loop, the output staging
        union=plgpu.RefUnion(_smem((BLOCK_K, LATENT_DIM), dot_dtype), _smem((LATENT_DIM, num_heads), out_dtype)),
        kpe=_smem((stages, BLOCK_K, ROPE_DIM), bf16),
        kpe_bars=plgpu.Barrier(num_barriers=stages),  # k_pe landed
        sx=_smem((2, compute_wgs, BLOCK_K, num_heads), f32),  # score parts, by step parity
        sx_bars=plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=2),  # score parts written, by parity
    )
    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct((num_tokens, latent_dim, num_heads), out_dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((num_tokens, num_splits, num_heads), f32),
                    jax.ShapeDtypeStruct((num_tokens, num_splits, num_heads), f32),
                    jax.ShapeDtypeStruct((num_tokens, num_splits, latent_dim, num_heads), f32))

    def kernel(*refs):
        sm = dict(refs[-1])
        sm["kbf"], sm["out"] = sm.pop("union")
        _kernel(*refs[:-1], sm, table_width=block_tables.shape[1], slabs_per_page=slabs_per_page,
                scale_log2e=scale * _LOG2E, num_splits=num_splits, num_heads=num_heads, stages=stages, chunk=chunk,
                dequantize=dequantize, compute_wgs=compute_wgs, defer_sum=defer_sum, release_fence=release_fence)

    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=[sm],
        grid=(num_splits, num_tokens),
        grid_names=("s", "t"),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            **({"profile_space": _PROFILE_EVENTS, "profile_dir": profile_dir} if profile_dir else {})),
        interpret=mgpu_interpret.params() if interpret else False,
    )(block_tables.reshape(-1), seq_ids, lengths, q_latent.astype(dot_dtype), q_pe.astype(bf16),
      c_kv.reshape(num_pages * slabs_per_page, BLOCK_K, latent_dim),
      k_pe.reshape(num_pages * slabs_per_page, BLOCK_K, ROPE_DIM),
      c_kv_scale.astype(f32).reshape(num_pages * slabs_per_page, BLOCK_K))
