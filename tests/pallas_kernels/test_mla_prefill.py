"""mla_prefill (Pallas, interpret mode on CPU) against mla_prefill_reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_prefill import mla_prefill, mla_prefill_reference
from tests.pallas_kernels.kernel_utils import lower_for_h200, relative_error

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype, batch, seq_len, num_heads, block_q, block_k", [
    pytest.param(jnp.float32, 2, 40, 3, 16, 8, id="f32-tail-block"),
    pytest.param(jnp.float32, 1, 37, 2, 8, 16, id="f32-block_k-over-block_q"),
    pytest.param(jnp.float32, 2, 1, 2, None, None, id="f32-one-token"),
    pytest.param(jnp.bfloat16, 2, 50, 2, 32, 16, id="bf16"),
])
def test_mla_prefill_matches_reference(dtype, batch, seq_len, num_heads, block_q, block_k):
    nope_dim, rope_dim, value_dim = 32, 16, 32
    rng = np.random.default_rng(seq_len)
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    q_nope, q_pe = rand(batch, seq_len, num_heads, nope_dim), rand(batch, seq_len, num_heads, rope_dim)
    k_nope, k_pe = rand(batch, seq_len, num_heads, nope_dim), rand(batch, seq_len, rope_dim)
    v = rand(batch, seq_len, num_heads, value_dim)
    scale = (nope_dim + rope_dim) ** -0.5

    out = mla_prefill(q_nope, q_pe, k_nope, k_pe, v, scale, block_q=block_q, block_k=block_k,
                      interpret=True)
    ref = mla_prefill_reference(q_nope, q_pe, k_nope, k_pe, v, scale)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all()
    np.testing.assert_allclose(out32, ref32, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_mla_prefill_lowers_to_triton_for_h200():
    """Triton lowering at DeepSeek head dims (no GPU needed), T off the block grid."""
    batch, seq_len, num_heads = 2, 300, 16
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    args = (shape(batch, seq_len, num_heads, 128), shape(batch, seq_len, num_heads, 64),
            shape(batch, seq_len, num_heads, 128), shape(batch, seq_len, 64),
            shape(batch, seq_len, num_heads, 128))
    hlo = lower_for_h200(lambda *a: mla_prefill(*a, 0.07), *args)
    assert hlo.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("block_kv, stages", [(64, 2), (128, 2)])
def test_mosaic_prefill_lowers_for_hopper(block_kv, stages):
    """The Mosaic GPU kernel's Pallas lowering (layouts, wgmma operands, the barrier protocol's shapes,
    shared-memory budget) runs without a GPU; numerics in interpret mode (below) and on the GPU (tests/gpu)."""
    from pallas_kernels.mla_prefill_mgpu import mla_prefill_mgpu

    shape = jax.ShapeDtypeStruct
    b, t, h = 2, 512, 4
    args = (shape((b, t, h, 128), jnp.bfloat16), shape((b, t, h, 64), jnp.bfloat16),
            shape((b, t, h, 128), jnp.bfloat16), shape((b, t, 64), jnp.bfloat16), shape((b, t, h, 128), jnp.bfloat16))
    fn = lambda *a: mla_prefill_mgpu(*a, 0.07, block_kv=block_kv, stages=stages)
    hlo = lower_for_h200(fn, *args)
    assert hlo.count("custom_call @mosaic_gpu") == 1


def test_mosaic_prefill_refuses_what_it_cannot_run():
    x = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    args = (x, x[..., :64], x, x[:, :, 0, :64], x)
    with pytest.raises(ValueError, match="impl='mosaic' cannot run here"):
        mla_prefill(*args, 0.1, impl="mosaic")
    with pytest.raises(ValueError, match="accepted: auto, triton, mosaic"):
        mla_prefill(*args, 0.1, impl="fast")


@pytest.mark.parametrize("block_kv", [64, 128])
def test_mosaic_prefill_interpreted_matches_reference(block_kv):
    """mla_prefill_mgpu run on the CPU by the GPU interpret mode (``pallas_kernels.mgpu_interpret``): two
    compute warpgroups ping-ponging over two 128-row query tiles, causal, two heads; no data race. The
    default key blocks (128) through mla_prefill(impl="mosaic")."""
    from pallas_kernels import mgpu_interpret
    from pallas_kernels.mla_prefill_mgpu import BLOCK_KV, mla_prefill_mgpu

    rng = np.random.default_rng(block_kv)
    b, t, h = 1, 256, 2
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    args = (normal(b, t, h, 128), normal(b, t, h, 64), normal(b, t, h, 128), normal(b, t, 64), normal(b, t, h, 128))
    if block_kv == BLOCK_KV:
        got = np.asarray(mla_prefill(*args, 0.07, impl="mosaic", interpret=True), np.float32)
    else:
        got = np.asarray(mla_prefill_mgpu(*args, 0.07, block_kv=block_kv, interpret=True), np.float32)
    assert not mgpu_interpret.races_found()
    want = mla_prefill_reference(*(a.astype(jnp.float32) for a in args), 0.07)
    assert relative_error(got, want) < 1e-2
