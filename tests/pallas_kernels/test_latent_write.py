"""The fused latent write (interpret mode) against its reference: kv_a_norm and rope (both pair layouts)
applied, rows stored at their slots of one layer's pools, padding slots dropped, the rest untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.latent_write import write_latents, write_latents_reference
from tests.pallas_kernels.kernel_utils import lower_for_h200

INV_FREQ = tuple(float(f) for f in 1.0 / 10000 ** (np.arange(0, 32, 2) / 32))


def _pools(rng, dtype, layers=3, blocks=5, block_size=4, latent=64, rope=32):
    return (jnp.asarray(rng.standard_normal((layers, blocks, block_size, latent)), dtype),
            jnp.asarray(rng.standard_normal((layers, blocks, block_size, rope)), dtype))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("interleave", [True, False])
def test_write_latents_matches_reference(dtype, tol, interleave):
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((3, 96)) * 3, jnp.float32)
    slots = jnp.asarray([5, 17, 5 * 4 + 3], jnp.int32)  # the last one is padding: past the pool
    positions = jnp.asarray([100, 7, 0], jnp.int32)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal((2, 64)), dtype)  # a stack of 2 layers' kv_a_norm
    options = dict(eps=1e-6, inv_freq=INV_FREQ, cos_sin_scale=0.7, interleave=interleave)
    want = write_latents_reference(*_pools(np.random.default_rng(1), dtype), kv, slots, positions, 2, norm, 1,
                                   **options)
    got = write_latents(*_pools(np.random.default_rng(1), dtype), kv, slots, positions, jnp.int32(2), norm,
                        jnp.int32(1), interpret=True, **options)
    before = _pools(np.random.default_rng(1), dtype)
    for pool, expected, old in zip(got, want, before):
        np.testing.assert_allclose(np.asarray(pool, np.float32), np.asarray(expected, np.float32), rtol=tol, atol=tol)
        changed = np.argwhere(np.asarray(pool != old).any(axis=-1))
        assert {tuple(c) for c in changed} == {(2, 1, 1), (2, 4, 1)}  # slots 5 and 17 of layer 2, nothing else


def test_write_latents_refuses_bad_shapes():
    c_kv, k_pe = _pools(np.random.default_rng(0), jnp.float32)
    with pytest.raises(ValueError, match=r"expected \[L, N, bs, C\], \[L, N, bs, R\], \[T, C \+ R\]"):
        write_latents(c_kv, k_pe, jnp.zeros((1, 95)), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), 0,
                      jnp.ones((1, 64)), 0, eps=1e-6, inv_freq=INV_FREQ, cos_sin_scale=1.0, interleave=True,
                      interpret=True)


def test_write_latents_lowers_to_triton_for_h200_in_place():
    """V2-Lite's pools (27 layers, 2048 blocks of 64): one Triton call, both pools aliased in and out."""
    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    fn = lambda c, k, kv, s, p, layer, norm: write_latents(c, k, kv, s, p, layer, norm, 0, eps=1e-6,
                                                           inv_freq=INV_FREQ, cos_sin_scale=1.0, interleave=True)
    hlo = lower_for_h200(fn, shape((27, 2048, 64, 512), bf16), shape((27, 2048, 64, 64), bf16),
                         shape((4, 576), jnp.float32), shape((4,), jnp.int32), shape((4,), jnp.int32),
                         shape((), jnp.int32), shape((26, 512), bf16))
    assert hlo.count("__gpu$xla.gpu.triton") == 1
    assert hlo.count("stablehlo.output_operand_alias<output_tuple_indices") == 2
