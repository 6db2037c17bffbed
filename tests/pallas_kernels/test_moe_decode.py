"""The one-launch MoE decode kernel (interpret mode) against its reference: routed experts read in place
from a layer stack, with and without the shared experts, an empty slot, intermediate sizes that leave
partial tiles, several tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_decode import MAX_TOKENS, DecodeTiles, moe_decode, moe_decode_reference
from tests.pallas_kernels.kernel_utils import lower_for_h200, relative_error

TILES = DecodeTiles(block_i=16, block_k=16, block_d=32, num_warps=4, num_stages=2)


def _weights(rng, dtype, layers=3, experts=8, hidden=64, inter=40, shared=48):
    mk = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.2, dtype)
    return (mk(layers, experts, hidden, inter), mk(layers, experts, hidden, inter), mk(layers, experts, inter, hidden),
            (mk(layers, hidden, shared), mk(layers, hidden, shared), mk(layers, shared, hidden)))


@pytest.mark.parametrize("tokens, dtype, tol", [(1, jnp.float32, 1e-5), (3, jnp.float32, 1e-5),
                                               (2, jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("with_shared", [True, False])
def test_moe_decode_matches_reference(tokens, dtype, tol, with_shared):
    rng = np.random.default_rng(tokens)
    w_gate, w_up, w_down, shared = _weights(rng, dtype)
    x = jnp.asarray(rng.standard_normal((tokens, 64)), dtype)
    weights = jnp.asarray(rng.random((tokens, 2)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 8, (tokens, 2)), jnp.int32).at[0, 1].set(8)  # an empty slot
    shared = shared if with_shared else None
    for layer in (0, 2):
        got = moe_decode(x, weights, ids, w_gate, w_up, w_down, jnp.int32(layer), shared, tiles=TILES, interpret=True)
        want = moe_decode_reference(x, weights, ids, w_gate, w_up, w_down, layer, shared)
        assert got.shape == (tokens, 64) and got.dtype == dtype
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol * scale)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_moe_decode_adds_the_residual(dtype, tol):
    """residual: each token's own row added once, in f32 before the rounding, by the token's first
    program, also where that program's slot is empty (token 0's first slot here)."""
    rng = np.random.default_rng(5)
    w_gate, w_up, w_down, shared = _weights(rng, dtype)
    x = jnp.asarray(rng.standard_normal((3, 64)), dtype)
    residual = jnp.asarray(rng.standard_normal((3, 64)) * 8, dtype)
    weights = jnp.asarray(rng.random((3, 2)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 8, (3, 2)), jnp.int32).at[0, 0].set(8)
    args = (x, weights, ids, w_gate, w_up, w_down, jnp.int32(1), shared)
    got = moe_decode(*args, residual, tiles=TILES, interpret=True)
    want = moe_decode_reference(*args, residual)
    assert got.dtype == dtype
    scale = float(jnp.abs(want.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol * scale)
    plain = np.asarray(moe_decode_reference(*args), np.float32)
    assert np.abs(np.asarray(got, np.float32) - plain - np.asarray(residual, np.float32)).max() <= 2 * tol * scale
    with pytest.raises(ValueError, match="residual"):
        moe_decode(*args, residual[:1], tiles=TILES, interpret=True)


def test_moe_decode_refuses_bad_shapes():
    w_gate, w_up, w_down, _ = _weights(np.random.default_rng(0), jnp.float32)
    ids, weights = jnp.zeros((MAX_TOKENS + 1, 2), jnp.int32), jnp.zeros((MAX_TOKENS + 1, 2))
    with pytest.raises(ValueError, match="tokens; accepted 1 to"):
        moe_decode(jnp.zeros((MAX_TOKENS + 1, 64)), weights, ids, w_gate, w_up, w_down, 0, interpret=True)
    with pytest.raises(ValueError, match=r"expected x \[T, D\]"):
        moe_decode(jnp.zeros((1, 32)), weights[:1], ids[:1], w_gate, w_up, w_down, 0, interpret=True)


def test_moe_decode_lowers_to_triton_for_h200():
    """V2-Lite's layer at one token: 64 routed experts (top-6) of 1408 and 2 x 1408 shared, stacked over 26 layers."""
    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    shared = (shape((26, 2048, 2816), bf16), shape((26, 2048, 2816), bf16), shape((26, 2816, 2048), bf16))
    hlo = lower_for_h200(moe_decode, shape((1, 2048), bf16), shape((1, 6), jnp.float32), shape((1, 6), jnp.int32),
                         shape((26, 64, 2048, 1408), bf16), shape((26, 64, 2048, 1408), bf16),
                         shape((26, 64, 1408, 2048), bf16), shape((), jnp.int32), shared)
    assert hlo.count("__gpu$xla.gpu.triton") == 1
    with_residual = lower_for_h200(
        moe_decode, shape((2, 2048), bf16), shape((2, 6), jnp.float32), shape((2, 6), jnp.int32),
        shape((26, 64, 2048, 1408), bf16), shape((26, 64, 2048, 1408), bf16), shape((26, 64, 1408, 2048), bf16),
        shape((), jnp.int32), shared, shape((2, 2048), bf16))
    assert with_residual.count("__gpu$xla.gpu.triton") == 1


def test_moe_decode_mgpu_lowers_for_hopper_and_says_what_it_takes(monkeypatch):
    """The TMA-fed Mosaic GPU launch (pallas_kernels/moe_decode_mgpu.py) lowers at V2-Lite's one-token layer
    with and without the shared experts, and with a residual (layouts, wgmma operands, shared memory), summed
    after the kernel or added into in place (``in_place``: the residual aliased, no reduction after it);
    numerics in interpret mode (below) and in tests/gpu.
    supports() names what it does not take."""
    from pallas_kernels import moe_decode_mgpu as kernel

    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    shared = (shape((26, 2048, 2816), bf16), shape((26, 2048, 2816), bf16), shape((26, 2816, 2048), bf16))
    routed = (shape((26, 64, 2048, 1408), bf16), shape((26, 64, 2048, 1408), bf16), shape((26, 64, 1408, 2048), bf16))
    args = (shape((1, 2048), bf16), shape((1, 6), jnp.float32), shape((1, 6), jnp.int32), *routed, shape((), jnp.int32))
    for extra in ((shared,), (), (shared, shape((1, 2048), bf16))):  # (shared experts), (a residual)
        hlo = lower_for_h200(kernel.moe_decode_mgpu, *args, *extra)
        assert hlo.count("custom_call @mosaic_gpu") == 1 and hlo.count("applies stablehlo.add") == 1
    in_place = lambda *a: kernel.moe_decode_mgpu(*a, in_place=True)
    hlo = lower_for_h200(in_place, *args, shared, shape((1, 2048), jnp.float32))
    assert hlo.count("custom_call @mosaic_gpu") == 1 and "applies stablehlo.add" not in hlo
    assert "output_operand_alias" in hlo  # the residual, added into where it lies
    out = jax.eval_shape(in_place, *args, shared, shape((1, 2048), jnp.float32))
    assert (out.shape, out.dtype) == ((1, 2048), jnp.float32)  # unrounded
    assert "uses_pdl" not in hlo and "griddepcontrol" not in hlo
    # launched as a programmatic dependent (dispatch.STEP_KERNEL_PDL): it waits, and lets the next launch be set up
    dependent = lambda *a: kernel.moe_decode_mgpu(*a, in_place=True, pdl=True)
    hlo = lower_for_h200(dependent, *args, shared, shape((1, 2048), jnp.float32))
    assert hlo.count("uses_pdl") == 1
    assert "griddepcontrol.wait" in hlo and "griddepcontrol.launch_dependents" in hlo
    with pytest.raises(ValueError, match="expected x"):
        jax.eval_shape(kernel.moe_decode_mgpu, shape((2, 2048), bf16), shape((2, 6), jnp.float32),
                       shape((2, 6), jnp.int32), *routed, shape((), jnp.int32))
    with pytest.raises(ValueError, match=r"in_place=True; expected .* \(a residual with in_place=True\)"):
        jax.eval_shape(in_place, *args, shared)
    monkeypatch.setattr(kernel, "why_not_hopper", lambda: None)
    assert kernel.supports(2048, 1408, 2816, 1, bf16) is None
    assert "2 tokens" in kernel.supports(2048, 1408, 2816, 2, bf16)
    assert "float32" in kernel.supports(2048, 1408, 2816, 1, jnp.float32)
    assert "moe intermediate size 1400" in kernel.supports(2048, 1400, 2816, 1, bf16)
    assert kernel.supports(2048, 1408, 0, 1, bf16) is None  # no shared experts
    assert "hidden size 2176 is not a multiple of 512" in kernel.supports(2176, 1408, 2816, 1, bf16)
    assert "needs 246016 bytes of shared memory" in kernel.supports(8192, 2048, 0, 1, bf16)
    assert kernel.supports(7168, 2048, 2048, 1, bf16) is None  # V3's layer: 218 KiB, one CTA an SM


def test_moe_decode_mgpu_interpreted_matches_reference():
    """moe_decode_mgpu run on the CPU by the GPU interpret mode (``pallas_kernels.mgpu_interpret``), at a
    small layer (D 512, 4 experts of 64 columns, top-2, 128 shared columns, layer 1 of 2): the routed and
    shared experts, an empty slot (id E), a residual added where the partials are summed, and in place
    (each CTA's partial row added into the residual by TMA), also as a programmatic dependent launch; no
    data race."""
    from pallas_kernels import mgpu_interpret
    from pallas_kernels.moe_decode_mgpu import moe_decode_mgpu

    rng = np.random.default_rng(5)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)
    layers, experts, hidden, inter, shared_inter = 2, 4, 512, 64, 128
    x, residual = normal(1, hidden) * 10, normal(1, hidden) * 10
    weights = jnp.asarray(rng.random((1, 2)), jnp.float32)
    routed = (normal(layers, experts, hidden, inter), normal(layers, experts, hidden, inter),
              normal(layers, experts, inter, hidden))
    shared = (normal(layers, hidden, shared_inter), normal(layers, hidden, shared_inter),
              normal(layers, shared_inter, hidden))
    f32 = lambda ws: tuple(w.astype(jnp.float32) for w in ws)
    for ids in ([[3, 1]], [[2, experts]]):
        ids = jnp.asarray(ids, jnp.int32)
        want = np.asarray(moe_decode_reference(x.astype(jnp.float32), weights, ids, *f32(routed), 1, f32(shared)))
        got = moe_decode_mgpu(x, weights, ids, *routed, jnp.int32(1), shared, interpret=True)
        assert relative_error(got, want) < 1e-2
        assert not mgpu_interpret.races_found()
    with_residual = want + np.asarray(residual, np.float32)
    got = moe_decode_mgpu(x, weights, ids, *routed, jnp.int32(1), shared, residual, interpret=True)
    assert got.dtype == jnp.bfloat16 and relative_error(got, with_residual) < 1e-2
    for pdl in (False, True):
        got = moe_decode_mgpu(x, weights, ids, *routed, jnp.int32(1), shared, residual.astype(jnp.float32),
                              in_place=True, pdl=pdl, interpret=True)
        assert got.dtype == jnp.float32 and relative_error(got, with_residual) < 1e-2
        assert not mgpu_interpret.races_found()
