"""Expert parallelism: routed experts split over mesh axis 'expert'; each token's assignments reach the
ranks that own their experts, run there, and come back weighted, inside the runner's shard_map.

Three transports with one meaning:
  allgather  every rank gathers every rank's tokens (with their routing), runs its own experts' share
             of each, and a reduce-scatter sums the shares back to each token's rank. Each token
             travels once, whatever its k: the cheaper exchange while ep <= k (a token then usually
             has assignments on several ranks), and both collectives are NCCL's fastest. The default
             there (``auto``).
  padded     lax.all_to_all of fixed [ep, C, D] blocks, any backend (CPU included): every rank sends C
             rows to every other, used or not. ``auto`` for ep > k.
  ragged     lax.ragged_all_to_all (GPU): only the rows in use travel; the receive buffer still has the
             static worst-case size. On two H200s XLA's one-shot kernel for it took ~470 us a call at
             V2-Lite batch 256 (benchmarks/results/parallel_h200x2.json): opt-in only.

Each transport sends one collective per direction per layer: rows travel with their routing weights and
expert ids bit-packed into trailing columns (all of it viewed as unsigned integers of the row dtype's
width, so no float rule touches the bits); on GPU each NCCL collective costs its launch and latency,
whatever it carries.

Capacity C bounds the rows one rank sends to one other per layer (the all-to-all transports; the
all-gather one never drops). Drop-free (the default) is the worst case T * min(k, experts per rank):
every assignment of every local token lands on one rank. A factor f gives C = ceil(f * T * k / ep)
instead: buffers and padded traffic shrink by min(k, E/ep) * ep / (f * k), and any assignment past C
on its destination is dropped (its weight is lost for that token). Tests and the default run drop-free.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from dsjax.config import EXPERT_ALL_TO_ALL, ParallelConfig
from dsjax.parallel.collectives import axis_size
from dsjax.parallel.mesh import EXPERT

# (rows [R, D], routing weights f32[R, j], local expert ids i32[R, j]; id == experts per rank marks an
# empty slot) -> [R, D]: each row through its j experts, weighted and summed.
ExpertFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

ragged_all_to_all = jax.lax.ragged_all_to_all  # module attribute: CPU tests substitute an emulation


TRANSPORTS = tuple(t for t in EXPERT_ALL_TO_ALL if t != "auto")  # ParallelConfig.expert_all_to_all's


class ExpertDispatch(NamedTuple):
    """Static choices of the expert exchange (hashable: part of the model's graph definition).
    ``transport``: one of TRANSPORTS, or "auto" (see ``pick_transport``)."""

    capacity_factor: float | None = None
    transport: str = "auto"


def expert_dispatch(parallel: ParallelConfig) -> ExpertDispatch:
    return ExpertDispatch(parallel.expert_capacity_factor, parallel.expert_all_to_all)


def pick_transport(transport: str, num_ranks: int, top_k: int) -> str:
    """``auto``: the all-gather while each token travels no more than its assignments would
    (ep <= k), else the padded all-to-all."""
    if transport == "auto":
        return "allgather" if num_ranks <= top_k else "padded"
    if transport not in TRANSPORTS:
        raise ValueError(f"expert transport {transport!r}; accepted: auto, {', '.join(TRANSPORTS)}")
    return transport


def capacity(num_tokens: int, top_k: int, num_local_experts: int, num_ranks: int,
             factor: float | None) -> int:
    """Rows one rank may send to one other per layer (see the module docstring)."""
    worst = num_tokens * min(top_k, num_local_experts)
    if factor is None:
        return worst
    return max(1, min(worst, math.ceil(factor * num_tokens * top_k / num_ranks)))


def moe_expert_parallel(x, weights, ids, num_local_experts: int, expert_fn: ExpertFn,
                        dispatch: ExpertDispatch = ExpertDispatch()):
    """x [T, D] (this rank's tokens), weights f32[T, k], ids i32[T, k] (global expert ids; rank r owns
    experts [r*El, (r+1)*El)) -> [T, D] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""
    num_tokens, top_k = ids.shape
    num_ranks = axis_size(EXPERT)
    transport = pick_transport(dispatch.transport, num_ranks, top_k)
    if transport == "allgather":
        return _allgather(x, weights, ids, num_local_experts, expert_fn)
    cap = capacity(num_tokens, top_k, num_local_experts, num_ranks, dispatch.capacity_factor)
    flat_ids = ids.reshape(-1)
    dest = flat_ids // num_local_experts  # [A] owning rank of each assignment, A = T*k
    local_ids = (flat_ids % num_local_experts).astype(jnp.int32)
    # Rank of each assignment among those going to the same destination, in token order.
    onehot = (dest[:, None] == jnp.arange(num_ranks)[None, :]).astype(jnp.int32)  # [A, ep]
    rank_in_dest = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), dest[:, None], axis=1)[:, 0] - 1
    keep = rank_in_dest < cap
    send = (x[jnp.arange(flat_ids.shape[0]) // top_k], weights.reshape(-1).astype(jnp.float32), local_ids)
    exchange = _ragged if transport == "ragged" else _padded
    rows = exchange(send, dest, rank_in_dest, keep, jnp.sum(onehot, axis=0), cap, num_local_experts,
                    expert_fn)  # [A, D], weighted
    rows = jnp.where(keep[:, None], rows.astype(jnp.float32), 0.0)
    return jnp.sum(rows.reshape(num_tokens, top_k, -1), axis=1).astype(x.dtype)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _pack(rows, *columns):
    """rows [R, D] and per-row 32-bit values (f32 / i32 [R] or [R, j]) -> one uint[R, D + ...] array,
    uint of the rows' itemsize: the rows' bits, then each 32-bit value's bits in 4 / itemsize columns."""
    uint = _UINT[rows.dtype.itemsize]
    as_columns = lambda a: jax.lax.bitcast_convert_type(a, uint).reshape(rows.shape[0], -1)
    return jnp.concatenate([as_columns(rows), *(as_columns(c) for c in columns)], axis=1)


def _unpack(packed, hidden: int, dtype, width: int = 1):
    """_pack's inverse for rows of ``dtype`` followed by an f32 and an i32 column group of ``width``
    values a row: -> (rows [R, D], f32[R, width], i32[R, width])."""
    per_value = 4 // packed.dtype.itemsize
    def values(start, to):
        cols = packed[:, start:start + width * per_value].reshape(packed.shape[0], width, per_value)
        return jax.lax.bitcast_convert_type(cols if per_value > 1 else cols[..., 0], to)
    return (jax.lax.bitcast_convert_type(packed[:, :hidden], dtype), values(hidden, jnp.float32),
            values(hidden + width * per_value, jnp.int32))


def _allgather(x, weights, ids, num_local_experts, expert_fn):
    """Every rank's tokens and routing gathered (one collective), this rank's experts' share of each
    token, and a reduce-scatter that sums the shares and returns each rank its own tokens."""
    num_tokens, top_k = ids.shape
    packed = _pack(x, weights.astype(jnp.float32), ids.astype(jnp.int32))
    everyone = jax.lax.all_gather(packed, EXPERT, tiled=True)  # [ep * T, ...], rank-major
    rows, row_weights, row_ids = _unpack(everyone, x.shape[1], x.dtype, top_k)
    first = jax.lax.axis_index(EXPERT) * num_local_experts
    mine = (row_ids >= first) & (row_ids < first + num_local_experts)
    share = expert_fn(rows, jnp.where(mine, row_weights, 0.0), jnp.where(mine, row_ids - first, num_local_experts))
    return jax.lax.psum_scatter(share, EXPERT, scatter_dimension=0, tiled=True)


def _empty_rows(num_rows: int, hidden: int, dtype, num_local_experts: int):
    """num_rows packed rows that carry nothing: zero rows and weights, local id num_local_experts."""
    return _pack(jnp.zeros((num_rows, hidden), dtype), jnp.zeros((num_rows,), jnp.float32),
                 jnp.full((num_rows,), num_local_experts, jnp.int32))


def _scatter_rows(send, slot, num_rows: int, num_local_experts: int):
    """The assignments' (row, weight, local id), packed, at ``slot`` of a [num_rows] buffer; other rows
    empty."""
    rows = send[0]
    empty = _empty_rows(num_rows, rows.shape[1], rows.dtype, num_local_experts)
    return empty.at[slot].set(_pack(*send), mode="drop")


def _padded(send, dest, rank_in_dest, keep, counts, cap, num_local_experts, expert_fn):
    num_ranks = counts.shape[0]
    slot = jnp.where(keep, dest * cap + rank_in_dest, num_ranks * cap)  # [A]; past the end: dropped
    packed = _scatter_rows(send, slot, num_ranks * cap, num_local_experts)
    exchange = lambda a: jax.lax.all_to_all(a.reshape(num_ranks, cap, *a.shape[1:]), EXPERT, 0, 0
                                            ).reshape(a.shape)  # block r goes to rank r, comes from r
    rows, row_weights, row_ids = _unpack(exchange(packed), send[0].shape[1], send[0].dtype)
    out = exchange(expert_fn(rows, row_weights, row_ids))
    return out[jnp.minimum(slot, num_ranks * cap - 1)]


def _ragged(send, dest, rank_in_dest, keep, counts, cap, num_local_experts, expert_fn):
    num_ranks = counts.shape[0]
    num_assignments = dest.shape[0]
    send_sizes = jnp.minimum(counts, cap).astype(jnp.int32)  # [ep]
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    pos = jnp.where(keep, input_offsets[dest] + rank_in_dest, num_assignments)  # destination-sorted row
    packed = _scatter_rows(send, pos, num_assignments, num_local_experts)
    sizes = jax.lax.all_gather(send_sizes, EXPERT)  # [src, dst] rows each rank sends each other
    me = jax.lax.axis_index(EXPERT)
    earlier = jnp.arange(num_ranks) < me
    output_offsets = jnp.sum(jnp.where(earlier[:, None], sizes, 0), axis=0).astype(jnp.int32)
    recv_sizes = sizes[:, me]
    num_recv = num_ranks * cap  # static bound: every source sends at most cap rows here

    hidden = send[0].shape[1]
    received = ragged_all_to_all(packed, _empty_rows(num_recv, hidden, send[0].dtype, num_local_experts),
                                 input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=EXPERT)
    rows, row_weights, row_ids = _unpack(received, hidden, send[0].dtype)
    out = expert_fn(rows, row_weights, row_ids)  # rows grouped by source rank
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    # Each source's rows go back to where it sent them from: its input offset for this rank.
    back_offsets = jnp.sum(jnp.where(earlier[None, :], sizes, 0), axis=1).astype(jnp.int32)
    back = ragged_all_to_all(out, jnp.zeros((num_assignments,) + out.shape[1:], out.dtype), recv_offsets,
                             recv_sizes, back_offsets, send_sizes, axis_name=EXPERT)
    return back[jnp.minimum(pos, num_assignments - 1)]
