"""Routed-expert paths (Pallas in interpret mode, plain-XLA sort-based) against the dense reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_swiglu import TileConfig
from pallas_kernels.moe_experts import moe_experts, moe_experts_reference, moe_experts_xla
from pallas_kernels.moe_routing import RoutingSpec, route, route_reference
from tests.pallas_kernels.kernel_utils import lower_for_h200, run_fast

SMALL_TILES = TileConfig(16, 32, 32, 4, 2)


def _layer(seed, num_tokens, num_experts, top_k, hidden, inter, dtype, skew=0.0):
    """Random MoE inputs (numpy: no per-op compiles); skew > 0 sends most rows to low expert ids."""
    rng = np.random.default_rng(seed)
    popularity = np.exp(-skew * np.arange(num_experts))
    ids = np.stack([rng.choice(num_experts, top_k, replace=False, p=popularity / popularity.sum())
                    for _ in range(num_tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (num_tokens, top_k)).astype(np.float32)

    def normal(*shape, fan_in=1):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), dtype)

    return (normal(num_tokens, hidden), jnp.asarray(weights), jnp.asarray(ids),
            normal(num_experts, hidden, inter, fan_in=hidden),
            normal(num_experts, hidden, inter, fan_in=hidden),
            normal(num_experts, inter, hidden, fan_in=inter))


@pytest.mark.parametrize("skew", [0.0, 2.0], ids=["balanced", "skewed"])
def test_moe_experts_f32(skew):
    args = _layer(0, 21, 8, 3, 32, 48, jnp.float32, skew)
    out, ref = run_fast(lambda *a: (moe_experts(*a, swiglu_config=SMALL_TILES, down_config=SMALL_TILES,
                                            interpret=True), moe_experts_reference(*a)), *args)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(12, 16, 4), (160, 4, 2)],
                         ids=["decode_tiles", "prefill_tiles"])  # 3 and 80 rows per expert
def test_moe_experts_bf16_default_tiles(num_tokens, num_experts, top_k):
    args = _layer(1, num_tokens, num_experts, top_k, 32, 32, jnp.bfloat16)
    out, ref = run_fast(lambda *a: (moe_experts(*a, interpret=True), moe_experts_reference(*a)), *args)
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-2)


def test_routed_layer_with_tied_router_logits():
    """route -> moe_experts as the benchmark's layer runs them: tied logits (ties go to the lower
    expert id in both paths) and a router that leaves some experts empty."""
    rng = np.random.default_rng(5)
    num_tokens, num_experts, top_k, hidden, inter = 19, 8, 3, 32, 48
    x, _, _, *experts = _layer(5, num_tokens, num_experts, top_k, hidden, inter, jnp.float32)
    logits = np.round(rng.standard_normal((num_tokens, num_experts)) * 1.5) / 2
    logits[:, 5:] -= 10.0  # experts 5-7 never chosen
    spec = RoutingSpec(top_k)

    def both(x, logits, *experts):
        weights, ids = route(logits, None, spec, interpret=True)
        out = moe_experts(x, weights, ids, *experts, swiglu_config=SMALL_TILES, down_config=SMALL_TILES,
                          interpret=True)
        ref_weights, ref_ids = route_reference(logits, None, spec)
        return out, moe_experts_reference(x, ref_weights, ref_ids, *experts), ids, ref_ids

    out, ref, ids, ref_ids = run_fast(both, x, jnp.asarray(logits, jnp.float32), *experts)
    np.testing.assert_array_equal(ids, ref_ids)
    assert np.asarray(ids).max() < 5
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity", [None, 2], ids=["default", "many_rounds"])
def test_moe_experts_xla(capacity):
    args = _layer(2, 19, 8, 3, 16, 24, jnp.float32, skew=1.0)
    out, ref = run_fast(lambda *a: (moe_experts_xla(*a, capacity=capacity), moe_experts_reference(*a)),
                    *args)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_moe_experts_lowers_to_triton_for_h200():
    num_tokens, top_k, num_experts, hidden, inter = 256, 6, 64, 2048, 1408  # V2-Lite decode
    shape = jax.ShapeDtypeStruct
    args = (shape((num_tokens, hidden), jnp.bfloat16), shape((num_tokens, top_k), jnp.float32),
            shape((num_tokens, top_k), jnp.int32),
            shape((num_experts, hidden, inter), jnp.bfloat16),
            shape((num_experts, hidden, inter), jnp.bfloat16),
            shape((num_experts, inter, hidden), jnp.bfloat16))
    hlo = lower_for_h200(moe_experts, *args)
    assert hlo.count("__gpu$xla.gpu.triton") == 3  # expert sort, grouped SwiGLU, grouped down
    # Nothing between the kernels but the combine: no XLA gather, scatter, sort, pad or concatenate.
    for op in ("gather", "scatter", "sort", "pad", "concatenate", "dynamic_slice", "while"):
        assert f"stablehlo.{op}" not in hlo, op


def test_empty_slots_contribute_nothing():
    """id == E marks an empty row (expert parallelism's padding): the same as leaving it out."""
    x, weights, ids, *experts = _layer(4, 13, 8, 3, 32, 48, jnp.float32)
    empty = np.zeros(ids.shape, bool)
    empty[::3, 1] = empty[5] = True  # some single slots, and one token with no expert at all
    ids_with_empty = jnp.where(empty, 8, ids)
    expected = moe_experts_reference(x, jnp.where(empty, 0.0, weights), ids, *experts)
    out, ref = run_fast(lambda *a: (moe_experts(*a, swiglu_config=SMALL_TILES, down_config=SMALL_TILES,
                                                interpret=True), moe_experts_reference(*a)),
                        x, weights, ids_with_empty, *experts)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[5], 0.0)


def test_stacked_layers_read_in_place():
    """layer (traced) picks that layer's experts out of weights stacked [L, E, ...]."""
    x, weights, ids, *experts = _layer(6, 11, 8, 2, 32, 48, jnp.float32)
    stacked = [jnp.stack([w[::-1], w]) for w in experts]  # layer 0: experts reversed; layer 1: as given
    out, ref = run_fast(lambda x, w, i, layer, stacked, experts: (
        moe_experts(x, w, i, *stacked, layer=layer, swiglu_config=SMALL_TILES, down_config=SMALL_TILES,
                    interpret=True), moe_experts_reference(x, w, i, *experts)),
        x, weights, ids, jnp.int32(1), stacked, experts)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
