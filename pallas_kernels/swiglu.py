"""Dense SwiGLU: silu(x @ W_gate) * (x @ W_up), the first half of every DeepSeek MLP and shared expert.

The kernel computes both GEMMs from one x tile per K step into two f32 accumulators and applies the
silu-times-up epilogue in registers, so neither [T, I] half touches HBM.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import shrink_for_itemsize, swiglu_accumulators


class SwigluConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int  # M tiles per program group (L2 swizzle)


# By token count, first bound not exceeded. Few tokens: weight-bandwidth bound, narrow N tiles for
# more programs. Many tokens: two 128x128 accumulators (a 128x256 MMA tile in effect).
_CONFIGS = (
    (64, SwigluConfig(64, 64, 128, 4, 4, 1)),
    (None, SwigluConfig(128, 128, 64, 8, 3, 8)),
)


def _swiglu_kernel(x_ref, w_gate_ref, w_up_ref, out_ref, *, block_m, block_n, block_k, group_m):
    # x_ref [M, K]; w_gate_ref/w_up_ref [K, N]; out_ref [M, N]
    num_rows, depth = x_ref.shape
    width = w_gate_ref.shape[1]
    num_m_tiles, num_n_tiles = pl.cdiv(num_rows, block_m), pl.cdiv(width, block_n)
    # Grouped launch order: group_m M tiles sweep the N tiles together, so a W column block is
    # reused from L2 by group_m programs and an x row block by all N tiles of the group.
    pid = pl.program_id(0)
    programs_per_group = group_m * num_n_tiles
    first_m = (pid // programs_per_group) * group_m
    rows_in_group = jnp.minimum(num_m_tiles - first_m, group_m)
    m_tile = first_m + (pid % programs_per_group) % rows_in_group
    n_tile = (pid % programs_per_group) // rows_in_group

    rows = m_tile * block_m + jnp.arange(block_m)
    row_ok = rows < num_rows
    x_rows = jnp.where(row_ok, rows, 0)  # rows past M read row 0 and are never stored
    n0 = n_tile * block_n
    cols = n0 + jnp.arange(block_n)
    col_ok = cols < width

    def load_w(w_ref, k0):
        window = w_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)]
        mask = None
        if depth % block_k:
            mask = (k0 + jnp.arange(block_k) < depth)[:, None]
        if width % block_n:
            mask = col_ok[None, :] if mask is None else mask & col_ok[None, :]
        return plgpu.load(window) if mask is None else plgpu.load(window, mask=mask, other=0)

    acc_gate, acc_up = swiglu_accumulators(x_ref, x_rows, lambda k0: load_w(w_gate_ref, k0),
                                           lambda k0: load_w(w_up_ref, k0), block_m=block_m, block_n=block_n,
                                           block_k=block_k, depth=depth)
    h = jax.nn.silu(acc_gate) * acc_up
    plgpu.store(out_ref.at[pl.ds(m_tile * block_m, block_m), pl.ds(n0, block_n)],
                h.astype(out_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps",
                                             "num_stages", "group_m", "interpret"))
def swiglu(x, w_gate, w_up, *, block_m=None, block_n=None, block_k=None, num_warps=None,
           num_stages=None, group_m=None, interpret=False):
    """x [T, D], w_gate/w_up [D, I] -> silu(x @ w_gate) * (x @ w_up) [T, I] in x.dtype, f32 accumulation."""
    if w_gate.shape != w_up.shape or x.shape[1] != w_gate.shape[0]:
        raise ValueError(f"swiglu: x {x.shape}, w_gate {w_gate.shape}, w_up {w_up.shape}; expected "
                         "x [T, D] and both weights [D, I]")
    num_rows, depth = x.shape
    width = w_gate.shape[1]
    config = next(c for bound, c in _CONFIGS if bound is None or num_rows <= bound)
    k, stages = shrink_for_itemsize(config.block_k, config.num_stages, jnp.dtype(w_gate.dtype).itemsize)
    config = config._replace(block_k=k, num_stages=stages)
    overrides = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                     num_stages=num_stages, group_m=group_m)
    config = config._replace(**{k: v for k, v in overrides.items() if v is not None})
    fit = lambda block, dim: max(16, min(block, pl.next_power_of_2(dim)))
    block_m, block_n, block_k = (fit(config.block_m, num_rows), fit(config.block_n, width),
                                 fit(config.block_k, depth))
    kernel = functools.partial(_swiglu_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               group_m=config.group_m)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_rows, block_m) * pl.cdiv(width, block_n),),
        out_shape=jax.ShapeDtypeStruct((num_rows, width), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="swiglu",
    )(x, w_gate, w_up)


def swiglu_reference(x, w_gate, w_up):
    """x [T, D], w_gate/w_up [D, I] -> [T, I] in x.dtype, accumulating in f32."""
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate) * up).astype(x.dtype)
