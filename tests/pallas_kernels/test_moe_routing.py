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


@pytest.mark.parametrize("num_experts,spec,with_bias", [SPECS[0], SPECS[4]],
                         ids=lambda v: v.topk_method + "-" + v.scoring_func
                         if isinstance(v, RoutingSpec) else None)
@pytest.mark.parametrize("rows_programs", [0, 3])
def test_route_finishes_the_norm(num_experts, spec, with_bias, rows_programs):
    """norm_rows: the router's products of x * g with each row's sum of squares as a last column; the
    kernel scales the logits by 1 / rms before scoring (V3's picked weights too) and returns the normed
    rows, as route_norm_reference and as routing RMSNorm(x) @ w does; written by the routing program or
    (rows_programs=3) by three programs of 32 columns beside it."""
    from pallas_kernels.common import rms_norm
    from pallas_kernels.moe_routing import NormRows, route_norm_reference

    rng = np.random.default_rng(7)
    tokens, depth = 11, 96  # a depth that is no power of two: the last column step is masked
    x = jnp.asarray(rng.standard_normal((tokens, depth)) * 3, jnp.bfloat16)
    norm = jnp.asarray(1 + 0.2 * rng.standard_normal((3, depth)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((depth, num_experts)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(num_experts) * 0.1, jnp.float32) if with_bias else None
    x32 = x.astype(jnp.float32)
    logits = jnp.concatenate([(x32 * norm[2].astype(jnp.float32)) @ w, jnp.sum(x32 * x32, -1, keepdims=True)], -1)
    rows = NormRows(x, norm, jnp.int32(2))
    got = run_fast(lambda l, b, r: route(l, b, spec, norm_rows=r, norm_eps=1e-6, rows_programs=rows_programs,
                                         block_tokens=8, interpret=True), logits, bias, rows)
    want = route_norm_reference(logits, bias, spec, rows, 1e-6)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(want[2], np.float32))
    normed = rms_norm(x, norm[2], 1e-6)
    np.testing.assert_allclose(np.asarray(got[2], np.float32), np.asarray(normed, np.float32), rtol=1e-2, atol=1e-2)
    plain = route_reference(normed.astype(jnp.float32) @ w, bias, spec)
    assert np.mean(np.asarray(got[1]) == np.asarray(plain[1])) > 0.9  # bf16 rows vs x * g then 1 / rms
    with pytest.raises(ValueError, match="norm_rows and norm_eps come together"):
        route(logits, bias, spec, norm_rows=rows, interpret=True)
    with pytest.raises(ValueError, match="rows_programs=5 splits the normed rows' 96 columns"):
        route(logits, bias, spec, norm_rows=rows, norm_eps=1e-6, rows_programs=5, interpret=True)


@pytest.mark.parametrize("tokens, spec", [(1, RoutingSpec(top_k=6)),
                                          (2, RoutingSpec(8, "sigmoid", "noaux_tc", 8, 4, True, 2.5))])
@pytest.mark.parametrize("rows_programs", [0, 4])
def test_route_with_norm_rows_lowers_to_triton_for_h200(tokens, spec, rows_programs):
    """The norm-finishing router at V2-Lite's (64 experts + the squares column, 2048-wide rows) and V3's
    (256 + 1, 7168) decode shapes, the rows written by the routing program or by four of their own:
    one Triton call."""
    from pallas_kernels.moe_routing import NormRows

    experts, depth = (64, 2048) if spec.top_k == 6 else (256, 7168)
    shape = jax.ShapeDtypeStruct
    hlo = lower_for_h200(lambda logits, bias, x, norm, layer: route(
        logits, bias, spec, norm_rows=NormRows(x, norm, layer), norm_eps=1e-6, rows_programs=rows_programs),
        shape((tokens, experts + 1), jnp.float32), shape((experts,), jnp.float32),
        shape((tokens, depth), jnp.bfloat16), shape((26, depth), jnp.bfloat16), shape((), jnp.int32))
    assert hlo.count("__gpu$xla.gpu.triton") == 1
