"""Grouped expert GEMMs (interpret mode) against their per-expert references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_swiglu import (grouped_matmul, grouped_matmul_reference, grouped_swiglu,
                                           grouped_swiglu_reference, tile_schedule)
from tests.pallas_kernels.kernel_utils import lower_for_h200, run_fast

BLOCKS = dict(block_m=16, block_n=32, block_k=32)  # small tiles: several per expert and per dim


def _normal(rng, *shape, dtype=jnp.float32, fan_in=1):
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), dtype)


def _close(out, ref, tol):
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)


def test_tile_schedule_exact():
    # Experts: 0 rows, 20 rows (2 tiles of 16), 16 rows (1 tile), 0, 3 rows (1 tile).
    schedule = tile_schedule(jnp.array([0, 20, 16, 0, 3]), num_rows=39, block_m=16)
    num_tiles = (39 + 5 * 15) // 16  # static worst case
    expected = np.zeros((3, num_tiles), np.int32)  # unused tiles: (0, 0, 0)
    expected[:, :4] = [[1, 1, 2, 4], [0, 16, 20, 36], [20, 20, 36, 39]]
    np.testing.assert_array_equal(schedule, expected)


def test_tile_schedule_rows_past_the_groups_and_a_last_empty_expert():
    # 7 of 40 rows in groups (the rest unused, as under expert-parallel padding); the last expert empty.
    schedule = tile_schedule(jnp.array([0, 5, 2, 0]), num_rows=40, block_m=4)
    expected = np.zeros((3, (40 + 4 * 3) // 4), np.int32)
    expected[:, :3] = [[1, 1, 2], [0, 4, 5], [5, 5, 7]]  # ends are the expert's end
    np.testing.assert_array_equal(schedule, expected)


@pytest.mark.parametrize("groups", [
    pytest.param([9, 0, 33, 1, 0, 21], id="uneven_with_empty"),
    pytest.param([0, 0, 64, 0, 0, 0], id="one_expert_holds_all"),
    pytest.param([0, 0, 0, 0, 0, 5], id="all_empty_but_last"),
])
def test_grouped_swiglu_f32(groups):
    rng = np.random.default_rng(sum(groups))
    depth, width = 64, 48  # width 48: a partial N tile
    x = _normal(rng, sum(groups), depth)
    w_gate, w_up = (_normal(rng, len(groups), depth, width, fan_in=depth) for _ in range(2))
    out, ref = run_fast(lambda *a: (grouped_swiglu(*a, **BLOCKS, interpret=True),
                                grouped_swiglu_reference(*a)),
                    x, jnp.array(groups, jnp.int32), w_gate, w_up)
    _close(out, ref, 1e-5)


def test_grouped_swiglu_bf16_gathered_rows_and_partial_k():
    rng = np.random.default_rng(7)
    groups, top_k = [5, 0, 17, 30], 3
    num_rows, num_tokens, depth, width = sum(groups) + 4, 13, 48, 32  # 4 trailing unused rows
    x = _normal(rng, num_tokens, depth, dtype=jnp.bfloat16)
    order = jnp.asarray(rng.integers(0, num_tokens * top_k, num_rows), jnp.int32)  # assignments
    w_gate, w_up = (_normal(rng, len(groups), depth, width, dtype=jnp.bfloat16, fan_in=depth)
                    for _ in range(2))
    out, ref = run_fast(lambda x, o, g, wg, wu: (
        grouped_swiglu(x, g, wg, wu, order=o, top_k=top_k, **BLOCKS, interpret=True),
        grouped_swiglu_reference(x[o // top_k], g, wg, wu)),
        x, order, jnp.array(groups, jnp.int32), w_gate, w_up)
    _close(out[:sum(groups)], ref[:sum(groups)], 2e-2)  # rows past the groups are unspecified


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_grouped_matmul_with_row_scale(dtype, tol):
    rng = np.random.default_rng(3)
    groups = [0, 12, 0, 40, 7]
    depth, width = 48, 64  # depth 48: a partial K tile
    h = _normal(rng, sum(groups), depth, dtype=dtype)
    w = _normal(rng, len(groups), depth, width, dtype=dtype, fan_in=depth)
    row_scale = jnp.asarray(rng.uniform(size=sum(groups)), jnp.float32)
    out, ref = run_fast(lambda *a: (grouped_matmul(*a[:3], row_scale=a[3], **BLOCKS, interpret=True),
                                grouped_matmul_reference(*a)),
                    h, jnp.array(groups, jnp.int32), w, row_scale)
    _close(out, ref, tol)


@pytest.mark.parametrize("groups", [
    pytest.param([4, 0, 21, 9, 0], id="uneven_with_empty"),
    pytest.param([0, 0, 0, 33, 0], id="one_expert_holds_all"),
])
def test_grouped_matmul_scatters_back_and_scales_by_output_row(groups):
    """With order, sorted row r lands on output row order[r], scaled by row_scale[order[r]]; output
    rows no group row maps to (the 6 past the groups here) stay unspecified."""
    rng = np.random.default_rng(len(groups) + groups[0])
    num_rows, depth, width = sum(groups) + 6, 48, 64
    h = _normal(rng, num_rows, depth)
    w = _normal(rng, len(groups), depth, width, fan_in=depth)
    order = jnp.asarray(rng.permutation(num_rows), jnp.int32)
    row_scale = jnp.asarray(rng.uniform(size=num_rows), jnp.float32)
    g = jnp.array(groups, jnp.int32)
    out, ref = run_fast(lambda h, g, w, o, s: (
        grouped_matmul(h, g, w, order=o, row_scale=s, **BLOCKS, interpret=True),
        grouped_matmul_reference(h, g, w)), h, g, w, order, row_scale)
    placed = np.asarray(order)[:sum(groups)]
    expected = np.asarray(ref)[:sum(groups)] * np.asarray(row_scale)[placed, None]
    _close(np.asarray(out)[placed], expected, 1e-5)


def test_grouped_kernels_read_stacked_weights_at_an_offset():
    """expert_offset (traced) picks group e's weights at e + offset of a stack of layers' experts."""
    rng = np.random.default_rng(5)
    groups, depth, width = jnp.array([6, 0, 11], jnp.int32), 32, 48
    x = _normal(rng, 17, depth)
    stack = _normal(rng, 2 * 3, depth, width, fan_in=depth)  # 2 layers of 3 experts
    out, ref = run_fast(lambda x, g, w, offset: (
        (grouped_swiglu(x, g, w, w, expert_offset=offset, **BLOCKS, interpret=True),
         grouped_matmul(x, g, w, expert_offset=offset, **BLOCKS, interpret=True)),
        (grouped_swiglu_reference(x, g, w[3:], w[3:]), grouped_matmul_reference(x, g, w[3:]))),
        x, groups, stack, jnp.int32(3))
    for got, want in zip(out, ref):
        _close(got, want, 1e-5)


def test_grouped_matmul_default_tiles_no_scale():
    rng = np.random.default_rng(4)
    groups = [3, 0, 0, 1, 12, 0, 0, 0]  # decode-like: a few rows per expert
    h = _normal(rng, sum(groups), 32)
    w = _normal(rng, len(groups), 32, 64, fan_in=32)
    out, ref = run_fast(lambda *a: (grouped_matmul(*a, interpret=True), grouped_matmul_reference(*a)),
                    h, jnp.array(groups, jnp.int32), w)
    _close(out, ref, 1e-5)


def test_group_sizes_shape_is_checked():
    with pytest.raises(ValueError, match=r"group_sizes has shape \(3,\); expected \(4,\)"):
        grouped_swiglu(jnp.zeros((8, 16)), jnp.zeros((3,), jnp.int32), jnp.zeros((4, 16, 16)),
                       jnp.zeros((4, 16, 16)), interpret=True)


@pytest.mark.parametrize("num_rows", [48, 49152], ids=["decode", "prefill"])
def test_grouped_kernels_lower_to_triton_for_h200(num_rows):
    num_experts, hidden, inter = 64, 2048, 1408  # V2-Lite experts; 1408 = 5.5 tiles of 256
    shape = jax.ShapeDtypeStruct
    groups = shape((num_experts,), jnp.int32)
    w_in = shape((num_experts, hidden, inter), jnp.bfloat16)
    w_out = shape((num_experts, inter, hidden), jnp.bfloat16)
    x, h = shape((num_rows, hidden), jnp.bfloat16), shape((num_rows, inter), jnp.bfloat16)
    scale = shape((num_rows,), jnp.float32)

    order = shape((num_rows,), jnp.int32)

    def each(x, groups, w_gate, w_up, w_down, h, scale, order):
        return (grouped_swiglu(x, groups, w_gate, w_up),
                grouped_swiglu(x, groups, w_gate, w_up, block_n=256),
                grouped_swiglu(x[:8], groups, w_gate, w_up, order=order, top_k=6, expert_offset=0),
                grouped_matmul(h, groups, w_down, row_scale=scale),
                grouped_matmul(h, groups, w_down, order=order, row_scale=scale))

    hlo = lower_for_h200(each, x, groups, w_in, w_in, w_out, h, scale, order)
    assert hlo.count("__gpu$xla.gpu.triton") == 5
