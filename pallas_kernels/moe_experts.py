"""Routed experts of a DeepSeekMoE layer: each token through its top-k experts' SwiGLU MLPs,
weighted and summed.

Three implementations with one meaning:
- ``moe_experts``: the GPU path, three kernels and one XLA fusion: expert sort (order and group sizes)
  -> grouped SwiGLU gathering token rows itself -> grouped down projection scaling each row by its
  routing weight and storing it back in (token, slot) order -> the sum of each token's k rows.
- ``moe_experts_xla``: the plain-XLA sort-based path (the benchmark anchor).
- ``moe_experts_reference``: dense one-hot, exact but O(T * E).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.grouped_swiglu import TileConfig, grouped_matmul, grouped_swiglu
from pallas_kernels.moe_sort import sort_by_expert, sort_by_expert_reference


def _config_kwargs(config: TileConfig | None) -> dict:
    return {} if config is None else config._asdict()


@functools.partial(jax.jit, static_argnames=("swiglu_config", "down_config", "interpret"))
def moe_experts(x, weights, ids, w_gate, w_up, w_down, *, layer=None, swiglu_config: TileConfig | None = None,
                down_config: TileConfig | None = None, interpret: bool = False):
    """x [T, D], weights f32[T, k], ids i32[T, k], w_gate/w_up [E, D, I], w_down [E, I, D] -> [T, D].

    Same semantics as ``moe_experts_reference``; an id equal to E (the number of experts) marks an
    empty slot that contributes nothing (expert parallelism's padding rows). With ``layer`` (i32
    scalar, may be traced) the weights are every layer's, stacked [L, E, ...], and layer ``layer``'s experts are used in place
    (a layer loop would otherwise copy its slice of the stack for the kernels each layer). The
    [T*k, D] expert outputs are kept in x.dtype (f32 accumulation inside each GEMM and across the k
    experts). ``*_config`` override the kernels' tile tables (benchmarks).
    """
    num_tokens, top_k = ids.shape
    offset = None
    if layer is not None:
        num_layers, num_experts = w_gate.shape[:2]
        w_gate, w_up, w_down = (w.reshape(num_layers * num_experts, *w.shape[2:]) for w in (w_gate, w_up, w_down))
        offset = layer * num_experts
    else:
        num_experts = w_gate.shape[0]
    # Empty slots (id E) join no group: the kernels never reach them and their rows stay unwritten.
    order, group_sizes = sort_by_expert(ids, num_experts, interpret=interpret)
    h = grouped_swiglu(x, group_sizes, w_gate, w_up, order=order, top_k=top_k, expert_offset=offset,
                       interpret=interpret, **_config_kwargs(swiglu_config))  # [T*k, I], sorted
    y = grouped_matmul(h, group_sizes, w_down, order=order, row_scale=weights.reshape(-1),
                       expert_offset=offset, interpret=interpret,
                       **_config_kwargs(down_config))  # [T*k, D], (token, slot) order, weighted
    # Combine: one fused pass adding each token's k rows.
    rows = jnp.where((ids < num_experts).reshape(-1, 1), y.astype(jnp.float32), 0.0)
    return jnp.sum(rows.reshape(num_tokens, top_k, -1), axis=1).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("capacity",))
def moe_experts_xla(x, weights, ids, w_gate, w_up, w_down, *, capacity: int | None = None):
    """Plain-XLA sort-based routed experts; same semantics as ``moe_experts_reference``.

    Rows are sorted by expert (argsort), then processed in rounds: round r takes rows
    [r*C, (r+1)*C) of every expert into an [E, C, D] block and runs batched einsums against the
    weights in place (no weight gather), scatter-adding weighted outputs into the tokens. Rounds run
    until the largest group is done, so nothing is dropped; C (``capacity``, default the mean group
    size rounded up to a power of two) trades padding compute against weight re-reads per round.
    """
    num_tokens, top_k = ids.shape
    num_experts, _, _ = w_gate.shape
    num_rows = num_tokens * top_k
    capacity = capacity or max(8, pl.next_power_of_2(pl.cdiv(num_rows, num_experts)))
    order, group_sizes = sort_by_expert_reference(ids, num_experts)
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    flat_weights = weights.reshape(-1).astype(jnp.float32)
    num_rounds = pl.cdiv(jnp.max(group_sizes), capacity)

    def one_round(r, out):  # out f32[T, D]
        local = r * capacity + jnp.arange(capacity)  # [C]
        valid = local[None, :] < group_sizes[:, None]  # [E, C]
        assignment = order[jnp.minimum(group_starts[:, None] + local[None, :], num_rows - 1)]
        token = assignment // top_k  # [E, C]
        x_round = jnp.where(valid[..., None], x[token], 0)  # [E, C, D]
        scale = jnp.where(valid, flat_weights[assignment], 0.0)
        gate = jnp.einsum("ecd,edi->eci", x_round, w_gate, preferred_element_type=jnp.float32)
        up = jnp.einsum("ecd,edi->eci", x_round, w_up, preferred_element_type=jnp.float32)
        h = (jax.nn.silu(gate) * up * scale[..., None]).astype(x.dtype)
        y = jnp.einsum("eci,eid->ecd", h, w_down, preferred_element_type=jnp.float32)
        dest = jnp.where(valid, token, num_tokens)  # padding rows fall off the end
        return out.at[dest.reshape(-1)].add(y.reshape(-1, y.shape[-1]), mode="drop")

    out = jax.lax.fori_loop(0, num_rounds, one_round,
                            jnp.zeros((num_tokens, x.shape[1]), jnp.float32))
    return out.astype(x.dtype)


def moe_experts_reference(x, weights, ids, w_gate, w_up, w_down):
    """x [T, D], weights f32[T, k], ids i32[T, k], w_gate/w_up [E, D, I], w_down [E, I, D] -> [T, D].

    Exact but dense: every token goes through every expert and unselected experts get weight 0.
    Fine on CPU and for small shapes; the GPU path is the grouped kernel. Ids equal to E are empty
    slots (dropped from the combine).
    """
    num_tokens = x.shape[0]
    num_experts = w_gate.shape[0]
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
        jnp.arange(num_tokens)[:, None], ids].add(weights.astype(jnp.float32), mode="drop")  # [T, E]
    gate = jnp.einsum("td,edi->tei", x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("td,edi->tei", x, w_up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gate) * up * combine[..., None]).astype(x.dtype)  # [T, E, I]
    out = jnp.einsum("tei,eid->td", h, w_down, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)
