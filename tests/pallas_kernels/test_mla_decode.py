"""mla_decode / mla_paged (Pallas, interpret mode on CPU) against their jnp references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_decode import (default_num_splits, mla_decode, mla_decode_reference, mla_paged,
                                       mla_paged_reference, split_range)
from tests.pallas_kernels.kernel_utils import lower_for_h200, relative_error

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_cache(rng, num_pages, block_size, latent_dim, rope_dim, dtype):
    c_kv = jnp.asarray(rng.standard_normal((num_pages, block_size, latent_dim)), dtype)
    k_pe = jnp.asarray(rng.standard_normal((num_pages, block_size, rope_dim)), dtype)
    return c_kv, k_pe


def shuffled_tables(rng, num_rows, width, num_pages):
    """Each row owns distinct pages in random order, so a wrong page lookup changes the result."""
    return jnp.asarray(rng.permutation(num_pages)[:num_rows * width].reshape(num_rows, width), jnp.int32)


def assert_close(out, ref, dtype):
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert np.isfinite(out32).all()
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out32, ref32, rtol=tol, atol=tol)


# Lengths: 1 (one key), multiples and non-multiples of block_size, and the table's full context.
DECODE_CASES = [
    # dtype, H, C, R, block_size, width, lengths, tuning kwargs
    pytest.param(jnp.float32, 4, 64, 16, 4, 8, [1, 13, 32], {}, id="f32-pad-heads-default-splits"),
    pytest.param(jnp.float32, 16, 128, 32, 16, 8, [1, 20, 3, 128], dict(num_splits=8, block_k=16),
                 id="f32-empty-splits"),
    pytest.param(jnp.float32, 16, 64, 16, 4, 10, [40, 7, 1], dict(num_splits=1, block_k=16),
                 id="f32-one-split-4-pages-per-step"),
    pytest.param(jnp.bfloat16, 16, 64, 16, 8, 6, [48, 9, 1, 17, 33], dict(num_splits=2, block_h=8, block_k=8),
                 id="bf16-head-tiles"),
    # The model's cache-free absorbed path pages each whole sequence: any block_size must work.
    pytest.param(jnp.float32, 16, 64, 16, 15, 1, [15, 9], {}, id="f32-block-size-15"),
]


@pytest.mark.parametrize("dtype, num_heads, latent_dim, rope_dim, block_size, width, lengths, kwargs",
                         DECODE_CASES)
def test_mla_decode_matches_reference(dtype, num_heads, latent_dim, rope_dim, block_size, width, lengths,
                                      kwargs):
    rng = np.random.default_rng(len(lengths) * 1000 + latent_dim)
    batch = len(lengths)
    num_pages = batch * width + 3
    c_kv, k_pe = make_cache(rng, num_pages, block_size, latent_dim, rope_dim, dtype)
    tables = shuffled_tables(rng, batch, width, num_pages)
    q_latent = jnp.asarray(rng.standard_normal((batch, num_heads, latent_dim)), dtype)
    q_pe = jnp.asarray(rng.standard_normal((batch, num_heads, rope_dim)), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    scale = (latent_dim + rope_dim) ** -0.5

    out = mla_decode(q_latent, q_pe, c_kv, k_pe, tables, lengths, scale, interpret=True, **kwargs)
    ref = mla_decode_reference(q_latent, q_pe, c_kv, k_pe, tables, lengths, scale)
    assert_close(out, ref, dtype)


def test_mla_paged_mixed_batch():
    """Decode tokens of two sequences, a prefill chunk of a third (positions 5..10 over a cached
    prefix) and a padding token, against the reference; a negative position gives zeros."""
    rng = np.random.default_rng(7)
    num_heads, latent_dim, rope_dim, block_size, width = 4, 64, 16, 4, 6
    num_pages = 3 * width + 2
    c_kv, k_pe = make_cache(rng, num_pages, block_size, latent_dim, rope_dim, jnp.float32)
    tables = shuffled_tables(rng, 3, width, num_pages)
    seq_ids = jnp.asarray([1, 0, 2, 2, 2, 2, 2, 2, 0], jnp.int32)
    positions = jnp.asarray([22, 3, 5, 6, 7, 8, 9, 10, 0], jnp.int32)  # last: padding at position 0
    num_tokens = len(seq_ids)
    q_latent = jnp.asarray(rng.standard_normal((num_tokens, num_heads, latent_dim)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((num_tokens, num_heads, rope_dim)), jnp.float32)
    scale = 0.1

    out = mla_paged(q_latent, q_pe, c_kv, k_pe, tables, seq_ids, positions, scale, block_k=8,
                    interpret=True)
    ref = mla_paged_reference(q_latent, q_pe, c_kv, k_pe, tables, seq_ids, positions, scale)
    assert_close(out, ref, jnp.float32)

    empty = mla_paged(q_latent, q_pe, c_kv, k_pe, tables, seq_ids, positions.at[-1].set(-1), scale,
                      block_k=8, interpret=True)
    np.testing.assert_array_equal(np.asarray(empty[-1]), 0.0)
    np.testing.assert_allclose(np.asarray(empty[:-1]), np.asarray(ref[:-1]), rtol=1e-5, atol=1e-5)


def test_mla_paged_layer_local_tables():
    """Tables of one layer's page ids over every layer's pages (``layer_pages``): the kernel shifts the
    ids to layer 1's, matching the reference on that layer's slice."""
    rng = np.random.default_rng(8)
    num_heads, latent_dim, rope_dim, block_size, width, layers = 4, 64, 16, 4, 3, 2
    num_pages = 2 * width
    c_kv, k_pe = make_cache(rng, layers * num_pages, block_size, latent_dim, rope_dim, jnp.float32)
    tables = shuffled_tables(rng, 2, width, num_pages)
    seq_ids, positions = jnp.asarray([0, 1], jnp.int32), jnp.asarray([9, 4], jnp.int32)
    q_latent = jnp.asarray(rng.standard_normal((2, num_heads, latent_dim)), jnp.float32)
    q_pe = jnp.asarray(rng.standard_normal((2, num_heads, rope_dim)), jnp.float32)

    out = mla_paged(q_latent, q_pe, c_kv, k_pe, tables, seq_ids, positions, 0.1, layer=jnp.int32(1),
                    layer_pages=num_pages, block_k=8, interpret=True)
    ref = mla_paged_reference(q_latent, q_pe, c_kv[num_pages:], k_pe[num_pages:], tables, seq_ids, positions, 0.1)
    assert_close(out, ref, jnp.float32)


@pytest.mark.parametrize("length", [1, 9, 129, 500, 4096])
def test_split_ranges_cut_each_context_evenly(length):
    """The splits tile [0, length) in order, each a whole number of 32-key iterations but the last busy
    one, and no busy split is longer than the context's fair share rounded up to an iteration."""
    ranges = [split_range(length, s, 8, 32) for s in range(8)]
    busy = [(a, b) for a, b in ranges if b > a]
    assert busy[0][0] == 0 and busy[-1][1] == length
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(busy, busy[1:]))
    assert all((b - a) % 32 == 0 for a, b in busy[:-1])
    assert max(b - a for a, b in busy) == -(-(-(-length // 8)) // 32) * 32 or len(busy) == 1
    if length == 129:  # batch 1 at a 129-token context: five busy programs of one iteration each
        assert len(busy) == 5


def test_default_num_splits_fills_the_gpu():
    # V2-Lite batch 64: 4 splits -> 256 programs; V3 batch 128 already has 1024 head-tile programs.
    assert default_num_splits(64, 16, 4096, block_h=16, block_k=64) == 4
    assert default_num_splits(128, 128, 2048, block_h=32, block_k=64) == 1
    # Batch 1: as many splits as one block_k iteration each allows.
    assert default_num_splits(1, 16, 4096, block_h=16, block_k=64) == 64
    assert default_num_splits(1, 128, 4096, block_h=32, block_k=64) == 64
    assert default_num_splits(1, 16, 64, block_h=16, block_k=64) == 1


def test_decode_blocks_switch_to_latency_blocks_for_one_sequence():
    from pallas_kernels.mla_decode import DECODE_BLOCKS, LATENCY_BLOCKS, decode_blocks

    assert decode_blocks(16, 2, batch=1) == LATENCY_BLOCKS  # batch 1 at V2-Lite: latency-bound
    assert decode_blocks(16, 2, batch=64) == decode_blocks(16, 2) == DECODE_BLOCKS[(2, 1)]
    assert decode_blocks(128, 2, batch=1) == DECODE_BLOCKS[(2, 64)]  # 8 head tiles already
    assert decode_blocks(16, 1, batch=1) == DECODE_BLOCKS[(2, 1)]  # 8-bit caches keep theirs


def test_mla_decode_lowers_to_triton_for_h200():
    """Triton lowering (no GPU needed): catches non-power-of-two shapes and unsupported ops in CI."""
    batch, num_heads, latent_dim, rope_dim, block_size, width = 8, 128, 512, 64, 64, 16
    shape = jax.ShapeDtypeStruct
    args = (shape((batch, num_heads, latent_dim), jnp.bfloat16), shape((batch, num_heads, rope_dim), jnp.bfloat16),
            shape((100, block_size, latent_dim), jnp.bfloat16), shape((100, block_size, rope_dim), jnp.bfloat16),
            shape((batch, width), jnp.int32), shape((batch,), jnp.int32))
    for num_splits in (1, 4):
        hlo = lower_for_h200(lambda *a: mla_decode(*a, 0.07, num_splits=num_splits), *args)
        assert hlo.count("__gpu$xla.gpu.triton") == (1 if num_splits == 1 else 2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_mosaic_decode_lowers_for_hopper(num_splits):
    """The Mosaic GPU kernel's Pallas lowering (layouts, wgmma operands, shared-memory budget) runs
    without a GPU; numerics in interpret mode (below) and on the GPU (tests/gpu)."""
    from pallas_kernels.mla_decode_mgpu import mla_decode_mgpu

    tokens, heads, width = 4, 128, 16
    shape = jax.ShapeDtypeStruct
    args = (shape((tokens, heads, 512), jnp.bfloat16), shape((tokens, heads, 64), jnp.bfloat16),
            shape((100, 128, 512), jnp.bfloat16), shape((100, 128, 64), jnp.bfloat16),
            shape((tokens, width), jnp.int32), shape((tokens,), jnp.int32), shape((tokens,), jnp.int32))
    fn = lambda *a: mla_decode_mgpu(*a, 0.07, num_splits=num_splits, tokens_per_split=width * 128 // num_splits)
    hlo = lower_for_h200(fn, *args)
    assert hlo.count("custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("kind, num_splits", [("int8", 1), ("fp8", 4)])
def test_mosaic_decode_lowers_for_hopper_8bit_many_heads(kind, num_splits):
    """The many-head Mosaic kernel over an 8-bit cache (the memory warpgroup loading 8-bit rows from HBM
    into registers and converting them into the 16-bit ring, the scales' ring, q_pe read into registers)
    lowers and fits shared memory; numerics in interpret mode (below) and in tests/gpu."""
    from pallas_kernels.mla_decode_mgpu import mla_decode_mgpu

    args = _8bit_args(kind, heads=128)
    fn = lambda *a: mla_decode_mgpu(*a[:4], *a[5:], 0.07, c_kv_scale=a[4], num_splits=num_splits,
                                    tokens_per_split=16 * 64 // num_splits)
    hlo = lower_for_h200(fn, *args)
    assert hlo.count("custom_call @mosaic_gpu") == 1
    with pytest.raises(ValueError, match="a int8 cache takes c_kv_scale"):
        jax.eval_shape(lambda *a: mla_decode_mgpu(*a[:4], *a[5:], 0.07, num_splits=1, tokens_per_split=1024),
                       *_8bit_args("int8", heads=128))


def test_mosaic_decode_supports_8bit(monkeypatch):
    from pallas_kernels import mla_decode_mgpu as kernel

    monkeypatch.setattr(kernel, "why_not_hopper", lambda: None)
    for dtype in (jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn):
        assert kernel.supports(128, 512, 64, 64, dtype) is None
    assert "scale groups" in kernel.supports(128, 512, 64, 64, jnp.float8_e4m3fn, 4)
    assert "float32 is not one of" in kernel.supports(128, 512, 64, 64, jnp.float32)


def test_mosaic_why_not_picks_the_kernel_by_heads(monkeypatch):
    """8-bit caches: heads a multiple of 64 go to mla_decode_mgpu, fewer to mla_decode_8bit_mgpu."""
    from pallas_kernels import mla_decode_8bit_mgpu, mla_decode_mgpu
    from pallas_kernels.mla_decode import mosaic_why_not

    for module in (mla_decode_mgpu, mla_decode_8bit_mgpu):
        monkeypatch.setattr(module, "why_not_hopper", lambda: None)
    assert mosaic_why_not(128, 512, 64, 64, jnp.int8) is None
    assert mosaic_why_not(16, 512, 64, 64, jnp.float8_e4m3fn) is None
    assert "num_heads=96" in mosaic_why_not(96, 512, 64, 64, jnp.int8)  # the few-head kernel's limit
    assert "num_heads=16" in mosaic_why_not(16, 512, 64, 64, jnp.bfloat16)  # bf16: the many-head kernel only
    assert "scale groups" in mosaic_why_not(128, 512, 64, 64, jnp.int8, 4)


def _8bit_args(kind, heads=16, tokens=4, width=16):
    shape = jax.ShapeDtypeStruct
    dtype = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
    return (shape((tokens, heads, 512), jnp.bfloat16), shape((tokens, heads, 64), jnp.bfloat16),
            shape((100, 64, 512), dtype), shape((100, 64, 64), jnp.bfloat16), shape((100, 64, 1), jnp.float32),
            shape((tokens, width), jnp.int32), shape((tokens,), jnp.int32), shape((tokens,), jnp.int32))


@pytest.mark.parametrize("kind, num_splits, compute_wgs, defer_sum, release_fence", [
    ("int8", 1, 2, False, False), ("fp8", 4, 2, False, False), ("int8", 4, 4, False, False),
    ("fp8", 1, 1, False, False), ("int8", 2, 2, True, False), ("fp8", 1, 1, True, False), ("int8", 1, 2, True, True)])
def test_mosaic_8bit_decode_lowers_for_hopper(kind, num_splits, compute_wgs, defer_sum, release_fence):
    """The 8-bit Mosaic GPU kernel's lowering (the upcast layouts, wgmma with A in registers and A read
    transposed, the score parts' exchange, the column softmax, the deferred denominators, the release fence,
    shared memory) runs without a GPU; numerics in interpret mode (below) and in tests/gpu."""
    from pallas_kernels.mla_decode_8bit_mgpu import mla_decode_8bit_mgpu

    fn = lambda *a: mla_decode_8bit_mgpu(*a, 0.07, num_splits=num_splits, compute_wgs=compute_wgs,
                                         defer_sum=defer_sum, release_fence=release_fence)
    hlo = lower_for_h200(fn, *_8bit_args(kind))
    assert hlo.count("custom_call @mosaic_gpu") == 1


def test_mosaic_8bit_decode_refuses_bad_options():
    from pallas_kernels.mla_decode_8bit_mgpu import mla_decode_8bit_mgpu

    for options, message in (({"compute_wgs": 3}, "compute_wgs=3 is not one of"),
                             ({"chunk": 64}, "chunk=64 is not a multiple of 128"),
                             ({"stages": 4}, "stages=4 with compute_wgs=2 and 16 heads needs"),
                             ({"compute_wgs": 4, "heads": 32}, "stages=1 with compute_wgs=4 and 32")):
        heads = options.pop("heads", 16)
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(lambda *a: mla_decode_8bit_mgpu(*a, 0.07, num_splits=2, **options),
                           *_8bit_args("int8", heads))


def test_mosaic_8bit_decode_supports(monkeypatch):
    from pallas_kernels import mla_decode_8bit_mgpu as kernel

    assert kernel.supports(16, 512, 64, 64, jnp.int8, 1) is not None  # no GPU here
    monkeypatch.setattr(kernel, "why_not_hopper", lambda: None)
    assert kernel.supports(16, 512, 64, 64, jnp.int8, 1) is None
    assert kernel.supports(32, 512, 64, 128, jnp.float8_e4m3fn, 1) is None
    assert "scale groups" in kernel.supports(16, 512, 64, 64, jnp.int8, 4)
    assert "num_heads=128" in kernel.supports(128, 512, 64, 64, jnp.int8, 1)
    assert "num_heads=8" in kernel.supports(8, 512, 64, 64, jnp.int8, 1)
    assert "block_size=16" in kernel.supports(16, 512, 64, 16, jnp.int8, 1)
    assert "bfloat16" in kernel.supports(16, 512, 64, 64, jnp.bfloat16, 1)


def test_mosaic_decode_refuses_what_it_cannot_run():
    from pallas_kernels import mla_decode_mgpu

    assert mla_decode_mgpu.supports(128, 512, 64, 64, jnp.bfloat16) is not None  # no GPU here
    q = jnp.zeros((1, 64, 512), jnp.bfloat16)
    cache = jnp.zeros((2, 64, 512), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16)
    args = (q, q[..., :64], *cache, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), 0.1)
    with pytest.raises(ValueError, match="impl='mosaic' cannot run here"):
        mla_decode(*args, impl="mosaic")
    with pytest.raises(ValueError, match="accepted: auto, triton, mosaic"):
        mla_decode(*args, impl="cuda")


def _interpreted_case(rng, heads, kind):
    """Two queries (contexts of 130 tokens over 3 shuffled 64-token pages, and of 1 token) at V2/V3's
    latent and rope widths -> kernel inputs (an 8-bit cache with its per-token scales) and the reference."""
    from pallas_kernels.kv_quant import quantize_latent

    c_kv, k_pe = make_cache(rng, 8, 64, 512, 64, jnp.bfloat16)
    tables = shuffled_tables(rng, 2, 3, 8)
    q_latent = jnp.asarray(rng.standard_normal((2, heads, 512)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((2, heads, 64)), jnp.bfloat16)
    seq_ids, lengths = jnp.arange(2, dtype=jnp.int32), jnp.asarray([130, 1], jnp.int32)
    scale = None
    if kind is not None:
        c_kv, scale = quantize_latent(c_kv * 3.0, kind, 1)
    f32 = lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
    want = mla_paged_reference(f32(q_latent), f32(q_pe), f32(c_kv), f32(k_pe), tables, seq_ids, lengths - 1, 0.1,
                               scale)
    return (q_latent, q_pe, c_kv, k_pe, tables, seq_ids, lengths), scale, want


@pytest.mark.parametrize("kind", [None, "int8", "fp8"])
def test_mosaic_decode_interpreted_matches_reference(kind):
    """mla_decode_mgpu run on the CPU by the GPU interpret mode (``pallas_kernels.mgpu_interpret``: the
    warpgroups as threads, TMA, barriers and wgmma simulated) over a bf16, int8 and fp8 cache, with one
    split and with partials merged by combine_splits; no data race between its warpgroups and TMA."""
    from pallas_kernels import mgpu_interpret
    from pallas_kernels.mla_decode import combine_splits
    from pallas_kernels.mla_decode_mgpu import mla_decode_mgpu

    args, c_kv_scale, want = _interpreted_case(np.random.default_rng(31), 64, kind)
    for splits in (1, 3):
        out = mla_decode_mgpu(*args, 0.1, num_splits=splits, tokens_per_split=192 // splits, c_kv_scale=c_kv_scale,
                              interpret=True)
        assert not mgpu_interpret.races_found()
        if splits > 1:
            out = combine_splits(*out, jnp.float32, splits_axis=1, interpret=True)
        assert relative_error(out, want) < 1e-2, splits


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_mosaic_8bit_decode_interpreted_matches_reference(kind):
    """mla_decode_8bit_mgpu in the GPU interpret mode: 1, 2 and 4 compute warpgroups (each converting its
    share of the latent columns, the score parts exchanged), the scale on the scores or on the converted
    rows, the denominators summed after the loop or every step, one split and partials (3 steps over 2 ring
    slots: a slot is reloaded). With the release fence (``RELEASE_FENCE``, as built) no data race; without
    it the race detection flags the reload of a slot the compute warpgroups read by plain loads, which
    shows that it watches the ring (the no-race checks are not vacuous)."""
    from pallas_kernels import mgpu_interpret
    from pallas_kernels.mla_decode import combine_splits
    from pallas_kernels.mla_decode_8bit_mgpu import mla_decode_8bit_mgpu

    (q_latent, q_pe, c_kv, k_pe, *rest), c_kv_scale, want = _interpreted_case(np.random.default_rng(32), 16, kind)
    for dequantize, compute_wgs, defer_sum, splits, fence in [
            (False, 2, True, 1, False), (False, 2, True, 1, True), (False, 2, True, 2, True), (True, 1, True, 1, True),
            (False, 4, True, 1, True), (False, 2, False, 1, True)]:
        out = mla_decode_8bit_mgpu(q_latent, q_pe, c_kv, k_pe, c_kv_scale, *rest, 0.1, num_splits=splits,
                                   dequantize=dequantize, compute_wgs=compute_wgs, defer_sum=defer_sum,
                                   release_fence=fence, interpret=True)
        reloads = splits == 1 and compute_wgs > 1  # 1 warpgroup: 3 stages fit, no slot is reloaded
        assert mgpu_interpret.races_found() == (reloads and not fence), (compute_wgs, splits, fence)
        if splits > 1:
            m, l, acc = out
            out = combine_splits(m, l, acc.swapaxes(2, 3), jnp.float32, splits_axis=1, interpret=True).swapaxes(1, 2)
        assert relative_error(out.swapaxes(1, 2), want) < 1e-2, (dequantize, compute_wgs, defer_sum, splits)


@pytest.mark.parametrize("kind, heads", [(None, 64), ("int8", 16)])
def test_mla_paged_mosaic_interpreted(kind, heads):
    """mla_paged with impl="mosaic" in interpret mode: the Mosaic kernels behind the wrapper (the page ids
    offset to layer 1's pages, lengths from positions, the default splits and their merge; 8-bit caches
    with few heads through mla_decode_8bit_mgpu, its output transposed back): several queries of one
    sequence at different positions and a padding query (-1: zeros), against the reference."""
    from pallas_kernels.kv_quant import quantize_latent

    rng = np.random.default_rng(heads)
    pages = 6
    c_kv, k_pe = make_cache(rng, 2 * pages, 64, 512, 64, jnp.bfloat16)  # two layers' pages
    c_kv_scale = None
    if kind is not None:
        c_kv, c_kv_scale = quantize_latent(c_kv * 3.0, kind, 1)
    tables = shuffled_tables(rng, 2, 3, pages)
    seq_ids = jnp.asarray([0, 0, 1, 0], jnp.int32)
    positions = jnp.asarray([150, 3, 64, -1], jnp.int32)
    q_latent = jnp.asarray(rng.standard_normal((4, heads, 512)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((4, heads, 64)), jnp.bfloat16)
    got = mla_paged(q_latent, q_pe, c_kv, k_pe, tables, seq_ids, positions, 0.1, c_kv_scale=c_kv_scale,
                    layer=jnp.int32(1), layer_pages=pages, impl="mosaic", interpret=True)
    f32 = lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
    layer_1 = slice(pages, 2 * pages)
    want = mla_paged_reference(f32(q_latent), f32(q_pe), f32(c_kv[layer_1]), f32(k_pe[layer_1]), tables, seq_ids,
                               positions, 0.1, None if c_kv_scale is None else c_kv_scale[layer_1])
    assert got.shape == (4, heads, 512) and got.dtype == jnp.bfloat16
    assert not np.asarray(got[3], np.float32).any()  # padding: zeros
    assert relative_error(got[:3], want[:3]) < 1e-2
