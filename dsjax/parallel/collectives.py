"""Collectives of the local view: model code runs per device inside the runner's shard_map, and these
helpers are no-ops outside one, so the same model code serves one device and a mesh.

Axis sizes come from the abstract mesh that shard_map sets while tracing its body. The collectives
run whenever the axis is manual, even with one rank: shard_map's replication check counts a value
as varying along every axis its inputs were split over, and only the collective makes it uniform
(XLA drops a one-rank collective).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsjax.parallel.mesh import BATCH_AXES, TENSOR


def is_manual(name: str) -> bool:
    """Whether we are tracing a shard_map body over mesh axis ``name``."""
    return name in jax.sharding.get_abstract_mesh().manual_axes


def axis_size(name: str) -> int:
    """Ranks along mesh axis ``name`` in the current shard_map body (1 outside one)."""
    return jax.sharding.get_abstract_mesh().shape[name] if is_manual(name) else 1


def psum_tensor(x):
    """Sum of the tensor ranks' partial results (after o_proj, the MLP down projections)."""
    return jax.lax.psum(x, TENSOR) if is_manual(TENSOR) else x


def embed_lookup(table, tokens):
    """table [V/tp, D] (this rank's rows of the vocabulary), tokens i32[...] -> [..., D]."""
    if not is_manual(TENSOR):
        return jnp.take(table, tokens, axis=0)
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(TENSOR) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[..., None], jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0), 0)
    return jax.lax.psum(x, TENSOR)  # one rank holds each row: the sum is exact


def gather_vocab(logits):
    """[..., V/tp] -> [..., V]: the full logits on every tensor rank, for sampling."""
    if not is_manual(TENSOR):
        return logits
    return jax.lax.all_gather(logits, TENSOR, axis=logits.ndim - 1, tiled=True, to="invarying")


def gather_batch(tree):
    """Leading axis of every leaf concatenated over the data-parallel ranks (rank-major), replicated."""
    axes = tuple(a for a in BATCH_AXES if is_manual(a))
    if not axes:
        return tree
    return jax.tree.map(lambda x: jax.lax.all_gather(x, axes, tiled=True, to="invarying"), tree)
