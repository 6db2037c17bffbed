"""How fast can CTAs stream weights into shared memory by TMA, with nothing else in the way?

Batch 1's expert launch (``pallas_kernels/moe_decode.py``, Triton) reads V2-Lite's 139 MB layer at
~3.4 TB/s: its loops are pipelined (``benchmarks/ptx_census.py``: 16-byte ``cp.async``, two stages in
flight, ~64 KiB a program), yet one program an SM streams only ~21 GB/s (decode_profile.md round 16).
If the limit is the SM's per-thread requests rather than HBM, Hopper's bulk copies (TMA: one
instruction a box, no per-thread requests) should stream faster. This probe times the stream alone:
each of ``ctas`` CTAs reads its share of a 138 MB array box by box into a ring of ``stages`` slots
(each box's barrier waited for, then the slot refilled ``stages`` boxes ahead), no arithmetic, one
Mosaic GPU kernel a pass; XLA's reduction over the same array is the anchor of the same call. Kernel
times come from a profiler trace (``benchmarks.common.kernel_time_us``): timing passes in a jitted loop
with a host clock added the loop's own per-iteration cost (a first build read every row at 2.5-2.9
TB/s, XLA's reduction included).

Measured (2026-12-02, ``tma_stream_h200.json``): 16 KiB boxes with 4-8 stages 33.9-34.1 µs for 142.7 MB
(4.19-4.22 TB/s, the copy rate), 32 KiB boxes ~34.7 (4.11), 64 KiB boxes, two stages or 264 CTAs
35.4-36.8 (3.87-3.91); XLA's reduction 36.0 (3.96). The Triton expert launch: 40.4-41.5 µs for 139 MB.

    python -m benchmarks.tma_stream_probe --out benchmarks/results/tma_stream_h200.json
    python -m benchmarks.tma_stream_probe --quick     # lower every config for an abstract H200 (CPU)
    python -m benchmarks.tma_stream_probe --experts   # the TMA expert launch's stream alone: its tiles
                                                      # strided as in the weights, or contiguous
    python -m benchmarks.tma_stream_probe --few       # what a few SMs stream alone (see FEW_CONFIGS)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import kernel_time_us, markdown_table, write_probe
from pallas_kernels.common import lower_for_h200

BOX_COLS = 128  # bf16 columns of a box (256 bytes a row)
# (CTAs, box KiB, stages): one CTA an SM over box sizes and ring depths, then two an SM
CONFIGS = ((132, 16, 2), (132, 16, 4), (132, 16, 8), (132, 32, 2), (132, 32, 4), (132, 32, 6),
           (132, 64, 2), (132, 64, 3), (264, 32, 2), (264, 32, 3))
TOTAL_BYTES = 138 * 2**20  # ~V2-Lite's one-token expert layer
# ``--few``: CTAs alone on the GPU, each reading FEW_BOXES boxes of 16 KiB through a ring of FEW_STAGES slots (the
# step kernel's ring). The question it answers: how fast can a few SMs stream by themselves, e.g. 16 (a cluster, one
# a V2-Lite attention head: q_proj's, W_UK's, W_UV's and o_proj's columns of a head and a 16th of kv_a's are ~1.7 MB)
# while the other SMs wait with their rings full? The step kernel's attention phases now read their 27.5 MB a layer
# over all 132 CTAs in ~20 µs, five grid barriers apart (docs/decode_step_kernel.md).
# Measured (2026-12-06, an H100, ``tma_stream_few_h100.json``): a CTA streams 121 GB/s with 8 alone, 109 with 16
# (1.74 TB/s in all), 85 with 32 (2.71), 45 with 64 (2.87), 23 with all 132 (3.06, the card's copy rate): one SM
# alone is held to ~110-120 GB/s, ~5x its share of the full stream.
FEW_CONFIGS = (8, 16, 32, 64, 132)
FEW_BOXES, FEW_STAGES = 112, 9


def _box(box_kb: int) -> tuple[int, int]:
    if box_kb not in (8, 16, 32, 64):
        raise ValueError(f"box_kb={box_kb}: accepted 8, 16, 32 or 64")
    return box_kb * 1024 // (2 * BOX_COLS), BOX_COLS


def stream(w, stages: int):
    """w bf16[C, S, rows, cols]: CTA c reads its S boxes in order through a ring of ``stages`` slots ->
    bf16[C, rows, cols] (the last slot's contents, so the kernel has an output)."""
    num_ctas, steps = w.shape[:2]
    box = w.shape[2:]
    if not 1 <= stages <= steps:
        raise ValueError(f"stages={stages}: accepted 1 to the boxes a CTA reads ({steps})")

    def body(w_ref, o_ref, ring, bars):
        c = lax.axis_index("c")
        for s in range(stages):
            plgpu.copy_gmem_to_smem(w_ref.at[c, s], ring.at[s], bars.at[s])

        def step(k, _):
            slot = lax.rem(k, jnp.int32(stages))
            plgpu.barrier_wait(bars.at[slot])

            @pl.when(k + stages < steps)
            def _():
                plgpu.copy_gmem_to_smem(w_ref.at[c, k + stages], ring.at[slot], bars.at[slot])

            return ()

        lax.fori_loop(0, steps, step, ())
        plgpu.copy_smem_to_gmem(ring.at[(steps - 1) % stages], o_ref.at[c])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_ctas, *box), w.dtype),
        scratch_types=[plgpu.SMEM((stages, *box), w.dtype), plgpu.Barrier(num_barriers=stages)],
        grid=(num_ctas,),
        grid_names=("c",),
    )(w)


EXPERT_TILES = (8, 2048, 1408, 64)  # experts, hidden, intermediate, tile columns: 176 CTAs of 768 KiB (138 MB)


def expert_stream(weights, stages: int):
    """The TMA expert launch's stream alone (``pallas_kernels/moe_decode_mgpu.py``): CTA c takes expert
    c // 22's tile of 64 intermediate columns and reads its 48 boxes of two [64, 64] halves (gate and up
    rows in turns, then the down rows) through a ring of ``stages`` slots, as that kernel does, without
    its products. ``weights``: (w_gate, w_up [E, D, I], w_down [E, I, D]), the experts' strided tiles, or
    one bf16[C, 48, 2, 64, 64] with each CTA's boxes contiguous -> bf16[C, 2, 64, 64] (the last slot)."""
    half = 64
    strided = isinstance(weights, tuple)
    if strided:
        num_experts, hidden, inter = weights[0].shape
        tiles = inter // half
        num_ctas, steps = num_experts * tiles, hidden // (2 * half)
    else:
        num_ctas, boxes = weights.shape[:2]
        steps = boxes // 3
    boxes = 3 * steps
    tiling = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def body(*refs):
        *w_refs, o_ref, ring, bars = refs
        c = lax.axis_index("c")

        def issue(n, slot):
            for h in range(2):
                if not strided:
                    plgpu.copy_gmem_to_smem(w_refs[0].at[c, n, h], ring.at[slot, h], bars.at[slot])
                    continue
                e, i0 = lax.div(c, tiles), lax.rem(c, tiles) * half
                k, j = lax.div(n, 2), n - 2 * steps
                rows = pl.ds(k * 2 * half + h * half, half)
                for which in range(2):  # gate, up in turns
                    pl.when((n < 2 * steps) & (lax.rem(n, 2) == which))(
                        lambda which=which: plgpu.copy_gmem_to_smem(w_refs[which].at[e, rows, pl.ds(i0, half)],
                                                                    ring.at[slot, h], bars.at[slot]))
                pl.when(n >= 2 * steps)(lambda: plgpu.copy_gmem_to_smem(
                    w_refs[2].at[e, pl.ds(i0, half), pl.ds(j * 2 * half + h * half, half)], ring.at[slot, h],
                    bars.at[slot]))

        for s in range(stages):
            issue(jnp.int32(s), s)

        def step(n, _):
            slot = lax.rem(n, jnp.int32(stages))
            plgpu.barrier_wait(bars.at[slot])

            @pl.when(n + stages < boxes)
            def _():
                issue(n + stages, slot)

            return ()

        lax.fori_loop(0, boxes, step, ())
        plgpu.copy_smem_to_gmem(ring.at[(boxes - 1) % stages], o_ref.at[c])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_ctas, 2, half, half), jnp.bfloat16),
        scratch_types=[plgpu.SMEM((stages, 2, half, half), jnp.bfloat16, transforms=tiling),
                       plgpu.Barrier(num_arrivals=2, num_barriers=stages)],
        grid=(num_ctas,),
        grid_names=("c",),
    )(*(weights if strided else (weights,)))


def _expert_weights(contiguous: bool, abstract: bool = False):
    experts, hidden, inter, half = EXPERT_TILES
    make = (lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)) if abstract else (
        lambda shape: jnp.ones(shape, jnp.bfloat16))
    if contiguous:
        return make((experts * inter // half, 3 * hidden // (2 * half), 2, half, half))
    return make((experts, hidden, inter)), make((experts, hidden, inter)), make((experts, inter, hidden))


def _shape(ctas: int, box_kb: int) -> tuple[int, int, int, int]:
    rows, cols = _box(box_kb)
    return ctas, max(1, TOTAL_BYTES // (ctas * box_kb * 1024)), rows, cols


def _timed(fn, operands: tuple, calls: int) -> tuple[float, bool]:
    """A stream kernel's time (µs, from the profiler's trace of ``calls`` calls) and whether its output is the ones
    it read."""
    check = bool(jnp.all(jax.jit(fn)(*operands) == 1))
    return kernel_time_us(fn, operands, calls=calls)["total"], check


def xla_sum(w):
    return jnp.sum(w, dtype=jnp.float32)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls in the profiler trace")
    parser.add_argument("--quick", action="store_true", help="lower each config on CPU, time nothing")
    parser.add_argument("--experts", action="store_true",
                        help="instead: the TMA expert launch's stream alone, its tiles strided as in the weights "
                             "or contiguous, 4 and 6 slots")
    parser.add_argument("--few", action="store_true",
                        help=f"instead: {', '.join(map(str, FEW_CONFIGS))} CTAs alone, {FEW_BOXES} boxes of 16 KiB "
                             f"each through {FEW_STAGES} slots")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.experts and args.few:
        parser.error("--experts and --few are two different probes: pass one")
    if args.experts:
        return _experts(args)
    if args.few:
        return _few(args)
    if args.quick:
        result = {}
        for ctas, box_kb, stages in CONFIGS:
            shape = jax.ShapeDtypeStruct(_shape(8, box_kb)[:1] + (4,) + _shape(8, box_kb)[2:], jnp.bfloat16)
            text = lower_for_h200(lambda w: stream(w, min(stages, 4)), shape)
            result[f"{ctas}/{box_kb}/{stages}"] = text.count("mosaic_gpu")
        print(result)
        return result
    rows = []
    for ctas, box_kb, stages in CONFIGS:
        w = jnp.ones(_shape(ctas, box_kb), jnp.bfloat16)
        fn = lambda w, stages=stages: stream(w, stages)
        us, check = _timed(fn, (w,), args.calls)
        rows.append(dict(kernel="tma ring", ctas=ctas, box_kb=box_kb, stages=stages, mb=round(w.size * 2 / 1e6, 1),
                         us=round(us, 2), tb_s=round(w.size * 2 / us / 1e6, 3), check=check))
        print(rows[-1], flush=True)
        del w
    w = jnp.ones(_shape(132, 32), jnp.bfloat16)
    us = kernel_time_us(xla_sum, (w,), calls=args.calls)["total"]
    rows.append(dict(kernel="XLA sum", ctas=None, box_kb=None, stages=None, mb=round(w.size * 2 / 1e6, 1),
                     us=round(us, 2), tb_s=round(w.size * 2 / us / 1e6, 3), check=float(xla_sum(w)) == w.size))
    print(rows[-1], flush=True)
    columns = ["kernel", "ctas", "box_kb", "stages", "mb", "us", "tb_s", "check"]
    return write_probe(rows, markdown_table(rows, columns), args.out, calls=args.calls,
                       command="python -m benchmarks.tma_stream_probe")


def _few(args) -> dict:
    """A few CTAs stream alone: each CTA's GB/s and the GPU's TB/s at each count (``--quick``: lowered)."""
    box_rows, cols = _box(16)
    if args.quick:
        result = {ctas: lower_for_h200(lambda w: stream(w, FEW_STAGES), jax.ShapeDtypeStruct(
            (ctas, FEW_BOXES, box_rows, cols), jnp.bfloat16)).count("mosaic_gpu") for ctas in FEW_CONFIGS}
        print(result)
        return result
    rows = []
    for ctas in FEW_CONFIGS:
        w = jnp.ones((ctas, FEW_BOXES, box_rows, cols), jnp.bfloat16)
        fn = lambda w: stream(w, FEW_STAGES)
        us, check = _timed(fn, (w,), args.calls)
        mb = w.size * 2 / 1e6
        rows.append(dict(kernel="tma ring alone", ctas=ctas, mb_a_cta=round(mb / ctas, 3), mb=round(mb, 1),
                         us=round(us, 2), gb_s_a_cta=round(mb / ctas / us * 1e3, 1), tb_s=round(mb / us, 3),
                         check=check))
        print(rows[-1], flush=True)
        del w
    columns = ["kernel", "ctas", "mb_a_cta", "mb", "us", "gb_s_a_cta", "tb_s", "check"]
    return write_probe(rows, markdown_table(rows, columns), args.out, calls=args.calls,
                       command="python -m benchmarks.tma_stream_probe --few")


def _experts(args) -> dict:
    """The expert launch's stream alone: strided or contiguous tiles, 4 and 6 slots (``--quick``: lowered)."""
    configs = [(contiguous, stages) for contiguous in (False, True) for stages in (4, 6)]
    if args.quick:
        result = {f"{'contiguous' if c else 'strided'}/{s}": lower_for_h200(
            lambda *w, s=s: expert_stream(w if len(w) > 1 else w[0], s), *(
                (lambda w: w if isinstance(w, tuple) else (w,))(_expert_weights(c, abstract=True)))).count("mosaic_gpu")
            for c, s in configs}
        print(result)
        return result
    rows = []
    for contiguous, stages in configs:
        weights = _expert_weights(contiguous)
        args_ = weights if isinstance(weights, tuple) else (weights,)
        fn = lambda *w, stages=stages: expert_stream(w if len(w) > 1 else w[0], stages)
        us, check = _timed(fn, args_, args.calls)
        mb = sum(w.size for w in args_) * 2 / 1e6
        rows.append(dict(kernel="expert stream", tiles="contiguous" if contiguous else "strided", stages=stages,
                         mb=round(mb, 1), us=round(us, 2), tb_s=round(mb / us, 3), check=check))
        print(rows[-1], flush=True)
        del weights, args_
    columns = ["kernel", "tiles", "stages", "mb", "us", "tb_s", "check"]
    return write_probe(rows, markdown_table(rows, columns), args.out, calls=args.calls,
                       command="python -m benchmarks.tma_stream_probe --experts")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
