"""Dense fused SwiGLU kernel (interpret mode) against its reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.swiglu import swiglu, swiglu_reference
from tests.pallas_kernels.kernel_utils import lower_for_h200, run_fast


def _inputs(seed, num_tokens, hidden, inter, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), dtype)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((hidden, inter)) / np.sqrt(hidden), dtype)
                    for _ in range(2))
    return x, w_gate, w_up


@pytest.mark.parametrize("shape,dtype,tol", [
    ((40, 64, 96), jnp.float32, 1e-5),  # partial M and N tiles, a partial group of M tiles
    ((16, 48, 32), jnp.float32, 1e-5),  # partial K tile
    ((33, 64, 64), jnp.bfloat16, 2e-2),
])
def test_swiglu_matches_reference(shape, dtype, tol):
    out, ref = run_fast(lambda *a: (swiglu(*a, block_m=16, block_n=32, block_k=32, group_m=2,
                                       interpret=True), swiglu_reference(*a)),
                    *_inputs(0, *shape, dtype))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)


def test_swiglu_default_tiles_and_shape_check():
    x, w_gate, w_up = _inputs(1, 8, 32, 32, jnp.float32)
    out, ref = run_fast(lambda *a: (swiglu(*a, interpret=True), swiglu_reference(*a)), x, w_gate, w_up)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected x \\[T, D\\] and both weights \\[D, I\\]"):
        swiglu(x, w_gate, w_up[:16], interpret=True)


@pytest.mark.parametrize("num_tokens", [16, 4096])
def test_swiglu_lowers_to_triton_for_h200(num_tokens):
    hidden, inter = 2048, 10944  # V2-Lite dense MLP; 10944 = 85.5 tiles of 128
    shape = jax.ShapeDtypeStruct
    hlo = lower_for_h200(swiglu, shape((num_tokens, hidden), jnp.bfloat16),
                          shape((hidden, inter), jnp.bfloat16), shape((hidden, inter), jnp.bfloat16))
    assert hlo.count("__gpu$xla.gpu.triton") == 1
