"""Parameter creation: every weight carries logical axis names that a mesh later maps to devices.

Axis vocabulary: layers, vocab, embed, heads, q_lora, kv_lora, qk_head, v_head, mlp, expert, moe_mlp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

INIT_STD = 0.02  # Hugging Face's initializer_range for DeepSeek


def param(rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype,
          init: str = "normal") -> nnx.Param:
    if len(shape) != len(axes):
        raise ValueError(f"parameter of shape {shape} needs {len(shape)} axis names, got {axes}")
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    return tuple(variable.get_metadata().get("out_sharding") or ())
