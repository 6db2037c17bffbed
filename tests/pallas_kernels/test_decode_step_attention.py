"""The step kernel's attention half at one token (pallas_kernels/decode_step_attention.py): with the rope columns
permuted once, a kernel rotates two contiguous halves and gets the model's values bit for bit; the reference is
the model's attention (``MLAttention.paged``, reference backend) on a small V2-Lite-shaped layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model import PagedBatch, PagedKVCache
from dsjax.model.mla import MLAttention
from dsjax.model.norms import RMSNorm
from pallas_kernels import decode_step_attention as step
from pallas_kernels.common import rms_norm, rotate


@pytest.mark.parametrize("interleave", [True, False])
def test_permuted_rope_columns_rotate_as_contiguous_halves(interleave):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal(32), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    order = step.rope_order(16, interleave)
    assert sorted(order) == list(range(16))
    np.testing.assert_array_equal(np.asarray(h @ w[:, order]), np.asarray(h @ w)[order])  # columns, not sums
    freqs = 7 * jnp.asarray(rng.random(8), jnp.float32)
    cos, sin = step.rope_cos_sin(7, freqs / 7, 0.9)
    np.testing.assert_allclose(np.asarray(step.rotate_halves(h @ w[:, order], cos, sin)),
                               np.asarray(rotate(h @ w, freqs, 0.9, interleave)), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rope dim 15: rope rotates pairs"):
        step.rope_order(15, interleave)


def test_reduced_cos_sin_is_cos_sin_at_every_position_the_rope_takes():
    """The in-kernel rope's cos and sin (``ROPE_IN_KERNEL``): angles taken to [-pi, pi] by a three-part 2 pi before
    cos / sin, which the kernel computes approximately (accurate on that range only), against float64 cos / sin of
    the same f32 angles, over V2-Lite's YaRN frequencies at positions up to the reduction's bound; and the
    parts' k-multiples exact (8 significant bits each)."""
    from pallas_kernels.common import REDUCED_ANGLES_BELOW, TWO_PI_PARTS, reduced_cos_sin

    config = ModelConfig.preset("deepseek-v2-lite")
    attn = nnx.eval_shape(lambda: MLAttention(config, jnp.bfloat16, nnx.Rngs(0)))
    inv_freq = np.asarray(attn.inv_freq, np.float32)
    parts = [np.float64(np.float32(part)) for part in TWO_PI_PARTS]  # as the f32 products take them
    assert inv_freq.max() <= 1 and abs(sum(parts) - 2 * np.pi) < 1e-12
    for part in TWO_PI_PARTS[:2]:
        assert np.float32(part).view(np.uint32) & 0xFFFF == 0  # at most 8 significant bits: k * part exact
    positions = np.concatenate([np.arange(0, 9000), np.arange(9000, int(REDUCED_ANGLES_BELOW), 97)]).astype(np.float32)
    angles = positions[:, None] * inv_freq[None, :]  # f32, as the kernel and rope_cos_sin form them
    cos, sin = jax.jit(lambda a: reduced_cos_sin(a, 0.75))(angles)
    exact = angles.astype(np.float64)
    np.testing.assert_allclose(np.asarray(cos, np.float64), 0.75 * np.cos(exact), rtol=0, atol=3e-7)
    np.testing.assert_allclose(np.asarray(sin, np.float64), 0.75 * np.sin(exact), rtol=0, atol=3e-7)
    far = np.float32(4 * REDUCED_ANGLES_BELOW)  # past the bound k * part is rounded: the error grows
    assert abs(float(reduced_cos_sin(jnp.float32(far), 1.0)[0]) - np.cos(np.float64(far))) > 3e-7


@pytest.mark.parametrize("interleave", [True, False])
def test_attention_half_reference_is_the_models_attention(interleave):
    """A V2-Lite-shaped layer (plain q_proj, YaRN rope) at 4 heads: the reference on permuted weights gives the
    model's x + attention of a token at position 9 of a shuffled paged context, and the cache rows it writes."""
    config = ModelConfig.preset("deepseek-v2-lite").replace(
        hidden_size=128, num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, rope_interleave=interleave)
    attn = MLAttention(config, jnp.bfloat16, nnx.Rngs(0))
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps, "embed", jnp.bfloat16)
    rng = np.random.default_rng(1)
    norm.weight[...] = jnp.asarray(1 + rng.random(config.hidden_size) / 4, jnp.bfloat16)
    attn.kv_a_norm.weight[...] = jnp.asarray(1 + rng.random(config.kv_lora_rank) / 4, jnp.bfloat16)
    cache = PagedKVCache.zeros(config, 8, 4, jnp.bfloat16)
    cache = cache._replace(c_kv=cache.c_kv.at[0].set(jnp.asarray(rng.standard_normal(cache.c_kv.shape[1:]), jnp.bfloat16)),
                           k_pe=cache.k_pe.at[0].set(jnp.asarray(rng.standard_normal(cache.k_pe.shape[1:]), jnp.bfloat16)))
    table = jnp.asarray(rng.permutation(8), jnp.int32)
    position = 9
    x = jnp.asarray(rng.standard_normal(config.hidden_size), jnp.bfloat16)
    slot = table[position // 4] * 4 + position % 4
    batch = PagedBatch(jnp.asarray([position], jnp.int32), slot[None], jnp.zeros((1,), jnp.int32), table[None])
    out, want_cache = jax.jit(lambda x, cache: attn.paged(x[None], cache, 0, batch, norm=norm, backend="reference"))(
        x, cache)

    q_proj, kv_a = step.permute_rope_columns(attn.q_proj[...], attn.kv_a[...], config.qk_rope_head_dim, interleave)
    weights = step.AttentionWeights(norm.weight[...], q_proj, kv_a, attn.kv_a_norm.weight[...], attn.w_uk[...],
                                    attn.w_uv[...], attn.o_proj[...])
    spec = step.AttentionSpec(config.rms_norm_eps, attn.kv_a_norm.eps, attn.scale, attn.inv_freq, attn.cos_sin_scale)
    got, c_kv, k_pe = jax.jit(lambda x, c_kv, k_pe: step.attention_half_reference(x, position, table, c_kv, k_pe,
                                                                                  weights, spec))(
        x, cache.c_kv[0], cache.k_pe[0])
    np.testing.assert_array_equal(np.asarray(c_kv, np.float32), np.asarray(want_cache.c_kv[0], np.float32))
    np.testing.assert_array_equal(np.asarray(k_pe, np.float32), np.asarray(want_cache.k_pe[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x + out[0], np.float32))  # bit for bit


def test_attention_chain_lowers_for_hopper_and_says_what_it_takes(monkeypatch):
    """The attention halves' kernel (five phases a layer) lowers for an abstract H200 at V2-Lite's shapes;
    step.attention_supports names what it does not take."""
    from pallas_kernels.common import lower_for_h200

    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    layers, hidden, heads = 2, 2048, 16
    weights = step.AttentionWeights(shape((layers, hidden), bf16), shape((layers, hidden, heads, 192), bf16),
                               shape((layers, hidden, 576), bf16), shape((layers, 512), bf16),
                               shape((layers, 512, heads, 128), bf16), shape((layers, 512, heads, 128), bf16),
                               shape((layers, heads, 128, hidden), bf16))
    spec = step.AttentionSpec(1e-6, 1e-6, 0.07, tuple([1.0] * 32), 1.0)
    call = lambda x, pos, table, c_kv, k_pe, *w: step.attention_chain(x, pos, table, c_kv, k_pe, step.AttentionWeights(*w), spec)
    caches = shape((layers, 16, 64, 512), bf16), shape((layers, 16, 64, 64), bf16)
    monkeypatch.setattr(step, "ROPE_IN_KERNEL", False)
    for query_tma in (False, True):  # the query windows by the warpgroup's loads, or by TMA (QUERY_TMA)
        monkeypatch.setattr(step, "QUERY_TMA", query_tma)
        hlo = lower_for_h200(call, shape((hidden,), bf16), shape((), jnp.int32), shape((8,), jnp.int32), *caches,
                             *weights)
        assert hlo.count("custom_call @mosaic_gpu") == 1
        assert hlo.count("stablehlo.cosine") == 1  # the caller's cos / sin table
    monkeypatch.setattr(step, "ROPE_IN_KERNEL", True)  # as built the rope CTA computes them: no cos / sin outside
    hlo = lower_for_h200(call, shape((hidden,), bf16), shape((), jnp.int32), shape((8,), jnp.int32), *caches, *weights)
    assert hlo.count("custom_call @mosaic_gpu") == 1 and "stablehlo.cosine" not in hlo and "stablehlo.sine" not in hlo
    with pytest.raises(ValueError, match=r"expected x \[D=2048\] and caches \[L', N, bs, ...\] holding layers"):
        jax.eval_shape(call, shape((hidden,), bf16), shape((), jnp.int32), shape((8,), jnp.int32),
                       shape((3, 16, 64, 512), bf16), caches[1], *weights)
    # a stack after others in the caches (the engine's dense layer): its layers at cache_layer on
    three = shape((3, 16, 64, 512), bf16), shape((3, 16, 64, 64), bf16)
    at = lambda cache_layer: lambda x, pos, table, c_kv, k_pe, *w: step.attention_chain(
        x, pos, table, c_kv, k_pe, step.AttentionWeights(*w), spec, cache_layer=cache_layer)
    hlo = lower_for_h200(at(1), shape((hidden,), bf16), shape((), jnp.int32), shape((8,), jnp.int32), *three, *weights)
    assert hlo.count("custom_call @mosaic_gpu") == 1
    # with the next sublayer's RMSNorm of x_L made by CTA 0 after the last layer (out_norm)
    normed = lambda x, pos, table, c_kv, k_pe, g, *w: step.attention_chain(
        x, pos, table, c_kv, k_pe, step.AttentionWeights(*w), spec, cache_layer=1, out_norm=(g, 1e-6))
    args = (shape((hidden,), bf16), shape((), jnp.int32), shape((8,), jnp.int32), *three,
            shape((hidden,), jnp.float32), *weights)
    assert lower_for_h200(normed, *args).count("custom_call @mosaic_gpu") == 1
    assert [o.shape for o in jax.eval_shape(normed, *args)] == [(hidden,), (layers, 576), (hidden,)]
    # x_L in f32 (its bf16 values) for a launch that adds into it in place (dispatch.DENSE_MLP_IN_PLACE)
    in_f32 = lambda x, pos, table, c_kv, k_pe, g, *w: step.attention_chain(
        x, pos, table, c_kv, k_pe, step.AttentionWeights(*w), spec, cache_layer=1, out_norm=(g, 1e-6),
        residual_dtype=jnp.float32)
    assert lower_for_h200(in_f32, *args).count("custom_call @mosaic_gpu") == 1
    assert [o.dtype for o in jax.eval_shape(in_f32, *args)] == [jnp.float32, bf16, bf16]
    # the token's row read from the embedding table by the kernel (dispatch.STEP_KERNEL_EMBEDDING)
    embedded = lambda token, pos, table, c_kv, k_pe, g, embedding, *w, **kw: step.attention_chain(
        token, pos, table, c_kv, k_pe, step.AttentionWeights(*w), spec, cache_layer=1, out_norm=(g, 1e-6),
        residual_dtype=jnp.float32, embedding=embedding, **kw)
    token_args = (shape((), jnp.int32), *args[1:6], shape((102400, hidden), bf16), *weights)
    hlo = lower_for_h200(embedded, *token_args)
    assert hlo.count("custom_call @mosaic_gpu") == 1 and "gather" not in hlo
    assert "griddepcontrol" not in hlo
    # letting a programmatic dependent after it be set up from its start (dispatch.STEP_KERNEL_PDL); itself launched
    # as usual (no wait, so no PDL launch attribute)
    hlo = lower_for_h200(lambda *a: embedded(*a, launch_dependents=True), *token_args)
    assert "griddepcontrol.launch_dependents" in hlo and "griddepcontrol.wait" not in hlo and "uses_pdl" not in hlo
    assert [o.shape for o in jax.eval_shape(embedded, *token_args)] == [(hidden,), (layers, 576), (hidden,)]
    with pytest.raises(ValueError, match=r"embedding \(102400, 1024\), x int32\[\]; expected the table \[V, D=2048\]"):
        jax.eval_shape(embedded, *token_args[:6], shape((102400, 1024), bf16), *weights)
    with pytest.raises(ValueError, match=r"x bfloat16\[2048\]; expected .* x a token id"):
        jax.eval_shape(embedded, *args[:6], shape((102400, hidden), bf16), *weights)
    with pytest.raises(ValueError, match="residual_dtype comes with out_norm"):
        jax.eval_shape(lambda x, pos, table, c_kv, k_pe, *w: step.attention_chain(
            x, pos, table, c_kv, k_pe, step.AttentionWeights(*w), spec, residual_dtype=jnp.float32),
            *args[:5], *weights)
    with pytest.raises(ValueError, match=r"out_norm weights \(64,\); expected \[D=2048\]"):
        jax.eval_shape(normed, *args[:5], shape((64,), jnp.float32), *weights)
    with pytest.raises(ValueError, match="cache_layer=2; expected .* holding layers cache_layer .. cache_layer \\+ 1"):
        jax.eval_shape(at(2), shape((hidden,), bf16), shape((), jnp.int32), shape((8,), jnp.int32), *three, *weights)
    monkeypatch.setattr(step, "why_not_hopper", lambda: None)
    dims = (128, 64, 512, 128)
    supports = lambda **kw: step.attention_supports(**{**dict(hidden=2048, num_heads=16, dims=dims, block_size=64,
                                                         capacity=2048, dtype=bf16, num_layers=26), **kw})
    assert supports() is None
    assert "head dims (nope, rope, latent, v) (64, 64, 512, 128)" in supports(dims=(64, 64, 512, 128))
    assert "128 heads (this kernel takes 16" in supports(num_heads=128)
    assert "block_size 16 is not a multiple of 64" in supports(block_size=16)
    assert supports(capacity=4096) is None  # the engine's default max_model_len
    assert "a context of 9000 tokens needs 142 CTAs" in supports(capacity=9000)
    assert "weights in float32" in supports(dtype=jnp.float32)


def test_attention_chain_reference_chains_the_layers():
    """The chain's reference: each layer's attention half on the last's output, the rows it writes into its
    cache returned (tiny shapes, CPU)."""
    rng = np.random.default_rng(4)
    layers, hidden, heads, bs = 2, 64, 2, 64
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.bfloat16)
    weights = step.AttentionWeights(jnp.ones((layers, hidden), jnp.bfloat16), w(layers, hidden, heads, 192),
                               w(layers, hidden, 576), jnp.ones((layers, 512), jnp.bfloat16),
                               w(layers, 512, heads, 128), w(layers, 512, heads, 128), w(layers, heads, 128, hidden))
    spec = step.AttentionSpec(1e-6, 1e-6, 192 ** -0.5, tuple(10000.0 ** (-np.arange(0, 64, 2) / 64)), 1.0)
    c_kv = jnp.asarray(rng.standard_normal((layers, 4, bs, 512)), jnp.bfloat16)
    k_pe = jnp.asarray(rng.standard_normal((layers, 4, bs, 64)), jnp.bfloat16)
    x, table, position = jnp.asarray(rng.standard_normal(hidden), jnp.bfloat16), jnp.asarray([2, 0], jnp.int32), 70
    out, kv = step.attention_chain_reference(x, position, table, c_kv, k_pe, weights, spec)
    embedding = jnp.asarray(rng.standard_normal((10, hidden)), jnp.bfloat16).at[3].set(x)  # x as token 3's row
    for token in (3, -7):  # a negative id counts from the end, as jnp.take
        got, got_kv = step.attention_chain_reference(jnp.int32(token), position, table, c_kv, k_pe, weights, spec,
                                                     embedding=embedding)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(out, np.float32))
        np.testing.assert_array_equal(np.asarray(got_kv, np.float32), np.asarray(kv, np.float32))
    assert np.isnan(np.asarray(step.attention_chain_reference(jnp.int32(10), position, table, c_kv, k_pe, weights,
                                                              spec, embedding=embedding)[0], np.float32)).all()
    want = x
    for layer in range(layers):
        want, c_l, k_l = step.attention_half_reference(want, position, table, c_kv[layer], k_pe[layer],
                                                  step.AttentionWeights(*(a[layer] for a in weights)), spec)
        np.testing.assert_array_equal(np.asarray(kv[layer, :512]), np.asarray(c_l[0, 6]))  # page 0, slot 6
        np.testing.assert_array_equal(np.asarray(kv[layer, 512:]), np.asarray(k_l[0, 6]))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    # the same chain as layers 1 and 2 of caches of 3 (cache layer 0 another stack's, never read)
    other = lambda a: jnp.concatenate([jnp.full_like(a[:1], jnp.nan), a])
    out_at, kv_at = step.attention_chain_reference(x, position, table, other(c_kv), other(k_pe), weights, spec,
                                                   cache_layer=1)
    np.testing.assert_array_equal(np.asarray(kv_at), np.asarray(kv))
    np.testing.assert_array_equal(np.asarray(out_at, np.float32), np.asarray(out, np.float32))
    g = jnp.asarray(1 + rng.random(hidden) / 4, jnp.bfloat16)  # x_L normed for the next sublayer
    *_, normed = step.attention_chain_reference(x, position, table, c_kv, k_pe, weights, spec,
                                                out_norm=(g.astype(jnp.float32), 1e-6))
    np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(rms_norm(out, g, 1e-6), np.float32))


@pytest.mark.parametrize("valid", [64, 5, 1])
def test_chunk_scores_and_values_interpreted(valid):
    """Phase 3's arithmetic over one chunk (``chunk_scores``, ``chunk_values``: the code the step kernels run),
    in one CTA under JAX's GPU interpret mode on the CPU, against numpy: each head's m (log2 units) and l over
    the first ``valid`` tokens and out^T = the latents^T x P^T (P rounded to bf16)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels import mgpu_interpret
    from pallas_kernels.decode_step_mgpu import _TILING

    heads, scale_log2e = 16, 0.06
    rng = np.random.default_rng(3)
    keys = jnp.asarray(rng.standard_normal((9, 64, 64)), jnp.bfloat16)  # slice j: [64 tokens, 64 columns]
    q = jnp.asarray(rng.standard_normal((192, 64)), jnp.bfloat16)  # row 16 j + h: slice j of head h's query
    f32 = jnp.float32

    def body(keys_ref, q_ref, m_ref, l_ref, o_ref, keys_smem, q_smem, p_smem, landed):
        plgpu.copy_gmem_to_smem(keys_ref, keys_smem, landed.at[0])
        plgpu.copy_gmem_to_smem(q_ref, q_smem, landed.at[0])
        plgpu.barrier_wait(landed.at[0])
        step.chunk_scores(lambda j: keys_smem.at[j], q_smem, p_smem, m_ref, l_ref, lambda: valid, scale_log2e)
        for j, acc in enumerate(step.chunk_values(lambda j: keys_smem.at[j], p_smem, heads)):
            o_ref.at[pl.ds(j * 64, 64)][...] = acc

    m, l, o = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((64,), f32), jax.ShapeDtypeStruct((64,), f32),
                        jax.ShapeDtypeStruct((512, heads), f32)),
        scratch_types=[plgpu.SMEM((9, 64, 64), jnp.bfloat16, transforms=_TILING),
                       plgpu.SMEM((192, 64), jnp.bfloat16, transforms=_TILING),
                       plgpu.SMEM((64, 64), jnp.bfloat16, transforms=_TILING),
                       plgpu.Barrier(num_arrivals=2, num_barriers=1)],
        num_threads=1, thread_name="wg", interpret=mgpu_interpret.params(),
    )(keys, q)
    k = np.asarray(keys, np.float32)
    rows = np.concatenate([k[j] for j in range(9)], axis=1)[:valid]  # [tokens, 576]
    queries = np.stack([np.concatenate([np.asarray(q, np.float32)[16 * j + h] for j in range(9)])
                        for h in range(heads)])  # [H, 576]
    s = queries @ rows.T * scale_log2e
    want_m = s.max(axis=1)
    p = np.exp2(s - want_m[:, None])
    p16 = np.asarray(jnp.asarray(p, jnp.bfloat16), np.float32)
    np.testing.assert_allclose(np.asarray(m)[:heads], want_m, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(l)[:heads], p.sum(axis=1), rtol=2e-3)
    np.testing.assert_allclose(np.asarray(o), (p16 @ rows[:, :512]).T, rtol=2e-2, atol=2e-2)
