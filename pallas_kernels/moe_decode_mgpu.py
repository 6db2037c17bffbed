"""A DeepSeekMoE layer's experts for a one-token decode step on Hopper, fed by TMA (Mosaic GPU).

The semantics are ``pallas_kernels.moe_decode.moe_decode`` at one token (routed experts read in place
from the layer stacks, the shared experts as extra programs of weight 1, partial rows summed by XLA);
this is its Mosaic GPU form. Why: the Triton launch streams V2-Lite's 139 MB layer at ~3.4 TB/s (40.5-41.3
µs; its loops are pipelined with 16-byte ``cp.async``, ``benchmarks/ptx_census.py``), while 132 CTAs
streaming by TMA into a ring of 16 KiB boxes read 142.7 MB at 4.2 TB/s (33.9 µs,
``benchmarks/tma_stream_probe.py``).

A CTA owns one (expert, 64 intermediate columns) tile, as a Triton program does, and one warpgroup:

- gate and up: D / BLOCK_K boxes of [BLOCK_K, 64] each (16 KiB) through a ring of ``STAGES`` slots,
  each step's products on the tensor cores: the token is row 0 of a [64, BLOCK_K] operand built in
  registers (the other rows zero), the box the [K, N] operand straight from shared memory, so the
  accumulators' row 0 holds the token's gate / up columns and the other rows stay zero;
- silu(gate) * up * the routing weight, rounded to the weights' dtype, is the next product's operand
  as it lies in registers (row 0 the token, the other rows zero);
- down: [64, BLOCK_D] boxes of the expert's down rows through a second ring, whose first boxes load
  while gate and up stream; each box's [64, BLOCK_D] product is summed over its rows (only row 0 is
  nonzero) and stored as that slice of the CTA's partial row (two staging rows, TMA stores).

Shared memory (3 x 32 KiB of rings, the token's and the residual's rows, 1 KiB of staging, 2 KiB of
reduction scratch: ~107 KiB) stays under half an SM, so two CTAs share an SM, as the Triton launch's
programs do, and the 176 CTAs of V2-Lite's layer all run at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import why_not_hopper

BLOCK_I = 64  # intermediate columns a CTA owns (the products' N)
BLOCK_K = 128  # hidden rows a gate / up step streams (16 KiB boxes of bf16)
BLOCK_D = 128  # output columns a down box holds (16 KiB boxes of bf16)
ROWS = 64  # the products' M: the token padded to one wgmma tile
STAGES = 2  # gate / up steps in flight (2 x 32 KiB)
DOWN_STAGES = 2  # down boxes in flight (2 x 16 KiB), the first ones during gate / up


def supports(hidden: int, inter: int, shared_inter: int, num_tokens: int, dtype) -> str | None:
    """None when this kernel takes the layer, else why not (the caller keeps the Triton launch)."""
    if why_not := why_not_hopper():
        return why_not
    if num_tokens != 1:
        return f"{num_tokens} tokens (this kernel takes one)"
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return f"weights in {jnp.dtype(dtype).name} (this kernel takes bfloat16)"
    for name, size, block in (("hidden", hidden, max(BLOCK_K, BLOCK_D)), ("moe intermediate", inter, BLOCK_I),
                              ("shared intermediate", shared_inter, BLOCK_I)):
        if size % block:
            return f"{name} size {size} is not a multiple of {block}"
    return None


def _body(layer_ref, ids_ref, weights_ref, x_ref, wg_ref, wu_ref, wd_ref, *refs, top_k: int, num_experts: int,
          routed_tiles: int, shared: bool, with_residual: bool):
    # refs: (shared gate, up [L, D, S], down [L, S, D]) when shared; (residual [D / BLOCK_D, BLOCK_D]) when
    # with_residual; out f32[P, D / BLOCK_D, BLOCK_D]; then the scratch: x [D / BLOCK_K, BLOCK_K], gate ring,
    # up ring [STAGES, BLOCK_K, BLOCK_I], down ring [DOWN_STAGES, BLOCK_I, BLOCK_D], two output staging rows
    # f32[2, BLOCK_D], (the residual row [D / BLOCK_D, BLOCK_D]), barriers (x and residual, rings)
    refs = list(refs)
    scratch, out_ref = refs.pop(), refs.pop()
    residual_ref = refs.pop() if with_residual else None
    if shared:
        sg_ref, su_ref, sd_ref = refs
    x_smem, g_ring, u_ring, d_ring, row_smem, *res_smem, x_bars, g_bars, u_bars, d_bars = scratch
    hidden = x_smem.shape[0] * BLOCK_K
    gate_steps, down_steps = hidden // BLOCK_K, hidden // BLOCK_D
    program = lax.axis_index("p")
    layer = layer_ref[0]
    is_routed = program < top_k * routed_tiles
    # the tile's top-k slot and expert ids[slot] (E marks an empty slot: weight 0 on expert E - 1); a shared
    # tile: weight 1, its slot's expert unused
    slot_k = jnp.minimum(lax.div(program, jnp.int32(routed_tiles)), top_k - 1)
    picked = ids_ref[slot_k]
    expert = jnp.minimum(picked, num_experts - 1)
    scale = jnp.where(is_routed, jnp.where(picked >= num_experts, 0.0, weights_ref[slot_k]), 1.0)
    i0 = jnp.where(is_routed, lax.rem(program, jnp.int32(routed_tiles)), program - top_k * routed_tiles) * BLOCK_I

    def issue_gate_up(k, slot):
        rows, cols = pl.ds(k * BLOCK_K, BLOCK_K), pl.ds(i0, BLOCK_I)

        @pl.when(is_routed)
        def _():
            plgpu.copy_gmem_to_smem(wg_ref.at[layer, expert, rows, cols], g_ring.at[slot], g_bars.at[slot])
            plgpu.copy_gmem_to_smem(wu_ref.at[layer, expert, rows, cols], u_ring.at[slot], u_bars.at[slot])

        if shared:
            @pl.when(jnp.logical_not(is_routed))
            def _():
                plgpu.copy_gmem_to_smem(sg_ref.at[layer, rows, cols], g_ring.at[slot], g_bars.at[slot])
                plgpu.copy_gmem_to_smem(su_ref.at[layer, rows, cols], u_ring.at[slot], u_bars.at[slot])

    def issue_down(j, slot):
        rows, cols = pl.ds(i0, BLOCK_I), pl.ds(j * BLOCK_D, BLOCK_D)

        @pl.when(is_routed)
        def _():
            plgpu.copy_gmem_to_smem(wd_ref.at[layer, expert, rows, cols], d_ring.at[slot], d_bars.at[slot])

        if shared:
            @pl.when(jnp.logical_not(is_routed))
            def _():
                plgpu.copy_gmem_to_smem(sd_ref.at[layer, rows, cols], d_ring.at[slot], d_bars.at[slot])

    plgpu.copy_gmem_to_smem(x_ref, x_smem, x_bars.at[0])
    if with_residual:  # every CTA loads the 4 KiB row; the first adds it to its partial
        plgpu.copy_gmem_to_smem(residual_ref, res_smem[0], x_bars.at[1])
    for s in range(min(STAGES, gate_steps)):
        issue_gate_up(s, s)
    for s in range(min(DOWN_STAGES, down_steps)):  # independent of the products: they load meanwhile
        issue_down(s, s)
    plgpu.barrier_wait(x_bars.at[0])
    if with_residual:
        plgpu.barrier_wait(x_bars.at[1])
    first_row = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK_K), 0, layout=plgpu.Layout.WGMMA) == 0

    def gate_up(k, carry):
        acc_g, acc_u = carry
        slot = lax.rem(k, jnp.int32(STAGES))
        xk = plgpu.load(x_smem.at[k], (), layout=plgpu.Layout.WGMMA.reduce(0))  # [BLOCK_K] of the token
        a = jnp.where(first_row, lax.broadcast_in_dim(xk, (ROWS, BLOCK_K), [1]), 0).astype(x_smem.dtype)
        plgpu.barrier_wait(g_bars.at[slot])
        plgpu.barrier_wait(u_bars.at[slot])

        def products(refs):
            g_acc, u_acc = refs
            plgpu.wgmma(g_acc, a, g_ring.at[slot])
            plgpu.wgmma(u_acc, a, u_ring.at[slot])

        acc_g, acc_u = pl.run_state(products)((plgpu.ACC.init(acc_g), plgpu.ACC.init(acc_u)))

        @pl.when(k + STAGES < gate_steps)
        def _():  # the slot's products are done (their accumulators were read): refill it
            issue_gate_up(k + STAGES, slot)

        return acc_g, acc_u

    zeros = plgpu.layout_cast(jnp.zeros((ROWS, BLOCK_I), jnp.float32), plgpu.Layout.WGMMA)
    acc_g, acc_u = lax.fori_loop(0, gate_steps, gate_up, (zeros, zeros))
    h = (acc_g * jax.nn.sigmoid(acc_g) * acc_u * scale).astype(x_smem.dtype)  # rows > 0 stay zero

    def down(j, _):
        slot = lax.rem(j, jnp.int32(DOWN_STAGES))
        plgpu.barrier_wait(d_bars.at[slot])
        acc = pl.run_scoped(lambda acc_ref: (plgpu.wgmma(acc_ref, h, d_ring.at[slot]), acc_ref[...])[1],
                            plgpu.ACC((ROWS, BLOCK_D), jnp.float32))

        @pl.when(j + DOWN_STAGES < down_steps)
        def _():
            issue_down(j + DOWN_STAGES, slot)

        row = jnp.sum(acc, axis=0)  # only row 0 is nonzero
        if with_residual:
            r = plgpu.load(res_smem[0].at[j], (), layout=plgpu.Layout.WGMMA.reduce(0)).astype(jnp.float32)
            row = row + r * jnp.where(program == 0, 1.0, 0.0)  # a scalar factor: the first CTA only
        # the box's slice of the partial row, through one of two staging rows: the store two boxes ago
        # from this one must be done before it is overwritten
        plgpu.wait_smem_to_gmem(1)
        stage = lax.rem(j, jnp.int32(2))
        row_smem.at[stage][...] = row
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(row_smem.at[stage], out_ref.at[program, j])
        return ()

    lax.fori_loop(0, down_steps, down, ())
    plgpu.wait_smem_to_gmem(0)


@jax.jit
def moe_decode_mgpu(x, weights, ids, w_gate, w_up, w_down, layer, shared=None, residual=None):
    """x [1, D] bf16, weights f32[1, k], ids i32[1, k] (E marks an empty slot), every layer's routed
    experts w_gate / w_up [L, E, D, I] and w_down [L, E, I, D], a (traced) layer index, optionally the
    shared experts (w_gate, w_up [L, D, S], w_down [L, S, D]) and a ``residual`` [1, D] that the first CTA
    adds to its partial in f32 -> [1, D]: as ``moe_decode`` at one token. Shapes must pass ``supports``."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w_gate.shape[1:]
    shared_inter = 0 if shared is None else shared[0].shape[-1]
    if x.shape != (1, hidden) or num_tokens != 1 or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"moe_decode_mgpu: x {x.shape}, ids {ids.shape}, residual "
                         f"{None if residual is None else residual.shape}; expected x and residual [1, D={hidden}], "
                         "ids [1, k]")
    routed_tiles, shared_tiles = inter // BLOCK_I, shared_inter // BLOCK_I
    programs = top_k * routed_tiles + shared_tiles
    tiling = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = lambda shape, dtype=x.dtype: plgpu.SMEM(shape, dtype, transforms=tiling)
    scratch = [
        plgpu.SMEM((hidden // BLOCK_K, BLOCK_K), x.dtype),  # the token
        smem((STAGES, BLOCK_K, BLOCK_I)),  # gate ring
        smem((STAGES, BLOCK_K, BLOCK_I)),  # up ring
        smem((DOWN_STAGES, BLOCK_I, BLOCK_D)),  # down ring
        plgpu.SMEM((2, BLOCK_D), jnp.float32),  # two staging rows for the output's slices
        *([plgpu.SMEM((hidden // BLOCK_D, BLOCK_D), x.dtype)] if residual is not None else []),  # the residual
        plgpu.Barrier(num_barriers=2),  # the token, the residual landed
        plgpu.Barrier(num_barriers=STAGES),
        plgpu.Barrier(num_barriers=STAGES),
        plgpu.Barrier(num_barriers=DOWN_STAGES),
    ]
    kernel = functools.partial(_body, top_k=top_k, num_experts=num_experts, routed_tiles=routed_tiles,
                               shared=shared is not None, with_residual=residual is not None)
    partials = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((programs, hidden // BLOCK_D, BLOCK_D), jnp.float32),
        scratch_types=[scratch],
        grid=(programs,),
        grid_names=("p",),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(jnp.asarray(layer, jnp.int32).reshape(1), ids.reshape(-1).astype(jnp.int32),
      weights.reshape(-1).astype(jnp.float32), x.reshape(hidden // BLOCK_K, BLOCK_K), w_gate, w_up, w_down,
      *(shared or ()), *(() if residual is None else (residual.reshape(hidden // BLOCK_D, BLOCK_D),)))
    return partials.reshape(programs, hidden).sum(axis=0, keepdims=True).astype(x.dtype)
