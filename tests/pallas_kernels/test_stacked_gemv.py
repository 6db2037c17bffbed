"""Stacked decode GEMV (interpret mode) against its reference: one layer of a stacked weight, read in
place, for 1..64 token rows, ragged K and N, several K splits; several weights of mixed dtypes in one
launch, with the RMSNorm of the rows fused in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.model.norms import RMSNorm
from pallas_kernels.stacked_gemv import (MAX_ROWS, default_splits, stacked_gemv, stacked_gemv_reference, stacked_gemvs,
                                         stacked_head_gemv, stacked_head_gemv_reference)
from tests.pallas_kernels.kernel_utils import lower_for_h200, run_fast


@pytest.mark.parametrize("rows, depth, width, splits, dtype, tol", [
    (1, 256, 192, None, jnp.float32, 1e-5),  # default splits: every K block its own program
    (3, 200, 100, 2, jnp.float32, 1e-5),  # K and N not multiples of the blocks
    (16, 128, 64, 4, jnp.float32, 1e-5),  # more splits than K blocks (empty splits)
    (40, 96, 64, 2, jnp.float32, 1e-5),  # rows padded to 64
    (5, 96, 576, None, jnp.bfloat16, 2e-2),
])
def test_stacked_gemv_matches_reference(rows, depth, width, splits, dtype, tol):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
    w = jnp.asarray(rng.standard_normal((3, depth, width)) / np.sqrt(depth), dtype)
    fn = lambda x, w, layer: (stacked_gemv(x, w, layer, num_splits=splits, block_k=32, block_n=64, interpret=True),
                              stacked_gemv_reference(x, w, layer))
    for layer in (0, 2):  # a traced index: the same program reads another layer's slice
        out, ref = run_fast(fn, x, w, jnp.int32(layer))
        assert out.shape == (rows, width) and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref, np.float32), rtol=tol, atol=tol)


def test_stacked_gemv_refuses_bad_shapes():
    w = jnp.zeros((2, 64, 32))
    with pytest.raises(ValueError, match="rows; accepted 1 to 64"):
        stacked_gemv(jnp.zeros((MAX_ROWS + 1, 64)), w, 0, interpret=True)
    with pytest.raises(ValueError, match=r"expected \[L=2, K=48, N\]"):
        stacked_gemv(jnp.zeros((1, 48)), w, 0, interpret=True)
    with pytest.raises(ValueError, match=r"norm needs eps and shape \[L, K=64\]"):
        stacked_gemvs(jnp.zeros((1, 64)), (w,), 0, jnp.ones((2, 32)), eps=1e-6, interpret=True)


@pytest.mark.parametrize("rows, dtype, tol", [(1, jnp.float32, 1e-5), (5, jnp.bfloat16, 2e-2)])
def test_stacked_gemvs_several_weights_and_fused_norm(rows, dtype, tol):
    """A decode step's shapes in small: one launch for the attention's q and kv_a projections, or the
    MoE's f32 router beside the shared experts' gate and up; rows RMS-normalized inside the kernel
    (with a layer's own norm weights) equal RMSNorm then three separate products, and the normed rows
    come back."""
    rng = np.random.default_rng(rows)
    layers, depth = 3, 96
    x = jnp.asarray(rng.standard_normal((rows, depth)) * 3, dtype)
    ws = (jnp.asarray(rng.standard_normal((layers, depth, 8)), jnp.float32),  # the router stays f32
          jnp.asarray(rng.standard_normal((layers, depth, 100)) / np.sqrt(depth), dtype),
          jnp.asarray(rng.standard_normal((layers, depth, 64)) / np.sqrt(depth), dtype))
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal((layers, depth)), dtype)
    rms = RMSNorm(depth, 1e-6, "embed", dtype)
    for layer in (0, 2):
        *products, normed = stacked_gemvs(x, ws, jnp.int32(layer), norm, eps=1e-6, block_k=32, interpret=True)
        rms.weight[...] = norm[layer]
        want = rms(x)
        np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
        for got, w in zip(products, ws):
            assert got.dtype == jnp.float32
            want_product = stacked_gemv_reference(want.astype(w.dtype), w, layer)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want_product), rtol=tol, atol=tol * np.sqrt(depth))
    plain = stacked_gemvs(x, ws[1:], jnp.int32(1), block_k=32, interpret=True)  # without the norm: products only
    assert len(plain) == 2
    np.testing.assert_allclose(np.asarray(plain[1]), np.asarray(stacked_gemv_reference(x, ws[2], 1), np.float32),
                               rtol=tol, atol=tol * np.sqrt(depth))


def test_default_splits_fill_the_gpu():
    # V2-Lite q_proj (2048 -> 3072): 48 column tiles x 8 splits = 384 programs, two waves of 132 SMs
    assert default_splits(2048, 3072, 64, 128) == 8
    assert default_splits(2048, 576, 64, 128) == 16  # kv_a: 9 tiles, K limits the splits to 16
    assert default_splits(128, 8192, 64, 128) == 1


@pytest.mark.parametrize("rows", [1, 64])
def test_stacked_gemv_lowers_to_triton_for_h200(rows):
    shape = jax.ShapeDtypeStruct
    hlo = lower_for_h200(stacked_gemv, shape((rows, 2048), jnp.bfloat16), shape((26, 2048, 3072), jnp.bfloat16),
                         shape((), jnp.int32))
    assert hlo.count("__gpu$xla.gpu.triton") == 1


def test_stacked_gemvs_with_norm_lowers_to_triton_for_h200():
    """The MoE decode launch at V2-Lite shapes: f32 router beside bf16 gate and up, norm fused."""
    shape = jax.ShapeDtypeStruct
    ws = (shape((26, 2048, 64), jnp.float32), shape((26, 2048, 2816), jnp.bfloat16),
          shape((26, 2048, 2816), jnp.bfloat16))
    fn = lambda x, ws, layer, norm: stacked_gemvs(x, ws, layer, norm, eps=1e-6)
    hlo = lower_for_h200(fn, shape((1, 2048), jnp.bfloat16), ws, shape((), jnp.int32), shape((26, 2048), jnp.bfloat16))
    assert hlo.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("contract_rows", [True, False])
@pytest.mark.parametrize("rows, splits", [(1, None), (5, 2), (64, 1)])
def test_stacked_head_gemv_matches_reference(contract_rows, rows, splits):
    """MLA's absorbed per-head products (w_uv contracts the weight's rows, w_uk each head's columns),
    one layer of a stacked [L, R, H, C] read in place; R and C not multiples of the 16-wide tiles."""
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((3, 40, 4, 24)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, 4, 40 if contract_rows else 24)), jnp.float32)
    for layer in (0, 2):
        got = stacked_head_gemv(x, w, jnp.int32(layer), contract_rows=contract_rows, num_splits=splits, block_k=16,
                                block_n=16, interpret=True)
        want = stacked_head_gemv_reference(x, w, layer, contract_rows=contract_rows)
        assert got.shape == want.shape == (rows, 4, 24 if contract_rows else 40)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not match; expected x"):
        stacked_head_gemv(x[..., :7], w, 0, contract_rows=contract_rows, interpret=True)


@pytest.mark.parametrize("splits", [1, 2])
def test_stacked_head_gemv_stores_out_dtype(splits):
    """out_dtype: stored by the kernel itself with one split (no sum, no cast after it), else the splits'
    f32 sum rounded once."""
    rng = np.random.default_rng(9)
    w = jnp.asarray(rng.standard_normal((2, 40, 4, 24)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 4, 24)), jnp.bfloat16)
    got = stacked_head_gemv(x, w, jnp.int32(1), contract_rows=False, num_splits=splits, block_k=16, block_n=16,
                            out_dtype=jnp.bfloat16, interpret=True)
    want = stacked_head_gemv_reference(x, w, 1, contract_rows=False)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)
    jaxpr = jax.make_jaxpr(lambda x, w: stacked_head_gemv(x, w, jnp.int32(1), contract_rows=False, num_splits=splits,
                                                          block_k=16, block_n=16, out_dtype=jnp.bfloat16,
                                                          interpret=True))(x, w)
    assert ("reduce_sum" in str(jaxpr)) == (splits > 1)


@pytest.mark.parametrize("contract_rows", [True, False])
def test_stacked_head_gemv_lowers_to_triton_for_h200(contract_rows):
    shape = jax.ShapeDtypeStruct
    fn = lambda x, w, layer: stacked_head_gemv(x, w, layer, contract_rows=contract_rows)
    hlo = lower_for_h200(fn, shape((1, 16, 512 if contract_rows else 128), jnp.bfloat16),
                         shape((26, 512, 16, 128), jnp.bfloat16), shape((), jnp.int32))
    assert hlo.count("__gpu$xla.gpu.triton") == 1
