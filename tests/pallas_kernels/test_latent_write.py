"""The fused latent write (interpret mode) against its reference: kv_a_norm and rope (both pair layouts)
applied, rows stored at their slots of one layer's pools, padding slots dropped, the rest untouched."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import latent_write
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


@pytest.mark.parametrize("interleave", [True, False])
def test_write_latents_finishes_split_partials_and_queries(interleave, monkeypatch):
    """kv_a's and q's products as stacked_gemvs's unsummed split-K partials of the attention's
    RMSNorm-scaled rows (3 splits): the kernel adds them, applies 1 / rms, writes the latents and
    returns q_nope and the rotated q_pe, as norm-then-project through the references does."""
    from pallas_kernels.stacked_gemv import stacked_gemvs

    rng = np.random.default_rng(4)
    depth, heads, nope, rope, latent, tokens = 48, 3, 16, 32, 64, 2
    x = jnp.asarray(rng.standard_normal((tokens, depth)) * 2, jnp.float32)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal((2, depth)), jnp.float32)
    w_q = jnp.asarray(rng.standard_normal((2, depth, heads * (nope + rope))) * 0.2, jnp.float32)
    w_kv = jnp.asarray(rng.standard_normal((2, depth, latent + rope)) * 0.2, jnp.float32)
    q_parts, kv_parts, squares = stacked_gemvs(x, (w_q, w_kv), jnp.int32(1), g, eps=1e-5, num_splits=3, block_n=16,
                                               block_k=16, partials=True, interpret=True)
    assert q_parts.shape == (3 * tokens, heads * (nope + rope)) and squares.shape == (3 * tokens,)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal((2, latent)), jnp.float32)
    slots, positions = jnp.asarray([6, 13], jnp.int32), jnp.asarray([9, 300], jnp.int32)
    options = dict(eps=1e-6, inv_freq=INV_FREQ, cos_sin_scale=0.7, interleave=interleave)
    got = write_latents(*_pools(np.random.default_rng(1), jnp.float32), kv_parts, slots, positions, jnp.int32(2),
                        norm, jnp.int32(1), squares=squares, row_rms=(depth, 1e-5), q=q_parts, q_heads=(heads, nope),
                        interpret=True, **options)

    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * g[1]
    want = write_latents_reference(*_pools(np.random.default_rng(1), jnp.float32), normed @ w_kv[1], slots, positions,
                                   2, norm, 1, **options)
    q = (normed @ w_q[1]).reshape(tokens, heads, nope + rope)
    x1, x2 = (q[..., nope::2], q[..., nope + 1::2]) if interleave else (q[..., nope:nope + 16], q[..., nope + 16:])
    freqs = positions[:, None, None].astype(jnp.float32) * jnp.asarray(INV_FREQ, jnp.float32)
    cos, sin = jnp.cos(freqs) * 0.7, jnp.sin(freqs) * 0.7
    want = want + (q[..., :nope], jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1))
    assert len(got) == 4
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    # the reference reads the same partials the same way
    ref = write_latents_reference(*_pools(np.random.default_rng(1), jnp.float32), kv_parts, slots, positions, 2, norm,
                                  1, squares=squares, row_rms=(depth, 1e-5), q=q_parts, q_heads=(heads, nope), **options)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # w_uk: the nope queries come back absorbed (layer 1 of the stack, ABSORB_TILES programs a head; a
    # latent of 64 in 4 tiles of 16), the rest unchanged
    w_uk = jnp.asarray(rng.standard_normal((2, latent, heads, nope)) * 0.2, jnp.float32)
    absorbed = write_latents(*_pools(np.random.default_rng(1), jnp.float32), kv_parts, slots, positions, jnp.int32(2),
                             norm, jnp.int32(1), squares=squares, row_rms=(depth, 1e-5), q=q_parts,
                             q_heads=(heads, nope), w_uk=w_uk, interpret=True, **options)
    q_latent = jnp.einsum("thn,chn->thc", want[2], w_uk[1])
    for a, b in zip(absorbed, want[:2] + (q_latent, want[3])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    # one token takes ONE_TOKEN_ABSORB_TILES programs a head (here 2, tiles of 32)
    monkeypatch.setattr(latent_write, "ONE_TOKEN_ABSORB_TILES", 2)
    q_one, kv_one, squares_one = stacked_gemvs(x[:1], (w_q, w_kv), jnp.int32(1), g, eps=1e-5, num_splits=3,
                                               block_n=16, block_k=16, partials=True, interpret=True)
    one = write_latents(*_pools(np.random.default_rng(1), jnp.float32), kv_one, slots[:1], positions[:1],
                        jnp.int32(2), norm, jnp.int32(1), squares=squares_one, row_rms=(depth, 1e-5), q=q_one,
                        q_heads=(heads, nope), w_uk=w_uk, interpret=True, **options)
    np.testing.assert_allclose(np.asarray(one[2]), np.asarray(q_latent[:1]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(one[3]), np.asarray(want[3][:1]), rtol=1e-4, atol=1e-4)


def test_absorb_tiles_by_tokens():
    """Eight programs a head at one token, four at more (V2-Lite's 512 latent columns); never tiles of
    fewer than MIN_ABSORB_COLUMNS columns."""
    assert [latent_write.absorb_tiles(t, 512) for t in (1, 2, 8)] == [8, 4, 4]
    assert [latent_write.absorb_tiles(t, 64) for t in (1, 2)] == [4, 4]
    assert latent_write.absorb_tiles(1, 16) == 1


def test_write_latents_with_queries_lowers_to_triton_for_h200_in_place():
    """V2-Lite's shapes with 16 splits of q (16 heads x 192) and kv_a partials: still one Triton call, both
    pools aliased, the queries two more outputs (also absorbed through W_UK)."""
    shape, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    fn = lambda c, k, kv, s, p, layer, norm, sq, q, w_uk=None: write_latents(
        c, k, kv, s, p, layer, norm, 0, eps=1e-6, inv_freq=tuple(float(f) for f in 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)),
        cos_sin_scale=1.0, interleave=True, squares=sq, row_rms=(2048, 1e-6), q=q, q_heads=(16, 128), w_uk=w_uk)
    args = (shape((27, 2048, 64, 512), bf16), shape((27, 2048, 64, 64), bf16), shape((16, 576), f32),
            shape((1,), jnp.int32), shape((1,), jnp.int32), shape((), jnp.int32), shape((26, 512), bf16),
            shape((16,), f32), shape((16, 3072), f32))
    for w_uk in (None, shape((26, 512, 16, 128), bf16)):  # with W_UK: the absorbed queries
        hlo = lower_for_h200(fn, *args, *([w_uk] if w_uk else []))
        assert hlo.count("__gpu$xla.gpu.triton") == 1
        assert hlo.count("stablehlo.output_operand_alias<output_tuple_indices") == 2


def test_write_latents_refuses_queries_without_their_norm():
    c_kv, k_pe = _pools(np.random.default_rng(0), jnp.float32)
    with pytest.raises(ValueError, match=r"q_heads \(H, Dn\), and squares / row_rms"):
        write_latents(c_kv, k_pe, jnp.zeros((1, 96)), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), 0,
                      jnp.ones((1, 64)), 0, eps=1e-6, inv_freq=INV_FREQ, cos_sin_scale=1.0, interleave=True,
                      q=jnp.zeros((1, 2 * 48)), q_heads=(2, 16), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_store_rows_writes_each_layer_at_the_slot_only(dtype):
    """The step kernel's rows (2 of the pools' 3 layers, 64 + 32 wide) at one slot: those rows, nothing else;
    a slot past the pools or negative stores nothing; the reference agrees."""
    rows = jnp.asarray(np.random.default_rng(2).standard_normal((2, 96)), dtype)
    before = [np.asarray(p, np.float32) for p in _pools(np.random.default_rng(1), dtype)]
    for slot in (13, 5 * 4, -1):  # block 3, row 1; past the pool; negative
        got = latent_write.store_rows(*_pools(np.random.default_rng(1), dtype), rows, jnp.int32(slot),
                                      interpret=True)
        want = latent_write.store_rows_reference(*_pools(np.random.default_rng(1), dtype), rows, jnp.int32(slot))
        expected = [p.copy() for p in before]
        if slot == 13:
            expected[0][:2, 3, 1], expected[1][:2, 3, 1] = rows[:, :64], rows[:, 64:]
        for pool, ref, exp in zip(got, want, expected):
            np.testing.assert_array_equal(np.asarray(pool, np.float32), exp)
            np.testing.assert_array_equal(np.asarray(ref, np.float32), exp)
        # the same rows as two kernels' parts (layer 0's, then layer 1's): stored as one array's
        split = (rows[:1], rows[1:])
        for store in (functools.partial(latent_write.store_rows, interpret=True), latent_write.store_rows_reference):
            got = store(*_pools(np.random.default_rng(1), dtype), split, jnp.int32(slot))
            for pool, exp in zip(got, expected):
                np.testing.assert_array_equal(np.asarray(pool, np.float32), exp)


def test_store_rows_refuses_rows_that_do_not_fit():
    c_kv, k_pe = _pools(np.random.default_rng(0), jnp.float32)
    for rows in (jnp.zeros((2, 95)), jnp.zeros((4, 96)), (jnp.zeros((2, 96)), jnp.zeros((2, 96)))):
        with pytest.raises(ValueError, match=r"expected \[L', N, bs, C\], \[L', N, bs, R\] and rows \[L_i, C \+ R\]"):
            latent_write.store_rows(c_kv, k_pe, rows, jnp.int32(0), interpret=True)


def test_store_rows_lowers_to_triton_for_h200_in_place():
    """V2-Lite's pools and the 26 MoE layers' rows: one Triton call, both pools aliased in and out."""
    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    hlo = lower_for_h200(latent_write.store_rows, shape((27, 2048, 64, 512), bf16), shape((27, 2048, 64, 64), bf16),
                         shape((26, 576), bf16), shape((), jnp.int32))
    assert hlo.count("__gpu$xla.gpu.triton") == 1
    assert hlo.count("stablehlo.output_operand_alias<output_tuple_indices") == 2
    # the step kernel's 26 rows and the dense layer's attention kernel's one, stored by the same launch
    both = lambda c_kv, k_pe, moe, dense, slot: latent_write.store_rows(c_kv, k_pe, (moe, dense), slot)
    hlo = lower_for_h200(both, shape((27, 2048, 64, 512), bf16), shape((27, 2048, 64, 64), bf16),
                         shape((26, 576), bf16), shape((1, 576), bf16), shape((), jnp.int32))
    assert hlo.count("__gpu$xla.gpu.triton") == 1 and "concatenate" not in hlo
    assert hlo.count("stablehlo.output_operand_alias<output_tuple_indices") == 2
