"""What one Hopper wgmma costs by its N (the heads of few-head MLA decode), before a decode kernel is
shaped around it.

The few-head decode kernels put 64 cache tokens on wgmma's M side and the heads on N: V2-Lite's 16
heads make every score and value product m64n16k16, and both the bf16 and the 8-bit kernels take
~3 µs a 64-token step an SM however their phases are arranged (docs/kv_memory.md). This probe times
wgmma alone: every SM runs one warpgroup (or two) that multiplies an A [64, k] tile (shared memory, or
registers) by B^T [N, k] from shared memory into an f32 accumulator, ``--reps`` times, waiting for
each product before the next (as a decode step waits for its scores), for N = 16 ... 256 and k = 128
or 512 (8 or 32 instructions a wait). The table gives ns an instruction (the kernel's time over the
instructions of one warpgroup) and the SM's tensor throughput in TFLOP/s over the whole GPU, against
the H200's ~990 dense bf16 (660 measured for a large matmul).

    python -m benchmarks.wgmma_probe --out benchmarks/results/wgmma_probe_h200.json
    bash benchmarks/run_h200.sh wgmma               # the same on the GPU machine, into $OUT
    python -m benchmarks.wgmma_probe --quick      # lowers every variant on CPU (no GPU)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import device_time_us, markdown_table, write_probe
from pallas_kernels.common import lower_for_h200

NUM_SMS = 132
WIDTHS = (16, 32, 64, 128, 256)
DEPTHS = (128, 512)


def _smem(shape, dtype=jnp.bfloat16):
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def product_chain(a, b, *, reps: int, a_in_registers: bool, warpgroups: int):
    """a [64, k], b [N, k] bf16 -> f32 [SMs, warpgroups, 64, N]: every CTA's warpgroups each compute
    reps x (a @ b^T), waiting for each product, and write their sums."""
    k = a.shape[1]
    n = b.shape[0]

    def kernel(a_gmem, b_gmem, out_gmem, a_smem, b_smem, out_smem, bars):
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cta")

        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(a_gmem, a_smem, bars.at[0])
            plgpu.copy_gmem_to_smem(b_gmem, b_smem, bars.at[1])

        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])
        a_regs = plgpu.load(a_smem, (), layout=plgpu.Layout.WGMMA) if a_in_registers else None

        def rep(_, acc):
            def product(acc_ref):
                plgpu.wgmma(acc_ref, a_regs if a_in_registers else a_smem, b_smem.transpose((1, 0)))
            return pl.run_state(product)(plgpu.ACC.init(acc))

        zero = plgpu.layout_cast(jnp.zeros((64, n), jnp.float32), plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, reps, rep, zero)
        out_smem.at[wg][...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[cta, wg])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((NUM_SMS, warpgroups, 64, n), jnp.float32),
        scratch_types=[_smem((64, k)), _smem((n, k)), plgpu.SMEM((warpgroups, 64, n), jnp.float32),
                       plgpu.Barrier(num_barriers=2)],
        grid=(NUM_SMS,), grid_names=("cta",), num_threads=warpgroups, thread_name="wg",
    )(a, b)


def _inputs(n: int, k: int):
    rng = np.random.default_rng(n + k)
    # small integers: every product and sum is exact in f32, so the check is exact
    a = jnp.asarray(rng.integers(-2, 3, (64, k)), jnp.bfloat16)
    b = jnp.asarray(rng.integers(-2, 3, (n, k)), jnp.bfloat16)
    return a, b


def measure(n: int, k: int, reps: int, a_in_registers: bool, warpgroups: int) -> dict:
    a, b = _inputs(n, k)
    fn = lambda a, b: product_chain(a, b, reps=reps, a_in_registers=a_in_registers, warpgroups=warpgroups)
    got = np.asarray(fn(a, b))
    want = reps * (np.asarray(a, np.float32) @ np.asarray(b, np.float32).T)
    if not np.array_equal(got, np.broadcast_to(want, got.shape)):
        raise AssertionError(f"n={n} k={k}: wrong products")
    us = device_time_us(fn, (a, b), estimate_s=reps * k / 16 * 50e-9)
    instructions = reps * k // 16  # m64nNk16 a warpgroup
    flops = 2 * 64 * n * k * reps * warpgroups * NUM_SMS
    return dict(n=n, k=k, a="registers" if a_in_registers else "smem", warpgroups=warpgroups, reps=reps,
                us=round(us, 2), ns_per_wgmma=round(us * 1e3 / instructions, 2), tflops=round(flops / us / 1e6, 1))


def _fits(n: int, k: int, warpgroups: int) -> bool:
    """A, B and the output staging within the 227 KiB of shared memory a block may have."""
    return (64 + n) * k * 2 + warpgroups * 64 * n * 4 <= 220 * 1024


def variants():
    for warpgroups in (1, 2):
        for k in DEPTHS:
            for n in WIDTHS:
                if _fits(n, k, warpgroups):
                    yield n, k, False, warpgroups
        yield 16, 512, True, warpgroups


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=256, help="products a warpgroup, each waited for")
    parser.add_argument("--out", help="JSON of the rows (benchmarks/results/wgmma_probe_h200.json)")
    parser.add_argument("--quick", action="store_true", help="lower every variant for an abstract H200 and stop")
    args = parser.parse_args(argv)
    if args.quick:  # {variant: mosaic_gpu mentions in its lowering}
        lowered = {}
        for n, k, regs, wgs in variants():
            text = lower_for_h200(lambda a, b: product_chain(a, b, reps=2, a_in_registers=regs, warpgroups=wgs),
                                  *_inputs(n, k))
            lowered[(n, k, "registers" if regs else "smem", wgs)] = text.count("mosaic_gpu")
        print("lowered", len(lowered), "variants")
        return lowered
    rows = []
    for n, k, regs, wgs in variants():
        try:
            rows.append(measure(n, k, args.reps, regs, wgs))
            print(rows[-1], flush=True)
        except Exception as e:  # a variant that does not compile is reported, the rest still run
            print(f"n={n} k={k} registers={regs} warpgroups={wgs}: failed {type(e).__name__}: {e}"[:300], flush=True)
    table = markdown_table(rows, ["n", "k", "a", "warpgroups", "reps", "us", "ns_per_wgmma", "tflops"])
    return write_probe(rows, table, args.out, sms=NUM_SMS)


if __name__ == "__main__":
    main()
