"""Routing kernel (interpret mode) against its reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_routing import RoutingSpec, route, route_reference
from tests.pallas_kernels.kernel_utils import lower_for_h200, run_fast


def _tied_logits(rng, num_tokens, num_experts):
    """Logits on a coarse grid (about 7 values) so scores, group scores and picks tie exactly."""
    return jnp.asarray(np.round(rng.standard_normal((num_tokens, num_experts)) * 1.5) / 2, jnp.float32)


# Every topk_method x scoring_func, with groups of power-of-two size (the kernel's reshape path) and
# of other sizes (its masked path).
SPECS = [  # (num_experts, spec, with_bias)
    (16, RoutingSpec(top_k=4), False),  # V2-Lite: softmax greedy
    (16, RoutingSpec(3, "sigmoid", norm_topk_prob=True, routed_scaling_factor=2.0), False),
    (24, RoutingSpec(3, "softmax", "group_limited_greedy", n_group=4, topk_group=2), False),  # V2
    (32, RoutingSpec(4, "sigmoid", "group_limited_greedy", 4, 2, True, 1.5), False),
    (32, RoutingSpec(4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                     routed_scaling_factor=2.5), True),  # V3, scaled down
    (20, RoutingSpec(3, "softmax", "noaux_tc", 4, 3, False, 1.0), False),  # noaux without bias
    # More picks than allowed experts: the last two are -inf masked ones, lowest ids first.
    (16, RoutingSpec(6, "sigmoid", "noaux_tc", 4, 1, True, 1.0), True),
]


@pytest.mark.parametrize("num_experts,spec,with_bias", SPECS,
                         ids=lambda v: v.topk_method + "-" + v.scoring_func
                         if isinstance(v, RoutingSpec) else None)
def test_route_matches_reference_with_ties(num_experts, spec, with_bias):
    rng = np.random.default_rng(num_experts + spec.top_k)
    logits = _tied_logits(rng, 45, num_experts)  # 45 tokens: a partial last tile
    bias = jnp.asarray(np.round(rng.standard_normal(num_experts) * 2) / 8, jnp.float32) if with_bias else None
    (weights, ids), (ref_weights, ref_ids) = run_fast(
        lambda l, b: (route(l, b, spec, block_tokens=16, interpret=True), route_reference(l, b, spec)),
        logits, bias)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-6, atol=1e-7)


def test_route_continuous_logits_bf16_and_default_blocks():
    spec = RoutingSpec(6, "sigmoid", "noaux_tc", 8, 4, True, 2.5)
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((33, 64)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(64) * 0.1, jnp.float32)
    (weights, ids), (ref_weights, ref_ids) = run_fast(
        lambda l, b: (route(l, b, spec, interpret=True), route_reference(l, b, spec)), logits, bias)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-6, atol=1e-7)


def test_route_rejects_bad_spec():
    with pytest.raises(ValueError, match="n_group=3 must divide num_experts=16"):
        route(jnp.zeros((4, 16)), None, RoutingSpec(2, "sigmoid", "noaux_tc", 3, 1), interpret=True)
    with pytest.raises(ValueError, match="top_k=20"):
        route(jnp.zeros((4, 16)), None, RoutingSpec(20), interpret=True)


@pytest.mark.parametrize("num_experts,spec", [
    (64, RoutingSpec(6)),  # V2-Lite
    (160, RoutingSpec(6, "softmax", "group_limited_greedy", 8, 3)),  # V2: 8 groups of 20
    (256, RoutingSpec(8, "sigmoid", "noaux_tc", 8, 4, True, 2.5)),  # V3
], ids=["v2_lite", "v2", "v3"])
def test_route_lowers_to_triton_for_h200(num_experts, spec):
    args = (jax.ShapeDtypeStruct((8192, num_experts), jnp.float32),
            jax.ShapeDtypeStruct((num_experts,), jnp.float32))
    hlo = lower_for_h200(lambda logits, bias: route(logits, bias, spec), *args)
    assert hlo.count("__gpu$xla.gpu.triton") == 1
