"""A DeepSeekMoE layer's experts for a one-token decode step on Hopper, fed by TMA (Mosaic GPU).

The semantics are ``pallas_kernels.moe_decode.moe_decode`` at one token (routed experts read in place
from the layer stacks, the shared experts as extra programs of weight 1, partial rows summed by XLA);
this is its Mosaic GPU form. Why: the Triton launch streams V2-Lite's 139 MB layer at ~3.4 TB/s (40.5-41.3
µs; its loops are pipelined with 16-byte ``cp.async``, ``benchmarks/ptx_census.py``), while 132 CTAs
streaming by TMA into a ring of 16 KiB boxes read 142.7 MB at 4.2 TB/s (33.9 µs,
``benchmarks/tma_stream_probe.py``).

A CTA owns one (expert, 64 intermediate columns) tile, as a Triton program does, and one warpgroup. Its
768 KiB of weights come as one stream of 48 boxes of 16 KiB (each two [64, 64] halves, one barrier)
through one ring of ``RING`` slots, refilled as each is consumed, so the next boxes load through every
phase (gate / up into down included):

- the token's hidden chunks of 64 as [8, 64] tiles (the chunk in the first row, zeros below; 32 KiB
  at V2-Lite's 2048), built once in shared memory;
- boxes 0-31, gate and up in turns: hidden rows [128k, 128k + 128) of the tile's columns. The products
  run on the tensor cores transposed (both operands read transposed from shared memory): [64
  intermediate columns, 8] = box half^T x the token's tile^T, so the token's gate / up columns are the
  accumulators' column 0 (N = 8: an eighth of the tensor work of the token as a padded row, and no
  operand built in registers each step);
- silu(gate) * up * the routing weight, rounded to the weights' dtype, goes to shared memory once, as
  the first row of an [8, 64] tile;
- boxes 32-47, down: the tile's 64 down rows, output columns [128j, 128j + 128), transposed the same
  way: [64 output columns, 8] = down half^T [64, 64 intermediate] x h^T, so the token's outputs are
  column 0 and a row sum inside each thread's quad gives them (a column sum of the [64, 128] product
  with the token as a row crossed warps through shared memory: 2.2-2.7 µs a box in the first build's
  trace, ``moe_mgpu_probe --trace``).

Shared memory (``RING`` x 16 KiB, the token's row and tiles, the partial row: 108 KiB at 4 slots at
V2-Lite's hidden size) stays under half an SM, so two CTAs share an SM, as the Triton launch's programs
do, and the 176 CTAs of V2-Lite's layer all run at once. The residual, when given, is added where XLA
sums the partial rows, or (``in_place``) the CTAs add their partial rows into it by TMA, so no launch follows
the kernel (the batch-1 step's dense MLP, ``dispatch.DENSE_MLP_IN_PLACE``).

Measured on the H200 (``benchmarks/moe_mgpu_probe.py``, 2026-12-02, decode_profile.md rounds 19-20):
V2-Lite's layer 35.05-35.09 µs (3.95 TB/s; ``moe_mgpu_transposed_h200.json``) against 36.2 with the
gate / up products' token as a padded row built in registers (session 33's build) and 38.8-39.2 for the
Triton launch in the same call; the launch's stream alone, no products, takes 34.7-34.8 µs
(``tma_stream_experts_h200.json``). The batch-1 compiled step: 2.130-2.132 ms against 2.152-2.157 for the
row form (``step_ab_moe_transposed_b1_h200.json``) and 2.196-2.198 for the Triton launch. Timed at V2-Lite's
shape only.
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

BLOCK_I = 64  # intermediate columns a CTA owns (the gate / up products' N)
HALF = 64  # a box's half: [64, 64] of bf16, 8 KiB
STEP = 2 * HALF  # hidden rows a gate / up box holds, output columns a down box holds
ROWS = 64  # rows of one WGMMA-layout register tile (the token's tiles are built eight at a time)
TOKEN_N = 8  # the products' N: the token (or h) as the first row of an [8, 64] tile
# 16 KiB boxes in flight a CTA (read at trace time). V2-Lite's layer: 4 slots 35.05 µs, 5 slots 42.6
# (likely one CTA an SM then); with the row form 3 / 4 / 5 / 6 slots took 40.1 / 36.7 / 37.3 / 42.0.
RING = 4


def supports(hidden: int, inter: int, shared_inter: int, num_tokens: int, dtype) -> str | None:
    """None when this kernel takes the layer, else why not (the caller keeps the Triton launch)."""
    if why_not := why_not_hopper():
        return why_not
    if num_tokens != 1:
        return f"{num_tokens} tokens (this kernel takes one)"
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return f"weights in {jnp.dtype(dtype).name} (this kernel takes bfloat16)"
    # the token's [8, 64] tiles are built 64 rows (8 chunks of 64) at a time
    for name, size, block in (("hidden", hidden, ROWS // TOKEN_N * HALF),
                              ("moe intermediate", inter, BLOCK_I), ("shared intermediate", shared_inter, BLOCK_I)):
        if size % block:
            return f"{name} size {size} is not a multiple of {block}"
    if (need := _smem_bytes(hidden)) > SMEM_BYTES:
        return f"hidden size {hidden} needs {need} bytes of shared memory a CTA (at most {SMEM_BYTES})"
    return None


SMEM_BYTES = 227 * 1024  # an H200 CTA's shared memory


def _scratch(hidden: int, dtype) -> list:
    """A CTA's shared memory: the token, the ring of boxes, the token's [8, 64] tiles (later h in the
    first tile's first row), the partial row in f32, and the barriers."""
    tiled = lambda shape: plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)),
                                                                plgpu.SwizzleTransform(128)))
    return [
        plgpu.SMEM((hidden // HALF, HALF), dtype),  # the token
        tiled((RING, 2, HALF, HALF)),  # the ring of boxes
        tiled((hidden // HALF * TOKEN_N, HALF)),  # the token's tiles, then h
        plgpu.SMEM((hidden // HALF, HALF), jnp.float32),  # the CTA's partial row
        plgpu.Barrier(num_barriers=1),  # the token landed
        plgpu.Barrier(num_arrivals=2, num_barriers=RING),  # a box's two halves landed
    ]


def _smem_bytes(hidden: int) -> int:
    """The bytes of ``_scratch`` (bf16 weights), the barriers' rounded up to 256."""
    return sum(math.prod(m.shape) * jnp.dtype(m.dtype).itemsize for m in _scratch(hidden, jnp.bfloat16)
               if hasattr(m, "shape")) + 256


def _body(layer_ref, ids_ref, weights_ref, x_ref, wg_ref, wu_ref, wd_ref, *refs, top_k: int, num_experts: int,
          routed_tiles: int, shared: bool, in_place: bool, pdl: bool):
    # refs: (shared gate, up [L, D, S], down [L, S, D]) when shared; out f32[P, D / HALF, HALF] (each program's
    # partial row), or with ``in_place`` the residual's rows f32[D / HALF, HALF] (an input aliased in place, no
    # outputs), which every program adds its partial row into by TMA; then the
    # scratch: x [D / HALF, HALF], the ring [RING, 2, HALF, HALF], the token's tiles [D / HALF * 8, HALF]
    # (whose first rows later hold h), the partial row f32[D / HALF, HALF], barriers (x, the ring's slots)
    *refs, out_ref, scratch = refs
    if shared:
        sg_ref, su_ref, sd_ref = refs
    x_smem, ring, tiles_smem, row_smem, x_bar, bars = scratch
    hidden = x_smem.shape[0] * HALF
    gate_steps = down_steps = hidden // STEP
    boxes = 2 * gate_steps + down_steps
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

    def copy_halves(routed_ref, shared_ref, index, slot):
        """The box's two halves (``index(half)``: the indices after the layer and expert) into ``slot``."""
        @pl.when(is_routed)
        def _():
            for half in range(2):
                plgpu.copy_gmem_to_smem(routed_ref.at[(layer, expert, *index(half))], ring.at[slot, half],
                                        bars.at[slot])

        if shared:
            @pl.when(jnp.logical_not(is_routed))
            def _():
                for half in range(2):
                    plgpu.copy_gmem_to_smem(shared_ref.at[(layer, *index(half))], ring.at[slot, half], bars.at[slot])

    def issue(n, slot):
        """Box ``n`` of the stream into ``slot``: gate / up in turns for n < 2 * gate_steps, then down."""
        k, j = lax.div(n, 2), n - 2 * gate_steps
        gate_up_rows = lambda half: (pl.ds(k * STEP + half * HALF, HALF), pl.ds(i0, BLOCK_I))
        down_cols = lambda half: (pl.ds(i0, BLOCK_I), pl.ds(j * STEP + half * HALF, HALF))
        is_gate_up = n < 2 * gate_steps
        pl.when(is_gate_up & (lax.rem(n, 2) == 0))(lambda: copy_halves(wg_ref, sg_ref if shared else None,
                                                                       gate_up_rows, slot))
        pl.when(is_gate_up & (lax.rem(n, 2) == 1))(lambda: copy_halves(wu_ref, su_ref if shared else None,
                                                                       gate_up_rows, slot))
        pl.when(jnp.logical_not(is_gate_up))(lambda: copy_halves(wd_ref, sd_ref if shared else None,
                                                                 down_cols, slot))

    def consumed(n, slot):
        """Box ``n``'s products are done: its slot takes box n + RING. (The copies issued by a second,
        memory warpgroup instead were slower: 45-47 µs, two CTAs no longer sharing an SM; git 2b126bb.)"""
        @pl.when(n + RING < boxes)
        @jax.named_scope("refill")
        def _():
            issue(n + RING, slot)

    if pdl:  # the next launch may be set up now; the first boxes load while the launch before this one finishes
        plgpu.griddepcontrol_launch_dependents()
    else:
        plgpu.copy_gmem_to_smem(x_ref, x_smem, x_bar.at[0])
    for n in range(min(RING, boxes)):
        issue(jnp.int32(n), n)
    if pdl:
        plgpu.griddepcontrol_wait()  # the launch before complete, its writes (x, the residual) visible
        plgpu.copy_gmem_to_smem(x_ref, x_smem, x_bar.at[0])
    plgpu.barrier_wait(x_bar.at[0])
    row_of = plgpu.broadcasted_iota(jnp.int32, (ROWS, HALF), 0, layout=plgpu.Layout.WGMMA)
    first_row = row_of == 0

    def token_chunk(chunk):  # [ROWS, HALF] broadcast of the token's 64 values from ``chunk`` down the rows
        xc = plgpu.load(x_smem.at[chunk], layout=plgpu.Layout.WGMMA.reduce(0))
        return lax.broadcast_in_dim(xc, (ROWS, HALF), [1])

    # tile c (rows [8c, 8c + 8)) of tiles_smem: the token's chunk c in its first row, zeros below
    tiles_per_block = ROWS // TOKEN_N
    for q in range(tiles_smem.shape[0] // ROWS):
        block = jnp.zeros((ROWS, HALF), x_smem.dtype)
        for t in range(tiles_per_block):
            block = jnp.where(row_of == TOKEN_N * t, token_chunk(q * tiles_per_block + t), block)
        tiles_smem.at[pl.ds(q * ROWS, ROWS)][...] = block
    plgpu.commit_smem()

    def gate_up(k, carry):
        acc_g, acc_u = carry
        g_slot, u_slot = lax.rem(2 * k, RING), lax.rem(2 * k + 1, RING)
        with jax.named_scope("wait_gate_up"):
            plgpu.barrier_wait(bars.at[g_slot])
            plgpu.barrier_wait(bars.at[u_slot])

        def products(refs):
            g_acc, u_acc = refs
            for half in range(2):  # [BLOCK_I, 8] += box half^T [BLOCK_I, HALF] x the token's tile^T [HALF, 8]
                token = tiles_smem.at[pl.ds((2 * k + half) * TOKEN_N, TOKEN_N)].transpose((1, 0))
                plgpu.wgmma(g_acc, ring.at[g_slot, half].transpose((1, 0)), token)
                plgpu.wgmma(u_acc, ring.at[u_slot, half].transpose((1, 0)), token)

        with jax.named_scope("gate_up"):
            acc_g, acc_u = pl.run_state(products)((plgpu.ACC.init(acc_g), plgpu.ACC.init(acc_u)))
        consumed(2 * k, g_slot)  # the accumulators were read: the products are done
        consumed(2 * k + 1, u_slot)
        return acc_g, acc_u

    zeros = plgpu.layout_cast(jnp.zeros((BLOCK_I, TOKEN_N), jnp.float32), plgpu.Layout.WGMMA)
    acc_g, acc_u = lax.fori_loop(0, gate_steps, gate_up, (zeros, zeros))
    h = acc_g * jax.nn.sigmoid(acc_g) * acc_u * scale  # the token's column 0, zeros else
    # the token's column to a row, through shared memory (row_smem's first row, free until down)
    row_smem.at[0][...] = jnp.sum(h, axis=1)
    h = jnp.where(first_row, lax.broadcast_in_dim(
        plgpu.load(row_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0)), (ROWS, HALF), [1]), 0)
    tiles_smem.at[pl.ds(0, ROWS)][...] = h.astype(tiles_smem.dtype)
    plgpu.commit_smem()
    h_t = tiles_smem.at[pl.ds(0, TOKEN_N)].transpose((1, 0))  # [BLOCK_I, 8]: column 0 the token's h

    def down(j, _):
        n = 2 * gate_steps + j
        slot = lax.rem(n, RING)
        with jax.named_scope("wait_down"):
            plgpu.barrier_wait(bars.at[slot])

        def products(refs):  # [HALF output columns, 8]: column 0 the token's outputs
            for half, acc in enumerate(refs):
                plgpu.wgmma(acc, ring.at[slot, half].transpose((1, 0)), h_t)

        zero = plgpu.layout_cast(jnp.zeros((HALF, TOKEN_N), jnp.float32), plgpu.Layout.WGMMA)
        with jax.named_scope("down"):
            accs = pl.run_state(products)((plgpu.ACC.init(zero), plgpu.ACC.init(zero)))
        consumed(n, slot)
        with jax.named_scope("store"):  # the box's two slices of the CTA's partial row, kept in shared memory
            for half in range(2):
                row_smem.at[2 * j + half][...] = jnp.sum(accs[half], axis=1)  # only column 0 is nonzero
        return ()

    lax.fori_loop(0, down_steps, down, ())
    plgpu.commit_smem()
    if in_place:
        plgpu.copy_smem_to_gmem(row_smem, out_ref, reduction_op="add")
    else:
        plgpu.copy_smem_to_gmem(row_smem, out_ref.at[program])
    plgpu.wait_smem_to_gmem(0)


_PROFILE_EVENTS = 512  # a CTA's trace words with profile_dir (an event is 2; 16 gate / up and 16 down steps)


def moe_decode_mgpu(x, weights, ids, w_gate, w_up, w_down, layer, shared=None, residual=None,
                    profile_dir: str | None = None, in_place: bool = False, pdl: bool = False,
                    interpret: bool = False):
    """x [1, D] bf16, weights f32[1, k], ids i32[1, k] (E marks an empty slot), every layer's routed
    experts w_gate / w_up [L, E, D, I] and w_down [L, E, I, D], a (traced) layer index, optionally the
    shared experts (w_gate, w_up [L, D, S], w_down [L, S, D]) and a ``residual`` [1, D] added in f32 where
    the partial rows are summed -> [1, D]: as ``moe_decode`` at one token. Shapes must pass ``supports``.
    ``in_place`` (with a residual, best f32: it is the kernel's accumulator): each program adds its partial row
    into the residual's rows by TMA (a jax Ref the kernel aliases), no sum after the kernel -> the f32 sum [1, D],
    unrounded (a caller that reads it as bf16 rounds it: the step kernel does as it reads its input).
    ``pdl``: launched as a programmatic dependent of the launch before it, whose CTAs may then overlap this one's
    first weight boxes (``griddepcontrol.wait`` before x is read); it lets the launch after it be set up early too.
    The routing (ids, weights, layer) is read before the wait, so it must not come from the launch before (the
    dense MLP's: constants; ``dispatch.STEP_KERNEL_PDL``).
    ``profile_dir``: a folder where Mosaic GPU writes a per-CTA trace of the kernel's named scopes.
    ``interpret``: run on the CPU (``mgpu_interpret``)."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w_gate.shape[1:]
    shared_inter = 0 if shared is None else shared[0].shape[-1]
    if x.shape != (1, hidden) or num_tokens != 1 or (residual is not None and residual.shape != x.shape) \
            or (in_place and residual is None):
        raise ValueError(f"moe_decode_mgpu: x {x.shape}, ids {ids.shape}, residual "
                         f"{None if residual is None else residual.shape}, in_place={in_place}; expected x and "
                         f"residual [1, D={hidden}] (a residual with in_place=True), ids [1, k]")
    routed_tiles, shared_tiles = inter // BLOCK_I, shared_inter // BLOCK_I
    programs = top_k * routed_tiles + shared_tiles
    scratch = _scratch(hidden, x.dtype)
    kernel = functools.partial(_body, top_k=top_k, num_experts=num_experts, routed_tiles=routed_tiles,
                               shared=shared is not None, in_place=in_place, pdl=pdl)
    rows = hidden // HALF
    total = jax.new_ref(residual.astype(jnp.float32).reshape(rows, HALF)) if in_place else None
    partials = plgpu.kernel(
        kernel,
        out_type=() if in_place else jax.ShapeDtypeStruct((programs, rows, HALF), jnp.float32),
        scratch_types=[scratch],
        grid=(programs,),
        grid_names=("p",),
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            **({"profile_space": _PROFILE_EVENTS, "profile_dir": profile_dir} if profile_dir else {})),
        interpret=mgpu_interpret.params() if interpret else False,
    )(jnp.asarray(layer, jnp.int32).reshape(1), ids.reshape(-1).astype(jnp.int32),
      weights.reshape(-1).astype(jnp.float32), x.reshape(rows, HALF), w_gate, w_up, w_down,
      *(shared or ()), *(() if total is None else (total,)))
    if in_place:
        return total[...].reshape(1, hidden)
    out = partials.reshape(programs, hidden).sum(axis=0, keepdims=True)
    return (out if residual is None else out + residual.astype(jnp.float32)).astype(x.dtype)
