"""The training forward: the model's own modules, layer by layer as ``DeepseekForCausalLM.__call__``
runs them, plus each MoE layer's routing counts (which the auxiliary-loss-free balancing needs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Parameters kept in float32 whatever the compute dtype (the model creates them so: routing is
# sensitive to rounding).
FLOAT32_PARAMS = ("router", "score_bias")


def path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def cast_params(params, dtype):
    """The parameter tree in ``dtype``, except the router and its bias."""
    dtype = jnp.dtype(dtype)

    def cast(path, leaf):
        if any(name in FLOAT32_PARAMS for name in path_names(path)):
            return leaf
        return leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def _scan_stack(stack, x, step):
    """x -> step(layer, x) -> (x, per-layer output) over a stack of layers; (x, stacked outputs)."""
    graphdef, state = nnx.split(stack)
    return jax.lax.scan(lambda carry, layer_state: step(nnx.merge(graphdef, layer_state), carry), x, state)


def forward_with_routing(model, tokens):
    """tokens i32[B, T] -> (logits f32[B, T, V] equal to ``model(tokens)``, expert counts
    i32[num_moe_layers, n_routed_experts]: how many (token, slot) assignments each expert got)."""
    config, backend = model.config, model.kernel_backend
    x = jnp.take(model.embed[...], tokens, axis=0)  # [B, T, D]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

    def dense_step(layer, x):
        return layer(x, positions, mode="expanded", backend=backend), None

    def moe_step(layer, x):
        h = x + layer.attn(layer.attn_norm(x), positions, mode="expanded", backend=backend)
        flat = layer.mlp_norm(h.reshape(-1, h.shape[-1]))  # [B*T, D]
        _, ids = layer.mlp.route(flat, backend=backend)  # [B*T, k]; the MoE call below routes alike
        counts = jnp.zeros((config.n_routed_experts,), jnp.int32).at[ids.reshape(-1)].add(1)
        return h + layer.mlp(flat, backend=backend).reshape(h.shape), counts

    if model.dense_layers is not None:
        x, _ = _scan_stack(model.dense_layers, x, dense_step)
    counts = jnp.zeros((0, max(config.n_routed_experts, 1)), jnp.int32)
    if model.moe_layers is not None:
        x, counts = _scan_stack(model.moe_layers, x, moe_step)
    return model.compute_logits(model.norm(x)), counts


def next_token_loss(logits, targets):
    """Mean cross-entropy of logits f32[B, T, V] against targets i32[B, T]."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))


def update_score_bias(params, counts, speed: float):
    """DeepSeek-V3's auxiliary-loss-free balancing: each MoE layer's ``score_bias`` [L, E] moves by
    ``speed`` toward its under-loaded experts (up) and away from its over-loaded ones (down).
    ``counts`` i32[L, E] are the step's routing counts; the bias only steers the top-k choice."""
    moe = params.get("moe_layers")
    if moe is None or "score_bias" not in moe["mlp"] or speed == 0:
        return params
    load = counts.astype(jnp.float32)
    step = speed * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    bias = moe["mlp"]["score_bias"]
    mlp = {**moe["mlp"], "score_bias": bias + step.astype(bias.dtype)}
    return {**params, "moe_layers": {**moe, "mlp": mlp}}


def load_imbalance(counts):
    """max load / mean load per MoE layer, f32[L] (1 when perfectly balanced)."""
    load = counts.astype(jnp.float32)
    return jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
