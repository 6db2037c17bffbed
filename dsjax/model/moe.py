"""Feed-forward blocks: the dense SwiGLU MLP and DeepSeekMoE (shared experts + routed experts)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model import dispatch
from dsjax.model.norms import rms_norm
from dsjax.model.params import param
from dsjax.parallel.collectives import axis_size
from dsjax.parallel.expert import ExpertDispatch
from dsjax.parallel.mesh import EXPERT
from pallas_kernels.moe_routing import NormRows, RoutingSpec


class MLP(nnx.Module):
    """down(silu(x W_gate) * (x W_up)); dense layers and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype, rngs: nnx.Rngs, axis: str = "mlp"):
        self.w_gate = param(rngs, (hidden_size, intermediate_size), ("embed", axis), dtype)
        self.w_up = param(rngs, (hidden_size, intermediate_size), ("embed", axis), dtype)
        self.w_down = param(rngs, (intermediate_size, hidden_size), (axis, "embed"), dtype)

    def __call__(self, x, *, backend: str, stacked=None):
        """x [T, D] -> [T, D] (a partial sum over tensor ranks: each holds some columns). ``stacked`` =
        (w_gate, w_up, w_down of every layer [L, ...], this layer's index): small batches then run the
        kernels on the stack in place."""
        if stacked is not None and x.shape[0] <= dispatch.STACKED_GEMV_MAX_TOKENS:
            return dispatch.stacked_mlp(x, *stacked, backend)
        h = dispatch.swiglu(x, self.w_gate[...], self.w_up[...], backend)
        return jnp.dot(h, self.w_down[...])

    def decode(self, x, stack, eps: float, backend: str, add_residual: bool = False):
        """A few raw tokens x [T, D] (T <= ``dispatch.STACKED_GEMV_MAX_TOKENS``), before the layer's
        RMSNorm, with every layer's weights at hand (``stack``, see ``DeepseekForCausalLM._stacked``):
        the norm and the gate and up products in one stacked-GEMV launch, then the down GEMV (plus x
        with ``add_residual``); one token on Hopper through the expert launch where
        ``dispatch.dense_mlp_mgpu_takes``."""
        w_gate, w_up, w_down = stack.mlp
        if dispatch.dense_mlp_mgpu_takes(x, w_gate, backend):
            return dispatch.dense_mlp_decode(rms_norm(x, stack.mlp_norm[stack.index], eps), w_gate, w_up, w_down,
                                             stack.index, residual=x if add_residual else None)
        gate, up, normed = dispatch.stacked_matmuls(x, (w_gate, w_up), stack.index, backend, norm=(stack.mlp_norm, eps))
        out = dispatch.stacked_swiglu_down(gate, up, w_down, stack.index, backend, normed.dtype)
        return x + out if add_residual else out


def routing_spec(config: ModelConfig) -> RoutingSpec:
    return RoutingSpec(
        top_k=config.num_experts_per_tok, scoring_func=config.scoring_func, topk_method=config.topk_method,
        n_group=config.n_group, topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor)


class MoE(nnx.Module):
    """Shared experts see every token; each token also goes to its top-k routed experts."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs,
                 expert_dispatch: ExpertDispatch = ExpertDispatch()):
        d, e, i = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
        self.spec = routing_spec(config)
        self.expert_dispatch = expert_dispatch
        # The router stays in f32, as DeepSeek and transformers keep it: top-k choices are sensitive.
        self.router = param(rngs, (d, e), ("embed", None), jnp.float32)
        self.score_bias = (param(None, (e,), (None,), jnp.float32, init="zeros")
                           if config.topk_method == "noaux_tc" else None)
        self.w_gate = param(rngs, (e, d, i), ("expert", "embed", "moe_mlp"), dtype)
        self.w_up = param(rngs, (e, d, i), ("expert", "embed", "moe_mlp"), dtype)
        self.w_down = param(rngs, (e, i, d), ("expert", "moe_mlp", "embed"), dtype)
        self.shared = (MLP(d, i * config.n_shared_experts, dtype, rngs)
                       if config.n_shared_experts else None)

    def route(self, x, *, backend: str):
        """x [T, D] -> (weights f32[T, k], expert ids i32[T, k])."""
        return self._route_logits(jnp.dot(x.astype(jnp.float32), self.router[...]), backend)

    def _route_logits(self, logits, backend: str, norm_rows: NormRows | None = None, norm_eps: float | None = None):
        bias = None if self.score_bias is None else self.score_bias[...]
        return dispatch.moe_route(logits, bias, self.spec, backend, norm_rows, norm_eps)

    def __call__(self, x, *, backend: str, stacked_experts=None, stacked_shared=None):
        """x [T, D] -> [T, D] (a partial sum over tensor ranks). ``stacked_experts`` = (w_gate, w_up,
        w_down of every MoE layer [L, E, ...], this layer's index): the kernels then read the stack in
        place; ``stacked_shared`` the same for the shared experts (see MLP)."""
        weights, ids = self.route(x, backend=backend)
        if stacked_experts is None:
            experts, layer = (self.w_gate[...], self.w_up[...], self.w_down[...]), None
        else:
            *experts, layer = stacked_experts
        out = dispatch.moe_experts(x, weights, ids, *experts, backend, layer=layer,
                                   expert_dispatch=self.expert_dispatch)
        if self.shared is not None:
            out = out + self.shared(x, backend=backend, stacked=stacked_shared)
        return out

    def decode(self, x, stack, eps: float, backend: str, add_residual: bool = False):
        """A few raw tokens x [T, D] (T <= ``dispatch.STACKED_GEMV_MAX_TOKENS``), before the layer's
        RMSNorm, with every layer's weights at hand (``stack``, see ``DeepseekForCausalLM._stacked``):
        one stacked-GEMV launch normalizes x and computes the f32 router logits and the shared experts'
        gate and up products; the routed experts then take the normed rows. At the smallest steps
        (``dispatch.MOE_DECODE_MAX_TOKENS``, local experts) routed and shared experts run in one launch,
        the routing kernel finishes the norm (``dispatch.ROUTER_NORM_IN_ROUTE``: the stacked GEMV then
        computes only the router's products of x * g and the rows' sums of squares), and with
        ``add_residual`` (x plus the sublayer's output comes back) the experts' launch may add x to its
        sum (``dispatch.MOE_DECODE_RESIDUAL_MAX_TOKENS``)."""
        one_launch = x.shape[0] <= dispatch.MOE_DECODE_MAX_TOKENS and axis_size(EXPERT) == 1
        shared = stack.mlp[:2] if self.shared is not None and not one_launch else ()
        if one_launch and dispatch.ROUTER_NORM_IN_ROUTE and backend != "reference":
            # the router's split-K partials and the rows' squares summed in one reduction
            logits, squares = dispatch.stacked_matmuls(x, (stack.router,), stack.index, backend,
                                                       norm=(stack.mlp_norm, eps), partials=True)
            splits, (num_tokens, num_experts) = squares.shape[0] // x.shape[0], (x.shape[0], stack.router.shape[-1])
            summed = jnp.concatenate([logits.reshape(splits, num_tokens, num_experts),
                                      squares.reshape(splits, num_tokens, 1)], axis=-1).sum(axis=0)
            weights, ids, normed = self._route_logits(summed, backend, NormRows(x, stack.mlp_norm, stack.index), eps)
        else:
            logits, *gate_up, normed = dispatch.stacked_matmuls(x, (stack.router, *shared), stack.index, backend,
                                                                norm=(stack.mlp_norm, eps))
            weights, ids = self._route_logits(logits, backend)
        if one_launch:  # routed and shared experts together (pallas_kernels/moe_decode.py)
            shared_experts = stack.mlp if self.shared is not None else None
            fold = add_residual and x.shape[0] <= dispatch.MOE_DECODE_RESIDUAL_MAX_TOKENS and backend != "reference"
            out = dispatch.moe_decode(normed, weights, ids, stack.experts, shared_experts, stack.index, backend,
                                      residual=x if fold else None)
            return out if fold or not add_residual else x + out
        out = dispatch.moe_experts(normed, weights, ids, *stack.experts, backend, layer=stack.index,
                                   expert_dispatch=self.expert_dispatch)
        if self.shared is not None:
            out = out + dispatch.stacked_swiglu_down(*gate_up, stack.mlp[2], stack.index, backend, normed.dtype)
        return x + out if add_residual else out
