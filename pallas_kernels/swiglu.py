"""Dense SwiGLU: silu(x @ W_gate) * (x @ W_up), the first half of every DeepSeek MLP and shared expert."""
from __future__ import annotations
import jax
import jax.numpy as jnp


def swiglu_reference(x, w_gate, w_up):
    """x [T, D], w_gate/w_up [D, I] -> [T, I] in x.dtype, accumulating in f32."""
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate) * up).astype(x.dtype)
