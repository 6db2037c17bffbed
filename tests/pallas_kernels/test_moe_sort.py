"""Expert sort kernel (interpret mode) against the stable argsort reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_sort import sort_by_expert, sort_by_expert_reference
from tests.pallas_kernels.kernel_utils import lower_for_h200, run_fast


def _sorts(ids, num_experts, chunk=None):
    return run_fast(lambda i: (sort_by_expert(i, num_experts, chunk=chunk, interpret=True),
                               sort_by_expert_reference(i, num_experts)), ids)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,chunk", [
    (1, 1, 4, None),
    (300, 6, 64, None),  # one chunk
    (300, 6, 64, 256),  # 8 chunks: two passes over the ids
], ids=["one_row", "one_chunk", "chunks"])
def test_sort_by_expert_exact(num_tokens, top_k, num_experts, chunk):
    rng = np.random.default_rng(num_tokens)
    ids = jnp.asarray(np.argsort(rng.uniform(size=(num_tokens, num_experts)), axis=1)[:, :top_k],
                      jnp.int32)  # k distinct experts per token
    (order, group_sizes), (ref_order, ref_sizes) = _sorts(ids, num_experts, chunk)
    np.testing.assert_array_equal(order, ref_order)
    np.testing.assert_array_equal(group_sizes, ref_sizes)


def test_sort_by_expert_one_hot_expert_and_empty_experts():
    ids = jnp.asarray(np.stack([np.full(200, 3), np.arange(200) % 2], axis=1), jnp.int32)
    (order, group_sizes), (ref_order, ref_sizes) = _sorts(ids, 8, chunk=64)
    np.testing.assert_array_equal(order, ref_order)
    np.testing.assert_array_equal(group_sizes, [100, 100, 0, 200, 0, 0, 0, 0])
    np.testing.assert_array_equal(group_sizes, ref_sizes)


def test_sort_by_expert_skewed_with_repeats_in_a_token():
    """Any ids in [0, E): a token may name an expert twice; ranks stay stable across chunks."""
    rng = np.random.default_rng(3)
    ids = jnp.asarray(np.minimum(rng.geometric(0.4, size=(45, 5)) - 1, 9), jnp.int32)
    (order, group_sizes), (ref_order, ref_sizes) = _sorts(ids, 12, chunk=32)
    np.testing.assert_array_equal(order, ref_order)
    np.testing.assert_array_equal(group_sizes, ref_sizes)
    assert group_sizes[10:].sum() == 0 and group_sizes[0] > 50


def test_sort_by_expert_leaves_empty_slots_out():
    """id == E marks an empty slot: in no group, so the real rows are the reference's first ones."""
    rng = np.random.default_rng(4)
    ids = np.argsort(rng.uniform(size=(40, 8)), axis=1)[:, :3]
    ids[::4, 1] = ids[7] = 8
    (order, group_sizes), (ref_order, ref_sizes) = _sorts(jnp.asarray(ids, jnp.int32), 8)
    _, ref_sizes_with_empty = sort_by_expert_reference(jnp.asarray(ids), 9)
    np.testing.assert_array_equal(group_sizes, ref_sizes_with_empty[:8])
    placed = int(group_sizes.sum())
    np.testing.assert_array_equal(order[:placed], ref_order[:placed])


@pytest.mark.parametrize("num_tokens", [256, 8192])  # one chunk; a loop over chunks
def test_sort_lowers_to_triton_for_h200(num_tokens):
    hlo = lower_for_h200(lambda ids: sort_by_expert(ids, 64),
                         jax.ShapeDtypeStruct((num_tokens, 6), jnp.int32))
    assert hlo.count("__gpu$xla.gpu.triton") == 1
