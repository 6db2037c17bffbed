"""Routed experts of a DeepSeekMoE layer: each token through its top-k experts' SwiGLU MLPs, weighted and summed."""
from __future__ import annotations
import jax
import jax.numpy as jnp


def moe_experts_reference(x, weights, ids, w_gate, w_up, w_down):
    """x [T, D], weights f32[T, k], ids i32[T, k], w_gate/w_up [E, D, I], w_down [E, I, D] -> [T, D].

    Exact but dense: every token goes through every expert and unselected experts get weight 0.
    Fine on CPU and for small shapes; the GPU path is the grouped kernel.
    """
    num_tokens = x.shape[0]
    num_experts = w_gate.shape[0]
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32).at[
        jnp.arange(num_tokens)[:, None], ids].add(weights.astype(jnp.float32))  # [T, E]
    gate = jnp.einsum("td,edi->tei", x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("td,edi->tei", x, w_up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gate) * up * combine[..., None]).astype(x.dtype)  # [T, E, I]
    out = jnp.einsum("tei,eid->td", h, w_down, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)
