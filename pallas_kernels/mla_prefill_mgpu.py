"""Causal MLA prefill on Hopper through Mosaic GPU (TMA + wgmma), FlashAttention-3 style.

The semantics are ``mla_prefill_reference`` (pallas_kernels/mla_prefill.py): q/k head dim
qk_nope + qk_rope (128 + 64 in DeepSeek) kept as two operands, the rope key shared by all heads, v
head dim 128. The Triton kernel reaches ~400 TFLOP/s here; this one follows the Hopper recipe:

- one CTA owns 128 query rows of one (sequence, head); two compute warpgroups take 64 rows each, a
  third (memory) warpgroup TMA-loads key blocks (k_nope, k_pe, v) into a ring of shared memory;
- scores are two wgmmas into one f32 accumulator (q_nope k_nope^T + q_pe k_pe^T), so 192 needs no
  padding, and P v is one more with P straight from registers;
- the two compute warpgroups ping-pong through a shared barrier: one runs its softmax while the
  other's matmuls hold the tensor cores;
- causality: a warpgroup stops at its diagonal (only the diagonal blocks are masked); the memory
  warpgroup loads up to the CTA's last diagonal, and a warpgroup that finishes early keeps releasing
  ring slots so the other is never starved. CTAs with the most key blocks launch first.

Shapes: T a multiple of 128 (and of the key block), head dims multiples of 64, bf16 or f16.
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

BLOCK_Q = 64  # query rows per compute warpgroup (one wgmma M tile); a CTA owns 2 x BLOCK_Q
COMPUTE_WGS = 2
# Keys a step and ring depth. H200 sweep (2026-11-30, B4 S4096 H16): 128 x 2 578.7 TFLOP/s, 64 x 2 519,
# 64 x 4 512, 64 x 3 462; 128 x 3 is past shared memory.
BLOCK_KV, STAGES = 128, 2
_LOG2E = math.log2(math.e)


def supports(seq_len: int, nope_dim: int, rope_dim: int, value_dim: int, dtype, block_kv: int = BLOCK_KV, *,
             interpret: bool = False) -> str | None:
    """None when the Mosaic kernel takes these shapes, else why not (the caller falls back).
    ``interpret``: the shapes only (interpret mode needs no Hopper GPU)."""
    if not interpret and (why_not := why_not_hopper()):
        return why_not
    if seq_len % (COMPUTE_WGS * BLOCK_Q) or seq_len % block_kv:
        return f"seq_len={seq_len} is not a multiple of {max(COMPUTE_WGS * BLOCK_Q, block_kv)}"
    if any(d % 64 for d in (nope_dim, rope_dim, value_dim)):
        return f"head dims {nope_dim}/{rope_dim}/{value_dim} are not multiples of 64"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} is not bfloat16/float16"
    return None


def _kernel(qn_ref, qp_ref, kn_ref, kp_ref, v_ref, o_ref, smem, bars, *, block_kv: int, stages: int,
            scale_log2e: float, num_q_tiles: int):
    qn_smem, qp_smem, o_smem, kn_smem, kp_smem, v_smem = smem
    o_smem = qn_smem if o_smem is None else o_smem  # free once the loop is done
    q_bars, kn_bars, kp_bars, v_bars, k_consumed, v_consumed, schedule = bars
    head, batch, wg = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("wg")
    tile = num_q_tiles - 1 - lax.axis_index("q")  # the longest rows first: a short tail
    cta_base = tile * (COMPUTE_WGS * BLOCK_Q)
    cta_steps = lax.div(cta_base + COMPUTE_WGS * BLOCK_Q, jnp.int32(block_kv))  # keys < the CTA's last row
    dtype = o_ref.dtype

    def sync():  # the two compute warpgroups meet (the ping-pong)
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_base = cta_base + wg * BLOCK_Q
        rows = pl.ds(q_base, BLOCK_Q)
        plgpu.copy_gmem_to_smem(qn_ref.at[batch, rows, head], qn_smem.at[wg], q_bars.at[wg])
        plgpu.copy_gmem_to_smem(qp_ref.at[batch, rows, head], qp_smem.at[wg], q_bars.at[COMPUTE_WGS + wg])
        plgpu.barrier_wait(q_bars.at[wg])
        plgpu.barrier_wait(q_bars.at[COMPUTE_WGS + wg])
        unmasked = lax.div(q_base, jnp.int32(block_kv))  # key blocks wholly at or below row q_base
        steps = lax.div(q_base + BLOCK_Q + block_kv - 1, jnp.int32(block_kv))  # through the diagonal
        value_dim = v_smem.shape[-1]
        m = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.zeros((BLOCK_Q, value_dim), jnp.float32), plgpu.Layout.WGMMA)

        plgpu.barrier_wait(kn_bars.at[0])
        plgpu.barrier_wait(kp_bars.at[0])
        pl.when(wg == 1)(sync)  # warpgroup 1 runs half a step behind warpgroup 0

        def step(i, carry, *, masked: bool):
            acc, m, l = carry
            slot = lax.rem(i, jnp.int32(stages))

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, qn_smem.at[wg], kn_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma(acc_ref, qp_smem.at[wg], kp_smem.at[slot].transpose((1, 0)))
                sync()
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_consumed.at[slot])
            s = s * scale_log2e
            if masked:
                row = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA) + q_base
                col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA) + i * block_kv
                s = jnp.where(col <= row, s, -jnp.inf)  # every row saw key 0 in its first block: m is finite
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            plgpu.barrier_arrive(schedule)  # softmax done; the tensor cores pass to the other warpgroup
            plgpu.barrier_wait(v_bars.at[slot])
            plgpu.barrier_wait(schedule)

            def values(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                nxt = i + 1

                @pl.when(nxt < steps)
                def _():  # the next keys, while this wgmma runs
                    plgpu.barrier_wait(kn_bars.at[lax.rem(nxt, jnp.int32(stages))])
                    plgpu.barrier_wait(kp_bars.at[lax.rem(nxt, jnp.int32(stages))])

            acc = pl.run_state(values)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_new, l

        carry = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(unmasked, steps, functools.partial(step, masked=True), carry)

        @pl.loop(steps, cta_steps)
        def _(i):  # past this warpgroup's diagonal: release the ring slots the other one still uses
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            sync()
            sync()

        pl.when(wg == 0)(sync)
        o_smem.at[wg][...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[batch, rows, head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load_k(i, slot):
            keys = pl.ds(i * block_kv, block_kv)
            plgpu.copy_gmem_to_smem(kn_ref.at[batch, keys, head], kn_smem.at[slot], kn_bars.at[slot])
            plgpu.copy_gmem_to_smem(kp_ref.at[batch, keys], kp_smem.at[slot], kp_bars.at[slot])

        def load_v(i, slot):
            plgpu.copy_gmem_to_smem(v_ref.at[batch, pl.ds(i * block_kv, block_kv), head], v_smem.at[slot],
                                    v_bars.at[slot])

        for i in range(stages):
            @pl.when(i < cta_steps)
            def _():
                load_k(i, i)
                load_v(i, i)

        @pl.loop(stages, jnp.maximum(cta_steps, stages))
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(k_consumed.at[slot])
            load_k(i, slot)
            plgpu.barrier_wait(v_consumed.at[slot])
            load_v(i, slot)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "stages", "interpret"))
def mla_prefill_mgpu(q_nope, q_pe, k_nope, k_pe, v, scale: float, *, block_kv: int = BLOCK_KV, stages: int = STAGES,
                     interpret: bool = False):
    """q_nope [B, T, H, Dn], q_pe [B, T, H, R], k_nope [B, T, H, Dn], k_pe [B, T, R], v [B, T, H, Dv]
    -> [B, T, H, Dv] in v.dtype, causal. Shapes must pass ``supports``. ``interpret``: run on the CPU
    (``mgpu_interpret``)."""
    batch, seq_len, num_heads, nope_dim = q_nope.shape
    rope_dim, value_dim = q_pe.shape[-1], v.shape[-1]
    dtype = v.dtype
    swizzled = lambda shape: plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                                                  plgpu.SwizzleTransform(128)))
    q_nope_smem = swizzled((COMPUTE_WGS, BLOCK_Q, nope_dim))
    smem = (q_nope_smem, swizzled((COMPUTE_WGS, BLOCK_Q, rope_dim)),
            # the output is staged where q_nope was, when they have one shape (MLA: 128 and 128)
            None if value_dim == nope_dim else swizzled((COMPUTE_WGS, BLOCK_Q, value_dim)),
            swizzled((stages, block_kv, nope_dim)), swizzled((stages, block_kv, rope_dim)),
            swizzled((stages, block_kv, value_dim)))
    bars = (plgpu.Barrier(num_barriers=2 * COMPUTE_WGS),  # q_nope, q_pe of each compute warpgroup
            plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),  # k_nope, k_pe landed
            plgpu.Barrier(num_barriers=stages),  # v landed
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # keys consumed
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # values consumed
            plgpu.Barrier(num_arrivals=COMPUTE_WGS))  # the ping-pong
    num_q_tiles = seq_len // (COMPUTE_WGS * BLOCK_Q)
    kernel = functools.partial(_kernel, block_kv=block_kv, stages=stages, scale_log2e=scale * _LOG2E,
                               num_q_tiles=num_q_tiles)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, seq_len, num_heads, value_dim), dtype),
        scratch_types=[smem, bars],
        grid=(num_heads, num_q_tiles, batch),
        grid_names=("h", "q", "b"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mgpu_interpret.params() if interpret else False,
    )(q_nope.astype(dtype), q_pe.astype(dtype), k_nope.astype(dtype), k_pe.astype(dtype), v)
