"""Multi-head latent attention over the paged latent cache (absorbed form).

Every head of a sequence reads the same cache: the latent c_kv [kv_lora_rank] and the shared rope key
k_pe [rope_dim] of each token. Queries arrive already absorbed: q_latent = q_nope @ W_UK.

The kernel is flash-decoding on the Triton lowering. A program owns (head tile, context split,
sequence): it reads each cache token of its split once for all ``block_h`` heads of the tile and keeps
an f32 online softmax (m, l, acc). With one split the program writes the output directly; otherwise a
second small kernel merges the per-split partials. Each iteration gathers ``block_k`` cache rows
through the block table, one row per token, so any page size works (4 … 64, or a whole sequence).
"""
from __future__ import annotations
from typing import NamedTuple
import jax
import jax.numpy as jnp


def mla_paged_reference(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale):
    """Ragged paged attention, one query token at a time.

    q_latent [T, H, C], q_pe [T, H, R]; c_kv [N, bs, C], k_pe [N, bs, R] (the paged caches);
    block_tables i32[S, W]; seq_ids i32[T] (row of block_tables per token); positions i32[T].
    Token t attends to the keys at positions 0..positions[t] of sequence seq_ids[t], which the caller
    has already written (this covers decode, chunked prefill and prefix-cache hits alike).
    Returns the latent context [T, H, C] in q_latent.dtype. Online softmax over blocks in f32, looping
    only as far as the longest context in the batch.
    """
    num_tokens, num_heads, latent_dim = q_latent.shape
    block_size = c_kv.shape[1]
    tables = block_tables[seq_ids]  # [T, W]
    q_latent32 = q_latent.astype(jnp.float32)
    q_pe32 = q_pe.astype(jnp.float32)
    num_blocks = jnp.max(positions) // block_size + 1

    def body(j, carry):
        m, l, acc = carry  # [T, H], [T, H], [T, H, C]
        blocks = tables[:, j]
        keys = c_kv[blocks].astype(jnp.float32)  # [T, bs, C]
        keys_pe = k_pe[blocks].astype(jnp.float32)  # [T, bs, R]
        s = (jnp.einsum("thc,tkc->thk", q_latent32, keys)
             + jnp.einsum("thr,tkr->thk", q_pe32, keys_pe)) * scale
        key_pos = j * block_size + jnp.arange(block_size)
        s = jnp.where(key_pos[None, None, :] <= positions[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum("thk,tkc->thc", p, keys)
        return m_new, l, acc

    init = (jnp.full((num_tokens, num_heads), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, num_heads), jnp.float32),
            jnp.zeros((num_tokens, num_heads, latent_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    return (acc / l[..., None]).astype(q_latent.dtype)


def mla_decode_reference(q_latent, q_pe, c_kv, k_pe, block_tables, lengths, scale):
    """One query token per sequence at position lengths-1.

    q_latent [B, H, C], q_pe [B, H, R], c_kv [N, bs, C], k_pe [N, bs, R], block_tables i32[B, W],
    lengths i32[B] (>= 1, the new token's key included) -> [B, H, C].
    """
    batch = q_latent.shape[0]
    return mla_paged_reference(q_latent, q_pe, c_kv, k_pe, block_tables,
                               jnp.arange(batch, dtype=jnp.int32), lengths - 1, scale)
