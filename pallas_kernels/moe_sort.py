"""Expert sort: the (token, slot) assignments of a routing, ordered by expert for the grouped GEMMs.

One Pallas program per expert, each reading every id: program e puts its assignments at
(number of assignments with a lower id) + (rank among e's own, in token order), one compare-and-count
and one cumsum. No program waits on another, no sort runs and nothing is scattered by XLA: a single
launch gives the order and the group sizes that the grouped kernels (which locate their own tiles)
take as they are. E programs x T*k compares: a decode step's 1,536 V2-Lite assignments are one chunk
in registers; long prefills loop over chunks, each id read twice from L2 per program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# (chunk, num_warps): a program holds one chunk of ids in registers at a time; the first chunk that
# holds every assignment, else the last (then the program loops).
_SORT_CHUNKS = ((2048, 4), (8192, 8))
_NO_EXPERT = jnp.iinfo(jnp.int32).max  # what the padding past the last id reads: in no group, below none


def sort_by_expert_reference(ids, num_experts: int):
    """ids i32[T, k] -> (order i32[T*k], group_sizes i32[E]).

    ``order`` lists flat (token, slot) assignment indices sorted by expert (stable, so within an
    expert tokens keep their order); token index = order // k. ``group_sizes[e]`` counts rows of expert e.
    """
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, group_sizes


def _sort_kernel(ids_ref, order_ref, group_sizes_ref, *, num_rows: int, chunk: int):
    # ids_ref i32[M] flat assignments (token * k + slot); order_ref i32[M]; group_sizes_ref i32[E]
    expert = pl.program_id(0)

    def load(c):
        index = c * chunk + jnp.arange(chunk)  # [C] assignment ids
        ids = plgpu.load(ids_ref.at[pl.ds(c * chunk, chunk)], mask=index < num_rows, other=_NO_EXPERT)
        return index, ids

    def count_below(ids):
        return jnp.sum(jnp.where(ids < expert, 1, 0))

    def place(index, ids, start, placed):
        """Stores this chunk's rows of the expert after the ``placed`` ones; returns the new count."""
        hit = jnp.where(ids == expert, 1, 0)  # [C]
        rank = placed + jnp.cumsum(hit) - hit  # [C] among the expert's rows, in assignment order
        # Other lanes point past the end: masked on the GPU, dropped by interpret mode's scatter.
        row = jnp.where(hit > 0, start + rank, num_rows)
        plgpu.store(order_ref.at[row], index, mask=hit > 0)
        return placed + jnp.sum(hit)

    num_chunks = pl.cdiv(num_rows, chunk)
    if num_chunks == 1:
        index, ids = load(0)
        size = place(index, ids, count_below(ids), jnp.int32(0))
    else:  # two passes: the expert's first row needs every chunk counted
        start = jax.lax.fori_loop(0, num_chunks, lambda c, below: below + count_below(load(c)[1]),
                                  jnp.int32(0))
        size = jax.lax.fori_loop(0, num_chunks, lambda c, placed: place(*load(c), start, placed),
                                 jnp.int32(0))
    plgpu.store(group_sizes_ref.at[expert], size)


@functools.partial(jax.jit, static_argnames=("num_experts", "chunk", "interpret"))
def sort_by_expert(ids, num_experts: int, *, chunk: int | None = None, interpret: bool = False):
    """Same (order i32[T*k], group_sizes i32[E]) as ``sort_by_expert_reference``, in one kernel.

    ids i32[T, k] in [0, E]; an id equal to E (an empty slot under expert parallelism) joins no group:
    its assignment is then missing from ``order``, whose rows past sum(group_sizes) are unspecified.
    ``chunk`` overrides the assignments a program holds at once (tests).
    """
    flat = ids.reshape(-1).astype(jnp.int32)
    num_rows = flat.shape[0]
    max_chunk, num_warps = next((c for c in _SORT_CHUNKS if c[0] >= num_rows), _SORT_CHUNKS[-1])
    chunk = chunk or min(max_chunk, max(16, pl.next_power_of_2(num_rows)))
    kernel = functools.partial(_sort_kernel, num_rows=num_rows, chunk=chunk)
    return pl.pallas_call(
        kernel,
        grid=(num_experts,),
        out_shape=(jax.ShapeDtypeStruct((num_rows,), jnp.int32),
                   jax.ShapeDtypeStruct((num_experts,), jnp.int32)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_sort",
    )(flat)
