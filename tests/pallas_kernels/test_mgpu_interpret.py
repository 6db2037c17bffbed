"""pallas_kernels.mgpu_interpret: a small Mosaic GPU kernel that steps into each gap the module closes
(a producer warpgroup and a consumer on a barrier, accumulators started from a value, wgmma with A in
registers, an inline_mgpu body with a stand-in), run on the CPU against numpy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu_interpret


def _tiled(shape, dtype):
    swizzle_elems = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(128)))


def _column_sums(x):
    """x [64, 64] f32 (WGMMA layout) summed down its rows: a body the interpret mode cannot run, with its
    stand-in."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((64,), jnp.float32, layout=plgpu.Layout.WGMMA.reduce(0)))
    @mgpu_interpret.stand_in(lambda x: jnp.sum(x, axis=0))
    def column_sums(_, x):
        return x.reduce("add", 0)
    return column_sums(x)


def _kernel(a_ref, b_ref, c_ref, out_ref, sums_ref, a_smem, b_smem, out_smem, sums_smem, landed, *, double: bool):
    wg = lax.axis_index("wg")

    @pl.when(wg == 1)  # the producer: both operands by TMA
    def _():
        plgpu.copy_gmem_to_smem(a_ref, a_smem, landed.at[0])
        plgpu.copy_gmem_to_smem(b_ref, b_smem, landed.at[1])

    @pl.when(wg == 0)
    def _():
        plgpu.barrier_wait(landed.at[0])
        plgpu.barrier_wait(landed.at[1])
        c = plgpu.load(c_ref, layout=plgpu.Layout.WGMMA)

        def from_smem(acc_ref):
            plgpu.wgmma(acc_ref, a_smem, b_smem)

        acc = pl.run_state(from_smem)(plgpu.ACC.init(c))  # C + A @ B
        if double:
            a = plgpu.load(a_smem, layout=plgpu.Layout.WGMMA)
            acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b_smem))(plgpu.ACC.init(acc))  # + A @ B
        out_smem[...] = acc
        sums_smem[...] = _column_sums(acc)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref)
        plgpu.copy_smem_to_gmem(sums_smem, sums_ref)
        plgpu.wait_smem_to_gmem(0)


def _run(a, b, c, double: bool):
    bf16, f32 = jnp.bfloat16, jnp.float32
    return plgpu.kernel(
        functools.partial(_kernel, double=double),
        out_type=(jax.ShapeDtypeStruct((64, 64), f32), jax.ShapeDtypeStruct((64,), f32)),
        scratch_types=[_tiled((64, 64), bf16), _tiled((64, 64), bf16), _tiled((64, 64), f32),
                       plgpu.SMEM((64,), f32), plgpu.Barrier(num_barriers=2)],
        num_threads=2,
        thread_name="wg",
        interpret=mgpu_interpret.params(),
    )(a, b, c)


def test_accumulators_from_values_and_register_operands():
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16) for _ in range(2))
    c = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    product = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    for double, want in ((False, np.asarray(c) + product), (True, np.asarray(c) + 2 * product)):
        out, sums = _run(a, b, c, double)
        assert not mgpu_interpret.races_found()
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(np.asarray(sums), want.sum(axis=0), rtol=1e-4, atol=1e-2)
