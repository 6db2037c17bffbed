"""Causal self-attention at MLA shapes (expanded form): per-head keys decompressed from the latent.

q/k head dim = qk_nope + qk_rope (128 + 64 in DeepSeek) kept as two parts, the rope key shared by all
heads; v head dim 128.
"""
from __future__ import annotations
import jax
import jax.numpy as jnp


def mla_prefill_reference(q_nope, q_pe, k_nope, k_pe, v, scale):
    """q_nope [B, T, H, Dn], q_pe [B, T, H, R], k_nope [B, T, H, Dn], k_pe [B, T, R], v [B, T, H, Dv]
    -> [B, T, H, Dv] in v.dtype; causal within each sequence, softmax in f32."""
    s = (jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=jnp.float32)
         + jnp.einsum("bqhr,bkr->bhqk", q_pe, k_pe, preferred_element_type=jnp.float32)) * scale
    seq_len = q_nope.shape[1]
    causal = jnp.tril(jnp.ones((seq_len, seq_len), bool))
    s = jnp.where(causal, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=jnp.float32).astype(v.dtype)
