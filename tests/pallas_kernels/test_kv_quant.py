"""8-bit latent cache: quantize/dequantize round-trip bounds, and the paged MLA kernel (interpret mode)
reading int8 / fp8 caches against the reference, which dequantizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_quant import QUANT_DTYPES, dequantize_latent, num_scale_groups, quantize_latent
from pallas_kernels.mla_decode import mla_decode, mla_decode_reference, mla_paged, mla_paged_reference
from tests.pallas_kernels.kernel_utils import lower_for_h200
from tests.pallas_kernels.test_mla_decode import shuffled_tables


@pytest.mark.parametrize("kind", sorted(QUANT_DTYPES))
@pytest.mark.parametrize("num_groups", [1, 4])
def test_round_trip_error_is_bounded_per_group(kind, num_groups):
    rng = np.random.default_rng(0)
    # Rows of very different magnitudes (scales are per token and group), a zero row, a one-hot row.
    x = rng.standard_normal((6, 512)) * np.array([1e-3, 1, 30, 1, 1, 1])[:, None]
    x[3] = 0.0
    x[4] = 0.0
    x[4, 17] = -5.0
    stored, scale = quantize_latent(jnp.asarray(x, jnp.float32), kind, num_groups)
    assert stored.dtype == QUANT_DTYPES[kind][0] and scale.shape == (6, num_groups) and scale.dtype == jnp.float32
    back = np.asarray(dequantize_latent(stored, scale))
    amax = np.abs(x.reshape(6, num_groups, -1)).max(-1, keepdims=True)
    err = np.abs(back - x).reshape(6, num_groups, -1)
    if kind == "int8":  # uniform grid: half a step of amax/127
        assert (err <= amax / 127 / 2 * (1 + 1e-5) + 1e-12).all()
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 of the value (normal range) + subnormal step
        bound = np.abs(x.reshape(6, num_groups, -1)) * 2.0 ** -4 + amax / 448 * 2.0 ** -9
        assert (err <= bound * (1 + 1e-5) + 1e-12).all()
    np.testing.assert_array_equal(back[3], 0.0)
    assert back[4, 17] == -5.0 and np.count_nonzero(back[4]) == 1  # the absmax itself is exact


def test_group_size_must_divide_the_latent():
    assert num_scale_groups(512, None) == 1 and num_scale_groups(512, 128) == 4
    with pytest.raises(ValueError, match="kv_cache_group_size=96 must divide kv_lora_rank=512"):
        num_scale_groups(512, 96)
    with pytest.raises(ValueError, match="accepted: int8, fp8"):
        quantize_latent(jnp.zeros((2, 8)), "int4")


def quantized_cache(rng, num_pages, block_size, latent_dim, rope_dim, kind, num_groups):
    c_kv = jnp.asarray(rng.standard_normal((num_pages, block_size, latent_dim)), jnp.float32)
    stored, scale = quantize_latent(c_kv, kind, num_groups)
    k_pe = jnp.asarray(rng.standard_normal((num_pages, block_size, rope_dim)), jnp.float32)
    return stored, scale, k_pe


@pytest.mark.parametrize("kind, num_groups, kwargs", [
    ("int8", 1, dict(num_splits=2, block_k=8)),
    ("fp8", 2, dict(num_splits=1, block_k=8)),
    ("int8", 4, dict(num_splits=4, block_k=4, block_h=8)),
    # byte pairs: the rows read as 16-bit pairs, even and odd columns apart
    ("int8", 1, dict(num_splits=2, block_k=8, paired=True)),
    ("fp8", 2, dict(num_splits=1, block_k=8, paired=True)),
    ("int8", 4, dict(num_splits=4, block_k=4, block_h=8, paired=True)),
])
def test_mla_decode_reads_quantized_cache_like_the_reference(kind, num_groups, kwargs):
    rng = np.random.default_rng(num_groups)
    num_heads, latent_dim, rope_dim, block_size, width = 8, 64, 16, 4, 6
    lengths = [1, 13, 24, 7]
    batch = len(lengths)
    num_pages = batch * width + 2
    stored, scale, k_pe = quantized_cache(rng, num_pages, block_size, latent_dim, rope_dim, kind, num_groups)
    tables = shuffled_tables(rng, batch, width, num_pages)
    q_latent = jnp.asarray(rng.standard_normal((batch, num_heads, latent_dim)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((batch, num_heads, rope_dim)), jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    out = mla_decode(q_latent, q_pe, stored, k_pe, tables, lengths, 0.1, c_kv_scale=scale, interpret=True, **kwargs)
    ref = mla_decode_reference(q_latent, q_pe, stored, k_pe, tables, lengths, 0.1, scale)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # The reference itself is attention over the dequantized cache.
    dense = mla_decode_reference(q_latent, q_pe, dequantize_latent(stored, scale), k_pe, tables, lengths, 0.1)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("paired", [False, True])
def test_bf16_queries_take_their_dot_dtype(kind, paired):
    """bf16 queries over an 8-bit cache: fp8 rows go into float16 dots by default (one conversion
    instruction on Hopper), int8 rows into bf16 ones; either way within bf16 rounding of the reference,
    and the default equals the explicit choice."""
    rng = np.random.default_rng(11)
    num_heads, latent_dim, rope_dim, block_size, width = 16, 64, 16, 4, 4
    stored, scale, k_pe = quantized_cache(rng, 2 * width, block_size, latent_dim, rope_dim, kind, 1)
    k_pe = k_pe.astype(jnp.bfloat16)
    tables = shuffled_tables(rng, 2, width, 2 * width)
    q_latent = jnp.asarray(rng.standard_normal((2, num_heads, latent_dim)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((2, num_heads, rope_dim)), jnp.bfloat16)
    lengths = jnp.asarray([16, 9], jnp.int32)
    run = lambda **kw: mla_decode(q_latent, q_pe, stored, k_pe, tables, lengths, 0.1, c_kv_scale=scale, block_k=8,
                                  paired=paired, interpret=True, **kw)
    out = run()
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(run(dot_dtype="float16" if kind == "fp8" else "bfloat16"), np.float32))
    ref = mla_decode_reference(q_latent, q_pe, stored, k_pe, tables, lengths, 0.1, scale)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)


def test_mla_paged_quantized_mixed_batch_and_padding():
    rng = np.random.default_rng(3)
    num_heads, latent_dim, rope_dim, block_size, width = 4, 64, 16, 4, 6
    num_pages = 3 * width + 2
    stored, scale, k_pe = quantized_cache(rng, num_pages, block_size, latent_dim, rope_dim, "fp8", 1)
    tables = shuffled_tables(rng, 3, width, num_pages)
    seq_ids = jnp.asarray([1, 0, 2, 2, 2, 0], jnp.int32)
    positions = jnp.asarray([22, 3, 5, 6, 7, -1], jnp.int32)  # last: padding
    q_latent = jnp.asarray(rng.standard_normal((6, num_heads, latent_dim)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((6, num_heads, rope_dim)), jnp.float32)
    out = mla_paged(q_latent, q_pe, stored, k_pe, tables, seq_ids, positions, 0.1, c_kv_scale=scale, block_k=8,
                    interpret=True)
    ref = mla_paged_reference(q_latent, q_pe, stored, k_pe, tables, seq_ids, positions.at[-1].set(0), 0.1, scale)
    np.testing.assert_allclose(np.asarray(out[:-1]), np.asarray(ref[:-1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[-1]), 0.0)


def test_paired_reads_need_one_8bit_pool():
    q, c_kv = jnp.zeros((1, 4, 64)), jnp.zeros((4, 4, 64))
    with pytest.raises(ValueError, match="paired=True reads an 8-bit cache in one pool"):
        mla_decode(q, jnp.zeros((1, 4, 16)), c_kv, jnp.zeros((4, 4, 16)), jnp.zeros((1, 2), jnp.int32),
                   jnp.ones((1,), jnp.int32), 0.1, paired=True, interpret=True)


def test_an_8bit_cache_without_scales_is_refused():
    c_kv = jnp.zeros((4, 4, 64), jnp.int8)
    with pytest.raises(ValueError, match="needs its c_kv_scale"):
        mla_decode(jnp.zeros((1, 4, 64)), jnp.zeros((1, 4, 16)), c_kv, jnp.zeros((4, 4, 16)),
                   jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), 0.1, interpret=True)


@pytest.mark.parametrize("kind, num_groups, paired", [("int8", 1, False), ("fp8", 4, False), ("int8", 1, True),
                                                      ("fp8", 1, True)])
def test_quantized_decode_lowers_to_triton_for_h200(kind, num_groups, paired):
    batch, num_heads, latent_dim, rope_dim, block_size, width = 8, 16, 512, 64, 64, 16
    shape = jax.ShapeDtypeStruct
    args = (shape((batch, num_heads, latent_dim), jnp.bfloat16), shape((batch, num_heads, rope_dim), jnp.bfloat16),
            shape((100, block_size, latent_dim), QUANT_DTYPES[kind][0]),
            shape((100, block_size, rope_dim), jnp.bfloat16),
            shape((batch, width), jnp.int32), shape((batch,), jnp.int32),
            shape((100, block_size, num_groups), jnp.float32))
    hlo = lower_for_h200(lambda q, qp, c, kp, t, n, s: mla_decode(q, qp, c, kp, t, n, 0.07, c_kv_scale=s,
                                                                   num_splits=4, paired=paired), *args)
    assert hlo.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("kind, num_groups", [("int8", 1), ("fp8", 2)])
def test_mla_paged_two_pools_matches_reference(kind, num_groups):
    """Distance-aware precision: each table mixes compressed (old) and full-precision (recent) blocks,
    read from layer 1 of two-layer pools; the kernel picks each block's pool by its global id."""
    from pallas_kernels.mla_decode import mla_paged_pools_reference

    rng = np.random.default_rng(11)
    layers, num_full, num_comp, block_size, heads, latent, rope = 2, 6, 5, 4, 4, 32, 8
    full = jnp.asarray(rng.standard_normal((layers * num_full, block_size, latent)), jnp.float32)
    comp, comp_scale = quantize_latent(jnp.asarray(rng.standard_normal((layers * num_comp, block_size, latent)),
                                                   jnp.float32), kind, num_groups)
    k_pe = jnp.asarray(rng.standard_normal((layers * (num_full + num_comp), block_size, rope)), jnp.float32)
    # Old blocks compressed (ids >= 6), recent ones full; row 2 all full, row 1 all compressed.
    tables = jnp.asarray([[7, 9, 0, 3], [6, 10, 8, 0], [1, 2, 4, 5]], jnp.int32)
    seq_ids = jnp.asarray([0, 1, 2, 0, 2], jnp.int32)
    positions = jnp.asarray([15, 11, 13, 4, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((5, heads, latent)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((5, heads, rope)), jnp.float32)
    compressed = (comp, comp_scale, jnp.int32(1))
    ref = mla_paged_pools_reference(q, q_pe, full, k_pe, tables, seq_ids, positions, 0.2, compressed,
                                    (num_full, num_comp))
    # each lane reading its own page's pool, or (uniform_pages) each 4-key iteration its one page's pool
    for uniform_pages in (False, True):
        out = mla_paged(q, q_pe, full, k_pe, tables, seq_ids, positions, 0.2, compressed=compressed,
                        pools=(num_full, num_comp), block_k=4, num_splits=2, uniform_pages=uniform_pages,
                        interpret=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="uniform_pages=True reads two pools with pages a multiple of block_k"):
        mla_paged(q, q_pe, full, k_pe, tables, seq_ids, positions, 0.2, compressed=compressed,
                  pools=(num_full, num_comp), block_k=8, uniform_pages=True, interpret=True)
    # Layer 1 really is read: layer 0's pools give something else.
    other = mla_paged_pools_reference(q, q_pe, full, k_pe, tables, seq_ids, positions, 0.2,
                                      (comp, comp_scale, jnp.int32(0)), (num_full, num_comp))
    assert np.abs(np.asarray(other) - np.asarray(ref)).max() > 1e-2


@pytest.mark.parametrize("uniform_pages", [False, True])
def test_two_pool_decode_lowers_to_triton_for_h200(uniform_pages):
    shape = jax.ShapeDtypeStruct
    L, nf, nc, bs, heads = 2, 40, 60, 64, 16
    args = (shape((8, heads, 512), jnp.bfloat16), shape((8, heads, 64), jnp.bfloat16),
            shape((L * nf, bs, 512), jnp.bfloat16), shape((L * (nf + nc), bs, 64), jnp.bfloat16),
            shape((8, 16), jnp.int32), shape((8,), jnp.int32), shape((8,), jnp.int32),
            shape((L * nc, bs, 512), jnp.float8_e4m3fn), shape((L * nc, bs, 1), jnp.float32), shape((), jnp.int32))
    fn = lambda q, qp, c, kp, t, sid, pos, cc, cs, layer: mla_paged(
        q, qp, c, kp, t, sid, pos, 0.07, compressed=(cc, cs, layer), pools=(nf, nc), num_splits=4,
        uniform_pages=uniform_pages)
    assert lower_for_h200(fn, *args).count("__gpu$xla.gpu.triton") == 2
