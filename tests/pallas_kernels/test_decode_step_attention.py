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
from pallas_kernels.common import rotate


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
