"""The batch-1 step kernel's GEMV phase (pallas_kernels/decode_step_mgpu.py): it lowers for an abstract H200
(layouts, wgmma operands, TMA boxes, shared memory), says what it does not take, and its jnp reference is the
chain it claims. Numerics on the GPU in tests/gpu."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_step_mgpu as kernel
from pallas_kernels.common import lower_for_h200


def test_gemv_chain_lowers_for_hopper():
    shape = jax.ShapeDtypeStruct
    for layers, depth in ((1, 512), (26, 2048)):
        hlo = lower_for_h200(kernel.gemv_chain, shape((depth,), jnp.bfloat16), shape((layers, depth, depth), jnp.bfloat16))
        assert hlo.count("custom_call @mosaic_gpu") == 1
    with pytest.raises(ValueError, match=r"expected x \[D\] and w \[L, D, D\]"):
        jax.eval_shape(kernel.gemv_chain, shape((2048,), jnp.bfloat16), shape((2, 2048, 1024), jnp.bfloat16))
    with pytest.raises(ValueError, match="392 CTAs fit the GPU's 132 SMs"):  # the grid barriers would never open
        jax.eval_shape(kernel.gemv_chain, shape((3584,), jnp.bfloat16), shape((1, 3584, 3584), jnp.bfloat16))


def test_gemv_chain_supports_says_what_it_does_not_take(monkeypatch):
    monkeypatch.setattr(kernel, "why_not_hopper", lambda: None)
    assert kernel.supports(2048, 26, jnp.bfloat16) is None  # 32 column tiles x 4 K ranges: 128 CTAs
    assert "float32" in kernel.supports(2048, 26, jnp.float32)
    assert "depth 2000 is not a multiple of 512" in kernel.supports(2000, 26, jnp.bfloat16)
    assert "needs 392 CTAs resident at once (this GPU has 132 SMs)" in kernel.supports(3584, 26, jnp.bfloat16)
    assert "0 layers" in kernel.supports(2048, 0, jnp.bfloat16)
    monkeypatch.setattr(kernel, "why_not_hopper", lambda: "no GPU")
    assert kernel.supports(2048, 26, jnp.bfloat16) == "no GPU"


def test_gemv_chain_reference_is_the_rounded_chain():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(64), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 64, 64)) / 8, jnp.bfloat16)
    want = x
    for layer in range(3):
        want = (want.astype(jnp.float32) @ w[layer].astype(jnp.float32)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(kernel.gemv_chain_reference(x, w), np.float32),
                                  np.asarray(want, np.float32))
