"""Kernels compiled for the GPU (not interpret mode) against their references, and the engine with
kernel_backend="pallas" against the reference path. Skipped without a CUDA GPU."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.pallas_kernels.kernel_utils import relative_error as _rel

pytestmark = pytest.mark.gpu


def _paged(rng, batch, heads, lengths, block_size=64, latent=512, rope=64, dtype=jnp.bfloat16):
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = batch * width + 3
    perm = rng.permutation(num_blocks)[:batch * width].reshape(batch, width).astype(np.int32)
    c_kv = jnp.asarray(rng.standard_normal((num_blocks, block_size, latent)), dtype)
    k_pe = jnp.asarray(rng.standard_normal((num_blocks, block_size, rope)), dtype)
    q = jnp.asarray(rng.standard_normal((batch, heads, latent)), dtype)
    q_pe = jnp.asarray(rng.standard_normal((batch, heads, rope)), dtype)
    return q, q_pe, c_kv, k_pe, jnp.asarray(perm), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("heads, impl, block_size, num_splits", [
    (16, "auto", 64, None), (128, "triton", 64, None), (128, "mosaic", 64, None), (128, "mosaic", 64, 1),
    (64, "mosaic", 128, 8), (256, "mosaic", 64, None)])
def test_mla_decode_gpu(heads, impl, block_size, num_splits):
    from pallas_kernels.mla_decode import mla_decode, mla_decode_reference

    rng = np.random.default_rng(heads)
    args = _paged(rng, 6, heads, [1, 63, 64, 700, 1500, 2048], block_size=block_size)
    scale = 0.1
    got = mla_decode(*args, scale, impl=impl, num_splits=num_splits)
    want = mla_decode_reference(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args], scale)
    assert _rel(got, want) < 2e-2


def test_mla_paged_mosaic_several_queries_per_sequence_gpu():
    """Chunked-prefill tails: several queries of one sequence at different positions, padding (-1)."""
    from pallas_kernels.mla_decode import mla_paged, mla_paged_reference

    rng = np.random.default_rng(7)
    q, q_pe, c_kv, k_pe, tables, _ = _paged(rng, 3, 128, [300, 64, 1000])
    seq_ids = jnp.asarray([0, 0, 0, 1, 2, 2, 1, 0], jnp.int32)
    positions = jnp.asarray([0, 63, 299, 63, 999, 511, -1, 128], jnp.int32)
    q = jnp.asarray(rng.standard_normal((8, 128, 512)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((8, 128, 64)), jnp.bfloat16)
    got = mla_paged(q, q_pe, c_kv, k_pe, tables, seq_ids, positions, 0.1, impl="mosaic")
    f32 = lambda a: a.astype(jnp.float32)
    want = mla_paged_reference(f32(q), f32(q_pe), f32(c_kv), f32(k_pe), tables, seq_ids, positions, 0.1)
    assert not np.asarray(got[6], np.float32).any()  # padding: zeros
    keep = np.arange(8) != 6
    assert _rel(np.asarray(got)[keep], np.asarray(want)[keep]) < 2e-2


@pytest.mark.parametrize("kind, groups, paired", [("int8", 1, False), ("fp8", 1, False), ("fp8", 4, False),
                                                  ("int8", 1, True), ("fp8", 4, True)])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_quantized_cache_gpu(kind, groups, paired, heads):
    from pallas_kernels.kv_quant import quantize_latent
    from pallas_kernels.mla_decode import mla_decode, mla_decode_reference

    rng = np.random.default_rng(heads + groups)
    q, q_pe, c_kv, k_pe, tables, lengths = _paged(rng, 6, heads, [1, 63, 64, 700, 1500, 2048])
    stored, scale = quantize_latent(c_kv, kind, groups)
    got = mla_decode(q, q_pe, stored, k_pe, tables, lengths, 0.1, c_kv_scale=scale, paired=paired, impl="triton")
    f32 = lambda a: a.astype(jnp.float32)
    want = mla_decode_reference(f32(q), f32(q_pe), stored, f32(k_pe), tables, lengths, 0.1, scale)
    assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("heads, block_size, num_splits", [(16, 64, None), (16, 128, 1), (32, 64, 4), (16, 64, 2),
                                                       (128, 64, None), (128, 64, 1), (64, 128, 8)])
def test_mla_decode_8bit_mosaic_gpu(kind, heads, block_size, num_splits):
    """The Mosaic GPU kernels over an 8-bit cache (impl="mosaic", and "auto" for int8 and fp8): with few
    heads mla_decode_8bit_mgpu in each of its variants, with many (a multiple of 64) mla_decode_mgpu
    (its memory warpgroup converting each slab to 16 bits); with one split and with partials."""
    from pallas_kernels.kv_quant import quantize_latent
    from pallas_kernels.mla_decode import mla_decode, mla_decode_reference

    rng = np.random.default_rng(heads + block_size)
    q, q_pe, c_kv, k_pe, tables, lengths = _paged(rng, 6, heads, [1, 63, 64, 700, 1500, 2048], block_size=block_size)
    stored, scale = quantize_latent(c_kv * 3.0, kind, 1)
    got = mla_decode(q, q_pe, stored, k_pe, tables, lengths, 0.1, c_kv_scale=scale, impl="mosaic",
                     num_splits=num_splits)
    f32 = lambda a: a.astype(jnp.float32)
    want = mla_decode_reference(f32(q), f32(q_pe), stored, f32(k_pe), tables, lengths, 0.1, scale)
    assert _rel(got, want) < 2e-2
    if heads < 64:  # the latent columns over 1, 2, 4 warpgroups (4 do not fit 32 heads)
        _check_8bit_variants(q, q_pe, stored, k_pe, scale, tables, lengths, want, (1, 2, 4) if heads == 16 else (1, 2))
    else:  # the many-head kernel, one split and partials
        _check_many_heads(q, q_pe, stored, k_pe, scale, tables, lengths, want)
    auto = mla_decode(q, q_pe, stored, k_pe, tables, lengths, 0.1, c_kv_scale=scale, num_splits=num_splits)
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(got, np.float32))


def _check_many_heads(q, q_pe, stored, k_pe, scale, tables, lengths, want):
    """mla_decode_mgpu over the 8-bit cache against the reference, with one split and with partials."""
    from pallas_kernels import mla_decode_mgpu
    from pallas_kernels.mla_decode import combine_splits

    max_context = tables.shape[1] * stored.shape[1]
    for splits in (1, 4):
        out = mla_decode_mgpu.mla_decode_mgpu(q, q_pe, stored, k_pe, tables, jnp.arange(len(lengths), dtype=jnp.int32),
                                              lengths, 0.1, num_splits=splits, tokens_per_split=max_context // splits,
                                              c_kv_scale=scale)
        if splits > 1:
            out = combine_splits(*out, jnp.float32, splits_axis=1)
        assert _rel(out, want) < 2e-2, splits


def _check_8bit_variants(q, q_pe, stored, k_pe, scale, tables, lengths, want, compute_wgs):
    """The few-head 8-bit Mosaic kernel with each count of compute warpgroups against the reference: both
    places for the scale, with one split and (the default scale placement) with split partials; the
    denominators summed after the loop (the default) and, with the default scale placement and two
    warpgroups, every step; with the release fence (as built) and, once, without."""
    from pallas_kernels.mla_decode import combine_splits
    from pallas_kernels.mla_decode_8bit_mgpu import mla_decode_8bit_mgpu

    variants = [(d, w, True, True) for d, w in itertools.product((False, True), compute_wgs)]
    variants += [(False, 2, False, True), (False, 2, True, False)]
    for dequantize, wgs, defer_sum, fence in variants:
        for splits in (1, 2) if not dequantize else (1,):
            out = mla_decode_8bit_mgpu(q, q_pe, stored, k_pe, scale, tables, jnp.arange(len(lengths), dtype=jnp.int32),
                                       lengths, 0.1, num_splits=splits, dequantize=dequantize, compute_wgs=wgs,
                                       defer_sum=defer_sum, release_fence=fence)
            if splits > 1:
                m, l, acc = out
                out = combine_splits(m, l, acc.swapaxes(2, 3), jnp.float32, splits_axis=1).swapaxes(1, 2)
            assert _rel(out.swapaxes(1, 2), want) < 2e-2, (dequantize, wgs, splits, defer_sum, fence)


@pytest.mark.parametrize("kind, impl", [("int8", "mosaic"), ("fp8", "auto")])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_paged_8bit_mosaic_layer_pages_and_padding_gpu(kind, impl, heads):
    """The engine's call: several queries of one sequence, a padding query (-1), layer-local page ids
    (16 heads: mla_decode_8bit_mgpu; 128: mla_decode_mgpu)."""
    from pallas_kernels.kv_quant import quantize_latent
    from pallas_kernels.mla_decode import mla_paged, mla_paged_reference

    rng = np.random.default_rng(11)
    _, _, c_kv, k_pe, tables, _ = _paged(rng, 3, heads, [300, 64, 1000])
    layer_pages = c_kv.shape[0] // 2
    seq_ids = jnp.asarray([0, 0, 2, 1, 2, 1], jnp.int32)
    positions = jnp.asarray([0, 299, 999, 63, 511, -1], jnp.int32)
    q = jnp.asarray(rng.standard_normal((6, heads, 512)), jnp.bfloat16)
    q_pe = jnp.asarray(rng.standard_normal((6, heads, 64)), jnp.bfloat16)
    stored, scale = quantize_latent(c_kv, kind, 1)
    local = jnp.where(tables >= layer_pages, tables - layer_pages, tables)  # layer 1 reads pages + layer_pages
    on_layer1 = local + layer_pages
    got = mla_paged(q, q_pe, stored, k_pe, local, seq_ids, positions, 0.1, c_kv_scale=scale, impl=impl,
                    layer=1, layer_pages=layer_pages)
    f32 = lambda a: a.astype(jnp.float32)
    want = mla_paged_reference(f32(q), f32(q_pe), stored, f32(k_pe), on_layer1, seq_ids, positions, 0.1, scale)
    assert not np.asarray(got[5], np.float32).any()  # padding: zeros
    assert _rel(np.asarray(got)[:5], np.asarray(want)[:5]) < 2e-2


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("uniform_pages", [False, True])
def test_mla_paged_two_pools_gpu(kind, uniform_pages):
    from pallas_kernels.kv_quant import quantize_latent
    from pallas_kernels.mla_decode import mla_paged, mla_paged_pools_reference

    rng = np.random.default_rng(5)
    layers, nf, nc, bs, heads = 2, 40, 60, 64, 16
    mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    full, k_pe = mk(layers * nf, bs, 512), mk(layers * (nf + nc), bs, 64)
    comp, comp_scale = quantize_latent(mk(layers * nc, bs, 512), kind, 1)
    tables = jnp.asarray(np.concatenate([rng.permutation(np.arange(nf, nf + nc))[:24].reshape(4, 6),
                                         rng.permutation(nf)[:8].reshape(4, 2)], axis=1), jnp.int32)
    seq_ids = jnp.arange(4, dtype=jnp.int32)
    positions = jnp.asarray([511, 400, 300, 450], jnp.int32)
    q, q_pe = mk(4, heads, 512), mk(4, heads, 64)
    compressed = (comp, comp_scale, jnp.int32(1))
    got = mla_paged(q, q_pe, full, k_pe, tables, seq_ids, positions, 0.1, compressed=compressed, pools=(nf, nc),
                    uniform_pages=uniform_pages)
    f32 = lambda a: a.astype(jnp.float32)
    want = mla_paged_pools_reference(f32(q), f32(q_pe), f32(full), f32(k_pe), tables, seq_ids, positions, 0.1,
                                     compressed, (nf, nc))
    assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("t, impl, blocks", [(300, "auto", {}), (512, "triton", {}), (512, "mosaic", {}),
                                              (640, "mosaic", dict(block_kv=128, stages=2)),
                                              (384, "mosaic", dict(block_kv=64, stages=3))])
def test_mla_prefill_gpu(t, impl, blocks):
    from pallas_kernels.mla_prefill import mla_prefill, mla_prefill_reference
    from pallas_kernels.mla_prefill_mgpu import mla_prefill_mgpu

    rng = np.random.default_rng(t)
    b, h = 2, 16
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    args = (mk(b, t, h, 128), mk(b, t, h, 64), mk(b, t, h, 128), mk(b, t, 64), mk(b, t, h, 128))
    got = mla_prefill_mgpu(*args, 0.07, **blocks) if blocks else mla_prefill(*args, 0.07, impl=impl)
    want = mla_prefill_reference(*[a.astype(jnp.float32) for a in args], 0.07)
    assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_pallas_matches_reference_f32(kv_cache_dtype):
    from dsjax import LLM, SamplingParams

    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=16, num_kv_blocks=256,
                  progress=False, kv_cache_dtype=kv_cache_dtype)
    prompts = [[5, 6, 7], list(range(10, 80)), [9], list(range(100, 140))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("reference", "pallas"):
        llm = LLM("tiny", dtype="float32", kernel_backend=backend, **engine)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["pallas"] == outs["reference"]


@pytest.mark.parametrize("q_lora_rank, norm_in_route, residual_in_sum",
                         [(None, True, True), (96, True, True), (None, False, True), (None, True, False)])
def test_paged_decode_pallas_matches_reference_gpu(q_lora_rank, norm_in_route, residual_in_sum, monkeypatch):
    """The paged forward with the decode kernels (f32, steps of 3 and 1 tokens after a 70-token chunk)
    against the reference backend, with a q LoRA and without (q_proj's split-K partials then go to
    write_latents unsummed, which finishes the queries too); norm_in_route: the 1-token step's MoE
    norm finished in the routing kernel (dispatch.ROUTER_NORM_IN_ROUTE, on as built) or by the
    stacked GEMV; residual_in_sum: its residual added by the experts' launch
    (MOE_DECODE_RESIDUAL_MAX_TOKENS, on as built); with the q LoRA the normed rows come from programs of
    their own (ROUTE_ROWS_PROGRAMS)."""
    import dataclasses

    from flax import nnx

    from dsjax.config import ModelConfig
    from dsjax.model import dispatch
    from dsjax.model.transformer import DeepseekForCausalLM
    from tests.model.test_model import _paged_logits

    monkeypatch.setattr(dispatch, "ROUTER_NORM_IN_ROUTE", norm_in_route)
    monkeypatch.setattr(dispatch, "MOE_DECODE_RESIDUAL_MAX_TOKENS", int(residual_in_sum))
    monkeypatch.setattr(dispatch, "ROUTE_ROWS_PROGRAMS", 4 if q_lora_rank else 0)  # the normed rows' own programs

    config = dataclasses.replace(ModelConfig.preset("tiny"), q_lora_rank=q_lora_rank)
    tokens = np.random.default_rng(0).integers(3, 259, size=74).astype(np.int32)
    logits = {backend: _paged_logits(DeepseekForCausalLM(config, kernel_backend=backend, rngs=nnx.Rngs(0)), tokens,
                                     [(0, 70), (70, 73), (73, 74)])
              for backend in ("reference", "pallas")}
    assert np.abs(logits["pallas"] - logits["reference"]).max() <= 1e-3 * np.abs(logits["reference"]).max()


def test_model_bf16_logits_pallas_vs_reference():
    import dsjax

    tokens = np.random.default_rng(1).integers(3, 259, (2, 64)).astype(np.int32)
    ref = np.asarray(dsjax.load_model("tiny", dtype="bfloat16", kernel_backend="reference").logits(tokens))
    for mode in ("expanded", "absorbed"):
        got = np.asarray(dsjax.load_model("tiny", dtype="bfloat16", kernel_backend="pallas").logits(tokens, mode=mode))
        # bf16 rounding differs between kernels and XLA and can flip a near-tied expert choice of the
        # random model for some tokens (every kernel alone agrees to ~2e-3, test above): most
        # positions must agree to bf16 accuracy.
        per_token = np.abs(got - ref).max(-1) / np.abs(ref).max()
        assert np.isfinite(got).all() and np.mean(per_token <= 0.05) >= 0.75, (mode, per_token)


def test_moe_kernels_gpu_v2_lite_shapes():
    from pallas_kernels.moe_experts import moe_experts, moe_experts_xla
    from pallas_kernels.moe_routing import RoutingSpec, route, route_reference
    from pallas_kernels.swiglu import swiglu, swiglu_reference

    rng = np.random.default_rng(0)
    t, d, e, i, k = 300, 2048, 64, 1408, 6
    x = jnp.asarray(rng.standard_normal((t, d)) * 0.5, jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
    spec = RoutingSpec(top_k=k, scoring_func="softmax", topk_method="greedy")
    weights, ids = route(logits, None, spec)
    ref_w, ref_ids = route_reference(logits, None, spec)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_w), rtol=1e-5)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.02, jnp.bfloat16)
    wg, wu, wd = w(e, d, i), w(e, d, i), w(e, i, d)
    got = moe_experts(x, weights, ids, wg, wu, wd)
    want = moe_experts_xla(x.astype(jnp.float32), weights, ids, wg.astype(jnp.float32), wu.astype(jnp.float32),
                           wd.astype(jnp.float32))
    assert _rel(got, want) < 2e-2
    wg2, wu2 = w(d, 10944), w(d, 10944)
    assert _rel(swiglu(x, wg2, wu2), swiglu_reference(x.astype(jnp.float32), wg2.astype(jnp.float32),
                                                      wu2.astype(jnp.float32))) < 2e-2


def test_moe_sort_and_prefill_tiles_gpu():
    """The expert sort's chunked path (T=8192: several chunks, two passes) exactly, and the layer at
    prefill tiles (192 rows per expert: 128-row tiles, 8 warps) with a skewed, uneven routing."""
    from pallas_kernels.moe_experts import moe_experts, moe_experts_xla
    from pallas_kernels.moe_sort import sort_by_expert, sort_by_expert_reference

    rng = np.random.default_rng(2)
    ids = jnp.asarray(np.argsort(rng.uniform(size=(8192, 64)), axis=1)[:, :6], jnp.int32)
    (order, sizes), (ref_order, ref_sizes) = sort_by_expert(ids, 64), sort_by_expert_reference(ids, 64)
    np.testing.assert_array_equal(np.asarray(order), np.asarray(ref_order))
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(ref_sizes))

    t, d, e, i, k = 2048, 2048, 64, 1408, 6
    popularity = np.exp(-0.05 * np.arange(e))
    ids = np.stack([rng.choice(e, k, replace=False, p=popularity / popularity.sum()) for _ in range(t)])
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, d)) * 0.5, jnp.bfloat16)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.02, jnp.bfloat16)
    wg, wu, wd = w(e, d, i), w(e, d, i), w(e, i, d)
    ids = jnp.asarray(ids, jnp.int32)
    got = moe_experts(x, weights, ids, wg, wu, wd)
    f32 = lambda a: a.astype(jnp.float32)
    assert _rel(got, moe_experts_xla(f32(x), weights, ids, f32(wg), f32(wu), f32(wd))) < 2e-2


def test_v3_routing_gpu():
    from pallas_kernels.moe_routing import RoutingSpec, route, route_reference

    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((1000, 256)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(256) * 0.1, jnp.float32)
    spec = RoutingSpec(top_k=8, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                       norm_topk_prob=True, routed_scaling_factor=2.5)
    weights, ids = route(logits, bias, spec)
    ref_w, ref_ids = route_reference(logits, bias, spec)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_w), rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_kernel_at_tiny_preset_dims(dtype):
    """The tiny preset's small dims (H=4, C=64, R=16, D=256, E=8) through each kernel vs its reference."""
    from pallas_kernels.mla_decode import mla_paged, mla_paged_reference
    from pallas_kernels.mla_prefill import mla_prefill, mla_prefill_reference
    from pallas_kernels.moe_experts import moe_experts, moe_experts_reference
    from pallas_kernels.moe_routing import RoutingSpec, route, route_reference
    from pallas_kernels.swiglu import swiglu, swiglu_reference

    rng = np.random.default_rng(7)
    mk = lambda *s, std=1.0: jnp.asarray(rng.standard_normal(s) * std, dtype)
    up = lambda a: a.astype(jnp.float32)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    errors = {}
    # decode / ragged paged: 5 tokens over 2 sequences in 4-token pages
    tables = jnp.asarray(rng.permutation(12).reshape(3, 4), jnp.int32)
    q, q_pe, c_kv, k_pe = mk(5, 4, 64), mk(5, 4, 16), mk(12, 4, 64), mk(12, 4, 16)
    seq_ids, pos = jnp.asarray([0, 1, 1, 1, 2], jnp.int32), jnp.asarray([9, 3, 4, 5, 0], jnp.int32)
    errors["mla_paged"] = _rel(mla_paged(q, q_pe, c_kv, k_pe, tables, seq_ids, pos, 0.2),
                               mla_paged_reference(up(q), up(q_pe), up(c_kv), up(k_pe), tables, seq_ids, pos, 0.2))
    pf = (mk(2, 64, 4, 32), mk(2, 64, 4, 16), mk(2, 64, 4, 32), mk(2, 64, 16), mk(2, 64, 4, 32))
    errors["mla_prefill"] = _rel(mla_prefill(*pf, 0.2), mla_prefill_reference(*map(up, pf), 0.2))
    x, wg, wu = mk(64, 256), mk(256, 512, std=0.05), mk(256, 512, std=0.05)
    errors["swiglu"] = _rel(swiglu(x, wg, wu), swiglu_reference(up(x), up(wg), up(wu)))
    logits = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(8) * 0.1, jnp.float32)
    spec = RoutingSpec(top_k=2, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                       norm_topk_prob=True, routed_scaling_factor=2.5)
    weights, ids = route(logits, bias, spec)
    ref_w, ref_ids = route_reference(logits, bias, spec)
    errors["route_ids_mismatch"] = float(np.mean(np.asarray(ids) != np.asarray(ref_ids)))
    ew = (mk(8, 256, 128, std=0.05), mk(8, 256, 128, std=0.05), mk(8, 128, 256, std=0.05))
    errors["moe_experts"] = _rel(moe_experts(x, ref_w, ref_ids, *ew),
                                 moe_experts_reference(up(x), ref_w, ref_ids, *map(up, ew)))
    print(dtype.__name__, errors)
    assert errors["route_ids_mismatch"] == 0
    assert all(v < tol for k, v in errors.items() if k != "route_ids_mismatch"), errors


@pytest.mark.parametrize("rows, depth, width", [(1, 2048, 3072), (16, 2048, 576), (4, 2048, 2048), (2, 1536, 24576)])
def test_stacked_gemv_gpu(rows, depth, width):
    """V2-Lite q_proj, kv_a_proj and o_proj, V3 q_b: one layer of the stack, read in place."""
    from pallas_kernels.stacked_gemv import stacked_gemv, stacked_gemv_reference

    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, depth, width)) * 0.02, jnp.bfloat16)
    got = stacked_gemv(x, w, jnp.int32(1))
    want = stacked_gemv_reference(x.astype(jnp.float32), w.astype(jnp.float32), 1)
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("rows", [1, 64])
def test_stacked_gemvs_fused_norm_gpu(rows):
    """V2-Lite's MoE decode launch: RMSNorm fused, the f32 router beside the shared experts' gate and
    up (different tile depths in one grid), and the normed rows handed on."""
    from dsjax.model.norms import rms_norm
    from pallas_kernels.stacked_gemv import stacked_gemv_reference, stacked_gemvs

    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 2048)) * 4, jnp.bfloat16)
    ws = (jnp.asarray(rng.standard_normal((3, 2048, 64)) * 0.02, jnp.float32),
          *(jnp.asarray(rng.standard_normal((3, 2048, 2816)) * 0.02, jnp.bfloat16) for _ in range(2)))
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal((3, 2048)), jnp.bfloat16)
    *got, normed = stacked_gemvs(x, ws, jnp.int32(2), norm, eps=1e-6)
    want = rms_norm(x, norm[2], 1e-6)
    assert _rel(normed, want) < 1e-2
    for g, w in zip(got, ws):
        assert _rel(g, stacked_gemv_reference(want.astype(jnp.float32), w.astype(jnp.float32), 2)) < 1e-2


@pytest.mark.parametrize("rows, heads", [(1, 16), (64, 16), (4, 128)])
@pytest.mark.parametrize("contract_rows", [True, False])
def test_stacked_head_gemv_gpu(rows, heads, contract_rows):
    """MLA's absorbed w_uv / w_uk at V2-Lite (16 heads) and V3 (128) shapes, one layer read in place."""
    from pallas_kernels.stacked_gemv import stacked_head_gemv, stacked_head_gemv_reference

    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((3, 512, heads, 128)) * 0.05, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, heads, 512 if contract_rows else 128)), jnp.bfloat16)
    got = stacked_head_gemv(x, w, jnp.int32(1), contract_rows=contract_rows)
    want = stacked_head_gemv_reference(x.astype(jnp.float32), w.astype(jnp.float32), 1, contract_rows=contract_rows)
    assert _rel(got, want) < 1e-2


def _v2_lite_experts(rng, tokens):
    """V2-Lite's MoE layer, stacks of 2 layers (read at layer 1), and ``tokens`` tokens' rows with their
    top-6 of 64: (x, weights, ids, routed (w_gate, w_up, w_down), shared)."""
    mk = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.03, jnp.bfloat16)
    experts = (mk(2, 64, 2048, 1408), mk(2, 64, 2048, 1408), mk(2, 64, 1408, 2048))
    shared = (mk(2, 2048, 2816), mk(2, 2048, 2816), mk(2, 2816, 2048))
    x = jnp.asarray(rng.standard_normal((tokens, 2048)), jnp.bfloat16)
    weights = jnp.asarray(rng.random((tokens, 6)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(64)[:6] for _ in range(tokens)]), jnp.int32)
    return x, weights, ids, experts, shared


@pytest.mark.parametrize("tokens", [1, 2])
def test_moe_decode_gpu(tokens):
    """One launch for V2-Lite's routed (top-6 of 64) and shared experts, one layer of the stacks in place
    (and with the residual added by each token's first program)."""
    from pallas_kernels.moe_decode import moe_decode, moe_decode_reference

    rng = np.random.default_rng(tokens)
    x, weights, ids, experts, shared = _v2_lite_experts(rng, tokens)
    got = moe_decode(x, weights, ids, *experts, jnp.int32(1), shared)
    up = lambda ws: tuple(w.astype(jnp.float32) for w in ws)
    want = moe_decode_reference(x.astype(jnp.float32), weights, ids, *up(experts), 1, up(shared))
    assert _rel(got, want) < 2e-2
    residual = jnp.asarray(rng.standard_normal((tokens, 2048)), jnp.bfloat16)
    with_residual = moe_decode(x, weights, ids, *experts, jnp.int32(1), shared, residual)
    assert _rel(with_residual, want + residual.astype(jnp.float32)) < 2e-2


@pytest.mark.parametrize("empty_slot", [False, True])
def test_moe_decode_mgpu_gpu(empty_slot):
    """The TMA-fed Mosaic GPU expert launch at V2-Lite's one-token layer (routed top-6 of 64 and the shared
    experts, layer 1 of the stacks) against the reference and the Triton launch; an empty slot (id E)
    contributes nothing."""
    from pallas_kernels.moe_decode import moe_decode, moe_decode_reference
    from pallas_kernels.moe_decode_mgpu import moe_decode_mgpu, supports

    assert supports(2048, 1408, 2816, 1, jnp.bfloat16) is None
    rng = np.random.default_rng(11)
    x, weights, ids, experts, shared = _v2_lite_experts(rng, 1)
    if empty_slot:
        ids = ids.at[0, 2].set(64)
    got = moe_decode_mgpu(x, weights, ids, *experts, jnp.int32(1), shared)
    up = lambda ws: tuple(w.astype(jnp.float32) for w in ws)
    want = moe_decode_reference(x.astype(jnp.float32), weights, ids, *up(experts), 1, up(shared))
    assert got.shape == (1, 2048) and got.dtype == jnp.bfloat16
    assert _rel(got, want) < 2e-2
    assert _rel(got, moe_decode(x, weights, ids, *experts, jnp.int32(1), shared)) < 2e-2
    routed_only = moe_decode_mgpu(x, weights, ids, *experts, jnp.int32(1))
    assert _rel(routed_only, moe_decode_reference(x.astype(jnp.float32), weights, ids, *up(experts), 1)) < 2e-2
    residual = jnp.asarray(rng.standard_normal((1, 2048)), jnp.bfloat16)  # added where the partials are summed
    with_residual = moe_decode_mgpu(x, weights, ids, *experts, jnp.int32(1), shared, residual)
    assert _rel(with_residual, want + residual.astype(jnp.float32)) < 2e-2
    # in_place: every CTA adds its partial row into the residual by TMA; the f32 sum comes back unrounded
    for pdl in (False, True):  # and launched as a programmatic dependent of the launch before it
        in_place = jax.jit(lambda r: moe_decode_mgpu(x, weights, ids, *experts, jnp.int32(1), shared, r,
                                                     in_place=True, pdl=pdl))(residual.astype(jnp.float32))
        assert in_place.dtype == jnp.float32 and _rel(in_place, want + residual.astype(jnp.float32)) < 2e-2
        assert _rel(in_place.astype(jnp.bfloat16), with_residual) < 1e-2


def test_dense_mlp_through_the_expert_launch_gpu(monkeypatch):
    """dispatch.DENSE_MLP_MGPU: V2-Lite's dense layer-0 MLP (2048 -> 10944) at one token through the TMA-fed expert
    launch as a one-expert stack, against the stacked GEMVs' path and the f32 reference, residual added."""
    from flax import nnx

    from dsjax.model import dispatch
    from dsjax.model.moe import MLP
    from dsjax.model.transformer import LayerStack

    rng = np.random.default_rng(12)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.03, jnp.bfloat16)
    w_gate, w_up, w_down = mk(2, 2048, 10944), mk(2, 2048, 10944), mk(2, 10944, 2048)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal((2, 2048)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, 2048)), jnp.bfloat16)
    mlp = MLP(2048, 64, jnp.bfloat16, nnx.Rngs(0))  # its own weights unused: decode reads the stacks
    stack = lambda ws: LayerStack(index=jnp.int32(1), attn={}, mlp=ws, experts=None, mlp_norm=norm, router=None)
    decode = lambda ws, backend: jax.jit(lambda x: mlp.decode(x, stack(ws), 1e-6, backend, add_residual=True))(x)
    up = tuple(w.astype(jnp.float32) for w in (w_gate, w_up, w_down))
    want = decode(up, "reference")
    monkeypatch.setattr(dispatch, "DENSE_MLP_MGPU", False)
    assert not dispatch.dense_mlp_mgpu_takes(x, w_gate, "pallas")
    gemvs = decode((w_gate, w_up, w_down), "pallas")
    monkeypatch.setattr(dispatch, "DENSE_MLP_MGPU", True)
    assert dispatch.dense_mlp_mgpu_takes(x, w_gate, "pallas")
    got = decode((w_gate, w_up, w_down), "pallas")
    assert got.shape == (1, 2048) and got.dtype == jnp.bfloat16
    assert _rel(got, want) < 2e-2 and _rel(got, gemvs) < 2e-2


def test_route_finishes_the_norm_gpu():
    """V2-Lite's router at one token with the MoE norm finished in the routing kernel: the summed
    products of x * g with the row's sum of squares last (64 + 1 columns), 2048-wide normed rows, written
    by the routing program or by 4 / 16 programs of their own."""
    from pallas_kernels.moe_routing import NormRows, RoutingSpec, route, route_norm_reference

    rng = np.random.default_rng(3)
    spec = RoutingSpec(top_k=6)
    for tokens, rows_programs in itertools.product((1, 2), (0, 4, 16)):
        x = jnp.asarray(rng.standard_normal((tokens, 2048)) * 4, jnp.bfloat16)
        norm = jnp.asarray(1 + 0.1 * rng.standard_normal((3, 2048)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((2048, 64)) * 0.05, jnp.float32)
        x32 = x.astype(jnp.float32)
        logits = jnp.concatenate([(x32 * norm[1].astype(jnp.float32)) @ w, jnp.sum(x32 * x32, -1, keepdims=True)], -1)
        rows = NormRows(x, norm, jnp.int32(1))
        got = route(logits, None, spec, norm_rows=rows, norm_eps=1e-6, rows_programs=rows_programs)
        want = route_norm_reference(logits, None, spec, rows, 1e-6)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        assert _rel(got[0], want[0]) < 1e-4 and _rel(got[2], want[2]) < 1e-2


def test_write_latents_gpu():
    """kv_a_norm + rope + both cache writes in one launch at V2-Lite's widths (512 + 64, bf16 pools),
    in place, a padding slot dropped."""
    from pallas_kernels.latent_write import write_latents, write_latents_reference

    rng = np.random.default_rng(0)
    pools = lambda: (jnp.asarray(rng.standard_normal((3, 8, 64, 512)), jnp.bfloat16),
                     jnp.asarray(rng.standard_normal((3, 8, 64, 64)), jnp.bfloat16))
    kv = jnp.asarray(rng.standard_normal((4, 576)) * 3, jnp.float32)
    slots, positions = jnp.asarray([3, 70, 511, 8 * 64], jnp.int32), jnp.asarray([3, 900, 4000, 0], jnp.int32)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal((2, 512)), jnp.bfloat16)
    inv_freq = tuple(float(f) for f in 1.0 / 10000 ** (np.arange(0, 64, 2) / 64))
    options = dict(eps=1e-6, inv_freq=inv_freq, cos_sin_scale=1.0, interleave=True)
    c_kv, k_pe = pools()
    want = write_latents_reference(c_kv, k_pe, kv, slots, positions, 1, norm, 1, **options)
    got = write_latents(c_kv, k_pe, kv, slots, positions, jnp.int32(1), norm, jnp.int32(1), **options)
    blocks, offsets = np.asarray(slots[:3]) // 64, np.asarray(slots[:3]) % 64
    for g, w in zip(got, want):
        assert _rel(g[1, blocks, offsets], w[1, blocks, offsets]) < 1e-2  # the written rows
        assert _rel(g, w) < 1e-4  # and nothing else moved


def test_store_rows_gpu():
    """The step kernel's 26 rows (f32, as it returns them) into V2-Lite-wide bf16 pools of 27 layers at one slot,
    in place: exactly the reference's pools, and nothing stored for a slot past the pools."""
    from pallas_kernels.latent_write import store_rows, store_rows_reference

    rng = np.random.default_rng(0)
    pools = lambda: (jnp.asarray(np.random.default_rng(1).standard_normal((27, 8, 64, 512)), jnp.bfloat16),
                     jnp.asarray(np.random.default_rng(2).standard_normal((27, 8, 64, 64)), jnp.bfloat16))
    rows = jnp.asarray(rng.standard_normal((26, 576)), jnp.float32)
    for slot, written in ((3 * 64 + 17, True), (8 * 64, False)):
        want = store_rows_reference(*pools(), rows, jnp.int32(slot))
        got = store_rows(*pools(), rows, jnp.int32(slot))
        for g, w, old in zip(got, want, pools()):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
            assert np.array_equal(np.asarray(g, np.float32), np.asarray(old, np.float32)) != written


@pytest.mark.parametrize("absorb, tokens", [(False, 2), (True, 2), (True, 1)])
def test_write_latents_with_query_partials_gpu(absorb, tokens):
    """V2-Lite's first attention launch's output as it leaves stacked_gemvs (16 split-K partials of
    q: 16 heads x 192, and of kv_a: 576, with the rows' sums of squares) finished by write_latents:
    the latents written, q_nope (or, absorbed through W_UK, q_latent) and the rotated q_pe returned
    (absorbed at one token: 8 programs a head, at two: 4)."""
    from pallas_kernels.latent_write import write_latents, write_latents_reference

    rng = np.random.default_rng(1)
    splits = 16
    c_kv = jnp.asarray(rng.standard_normal((3, 8, 64, 512)), jnp.bfloat16)
    k_pe = jnp.asarray(rng.standard_normal((3, 8, 64, 64)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((splits * tokens, 576)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((splits * tokens, 16 * 192)), jnp.float32)
    squares = jnp.asarray(rng.uniform(10, 100, splits * tokens), jnp.float32)
    slots, positions = jnp.asarray([3, 300][:tokens], jnp.int32), jnp.asarray([3, 900][:tokens], jnp.int32)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal((2, 512)), jnp.bfloat16)
    options = dict(eps=1e-6, inv_freq=tuple(float(f) for f in 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)),
                   cos_sin_scale=1.0, interleave=True, squares=squares, row_rms=(2048, 1e-6), q=q, q_heads=(16, 128))
    if absorb:
        options["w_uk"] = jnp.asarray(rng.standard_normal((2, 512, 16, 128)) * 0.05, jnp.bfloat16)
    want = write_latents_reference(c_kv, k_pe, kv, slots, positions, 1, norm, 1, **options)
    got = write_latents(c_kv, k_pe, kv, slots, positions, jnp.int32(1), norm, jnp.int32(1), **options)
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-2


@pytest.mark.parametrize("layers, depth", [(1, 512), (4, 2048)])
def test_gemv_chain_gpu(layers, depth):
    """The step kernel's GEMV phase: a chain of dependent D x D GEMVs in one persistent kernel (split-K sums by
    TMA adds, a grid barrier a layer) against the jnp chain with f32 sums, each layer rounded to bf16."""
    from pallas_kernels.decode_step_mgpu import gemv_chain, gemv_chain_reference, supports

    assert supports(depth, layers, jnp.bfloat16) is None
    rng = np.random.default_rng(depth)
    x = jnp.asarray(rng.standard_normal(depth), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((layers, depth, depth)) / np.sqrt(depth), jnp.bfloat16)
    got = gemv_chain(x, w)
    assert got.shape == (depth,) and got.dtype == jnp.bfloat16
    assert _rel(got, gemv_chain_reference(x, w)) < 2e-2
    # again: the semaphore was left at zero (the TMA adds' order may differ: not bitwise)
    assert _rel(gemv_chain(x, w), gemv_chain_reference(x, w)) < 2e-2


@pytest.mark.parametrize("layers, empty_slot, plan", [(1, False, "tiles"), (3, True, "tiles"), (1, False, "dealt"),
                                                      (3, True, "dealt"), (3, True, "split")])
def test_moe_chain_gpu(layers, empty_slot, plan, monkeypatch):
    """The step kernel's expert phase: V2-Lite's one-token layer shape (top-6 of 16 experts here, 2 shared
    experts), a chain of layers in one persistent kernel (each CTA's partial rows added by TMA, the residual
    once, a grid barrier a layer), its tiles whole a CTA, dealt evenly (h through global memory and a flag) or
    split (44 tiles' gate / up in 3 K ranges, partial sums through global memory), against the reference
    chain; an empty slot (id E) contributes nothing."""
    import jax

    from pallas_kernels import decode_step_moe
    from pallas_kernels.decode_step_moe import moe_chain, moe_chain_reference, moe_supports

    monkeypatch.setattr(decode_step_moe, "EXPERT_PLAN", plan)
    assert moe_supports(2048, 1408, 2816, layers, jnp.bfloat16) is None
    keys = iter(jax.random.split(jax.random.key(layers), 8))
    w = lambda *s: (jax.random.normal(next(keys), s, jnp.float32) / np.sqrt(s[-2])).astype(jnp.bfloat16)
    x = jax.random.normal(next(keys), (2048,), jnp.float32).astype(jnp.bfloat16)
    routed = (w(layers, 16, 2048, 1408), w(layers, 16, 2048, 1408), w(layers, 16, 1408, 2048))
    shared = (w(layers, 2048, 2816), w(layers, 2048, 2816), w(layers, 2816, 2048))
    rng = np.random.default_rng(layers)
    ids = np.stack([rng.permutation(16)[:6] for _ in range(layers)]).astype(np.int32)
    if empty_slot:
        ids[-1, 2] = 16
    weights = jnp.asarray(rng.random((layers, 6)), jnp.float32)
    got = moe_chain(x, weights, jnp.asarray(ids), *routed, shared)
    assert got.shape == (2048,) and got.dtype == jnp.bfloat16
    assert _rel(got, moe_chain_reference(x, weights, jnp.asarray(ids), *routed, shared)) < 2e-2


@pytest.mark.parametrize("plan, router_dtype", [("tiles", "float32"), ("dealt", "float32"), ("dealt", "bfloat16"),
                                                ("split", "float32")])
def test_moe_block_chain_gpu(plan, router_dtype, monkeypatch):
    """The MoE half of two V2-Lite layers in one persistent kernel (RMSNorm, the router's products on 16 CTAs
    from its boxes, f32 weights as two bf16 parts, softmax top-6 routing in every CTA, the experts with the
    shared tiles first) against the reference chain: the same experts chosen, their weights, the output."""
    import jax

    from pallas_kernels import decode_step_moe
    from pallas_kernels.decode_step_moe import RouterSpec, moe_block_chain, moe_block_chain_reference, moe_supports

    monkeypatch.setattr(decode_step_moe, "EXPERT_PLAN", plan)
    layers = 2
    assert moe_supports(2048, 1408, 2816, layers, jnp.bfloat16, router=True, num_experts=64, top_k=6) is None
    keys = iter(jax.random.split(jax.random.key(7), 10))
    w = lambda *s: (jax.random.normal(next(keys), s, jnp.float32) / np.sqrt(s[-2])).astype(jnp.bfloat16)
    x = jax.random.normal(next(keys), (2048,), jnp.float32).astype(jnp.bfloat16)
    norm = (1 + jax.random.uniform(next(keys), (layers, 2048)) / 4).astype(jnp.bfloat16)
    router = (jax.random.normal(next(keys), (layers, 2048, 64), jnp.float32) / np.sqrt(2048)).astype(router_dtype)
    experts = (w(layers, 64, 2048, 1408), w(layers, 64, 2048, 1408), w(layers, 64, 1408, 2048))
    shared = (w(layers, 2048, 2816), w(layers, 2048, 2816), w(layers, 2816, 2048))
    spec = RouterSpec(1e-6)
    got, ids, weights = moe_block_chain(x, norm, router, spec, 6, *experts, shared)
    want, want_ids, want_weights = moe_block_chain_reference(x, norm, router, spec, 6, *experts, shared)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    # layer 0 routes the same input as the reference; layer 1 routes the kernel's own layer-0 output, which
    # differs from the reference's by the experts' rounding (measured: 0.45% in a weight)
    np.testing.assert_allclose(np.asarray(weights[0]), np.asarray(want_weights[0]), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(weights[1:]), np.asarray(want_weights[1:]), rtol=2e-2)
    assert got.shape == (2048,) and _rel(got, want) < 2e-2


@pytest.mark.parametrize("plan", ["dealt", "split"])
def test_moe_layer_tail_chain_gpu(plan, monkeypatch):
    """Two V2-Lite layers from the attention output on in one persistent kernel (o_proj by TMA adds, a grid
    barrier, then the MoE half) against the reference chain: the same experts chosen, their weights, the
    output."""
    import jax

    from pallas_kernels import decode_step_moe
    from pallas_kernels.decode_step_moe import (RouterSpec, moe_layer_tail_chain, moe_layer_tail_chain_reference,
                                                moe_supports)

    monkeypatch.setattr(decode_step_moe, "EXPERT_PLAN", plan)
    layers = 2
    assert moe_supports(2048, 1408, 2816, layers, jnp.bfloat16, router=True, num_experts=64, top_k=6,
                        attention=2048) is None
    keys = iter(jax.random.split(jax.random.key(11), 12))
    w = lambda *s: (jax.random.normal(next(keys), s, jnp.float32) / np.sqrt(s[-2])).astype(jnp.bfloat16)
    x = jax.random.normal(next(keys), (2048,), jnp.float32).astype(jnp.bfloat16)
    attn = jax.random.normal(next(keys), (layers, 2048), jnp.float32).astype(jnp.bfloat16)
    o_proj = w(layers, 2048, 2048)
    norm = (1 + jax.random.uniform(next(keys), (layers, 2048)) / 4).astype(jnp.bfloat16)
    router = jax.random.normal(next(keys), (layers, 2048, 64), jnp.float32) / np.sqrt(2048)
    experts = (w(layers, 64, 2048, 1408), w(layers, 64, 2048, 1408), w(layers, 64, 1408, 2048))
    shared = (w(layers, 2048, 2816), w(layers, 2048, 2816), w(layers, 2816, 2048))
    spec = RouterSpec(1e-6)
    got, ids, weights = moe_layer_tail_chain(x, attn, o_proj, norm, router, spec, 6, *experts, shared)
    want, want_ids, want_weights = moe_layer_tail_chain_reference(x, attn, o_proj, norm, router, spec, 6, *experts,
                                                                  shared)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    # layer 0 routes x + o_proj's sums, rounded to bf16 in both; later layers the kernel's own outputs
    np.testing.assert_allclose(np.asarray(weights[0]), np.asarray(want_weights[0]), rtol=1e-3)
    np.testing.assert_allclose(np.asarray(weights[1:]), np.asarray(want_weights[1:]), rtol=2e-2)
    assert got.shape == (2048,) and _rel(got, want) < 2e-2


@pytest.mark.parametrize("position, merge_group, rope_in_kernel", [
    (0, 8, False), (63, 8, False), (200, 8, False), (511, 8, False), (511, 4, False), (200, 2, False), (200, 16, False),
    (511, 32, False), (0, 8, True), (200, 8, True), (511, 8, True)])
def test_attention_chain_gpu(position, merge_group, rope_in_kernel, monkeypatch):
    """Two V2-Lite attention halves at one token in one persistent kernel (norm, q / kv_a, W_UK, rope, the paged
    context in 64-token chunks plus the new token, the states merged ``MERGE_GROUP`` at a time, W_UV, o_proj,
    the residual) against the reference chain: each layer's new cache row, and the output. ``ROPE_IN_KERNEL``: the
    rope CTA computes cos and sin from the position itself."""
    import jax

    from benchmarks.megakernel_probe import attention_inputs
    from pallas_kernels import decode_step_attention
    from pallas_kernels.decode_step_attention import attention_chain, attention_chain_reference, attention_supports

    monkeypatch.setattr(decode_step_attention, "MERGE_GROUP", merge_group)
    monkeypatch.setattr(decode_step_attention, "ROPE_IN_KERNEL", rope_in_kernel)

    x, pos, table, c_kv, k_pe, weights, spec = attention_inputs(2, position)
    assert attention_supports(2048, 16, (128, 64, 512, 128), 64, 512, jnp.bfloat16, 2) is None
    got, kv = jax.jit(lambda *a, w: attention_chain(*a, w, spec))(x, pos, table, c_kv, k_pe, w=weights)
    want, want_kv = jax.jit(lambda *a, w: attention_chain_reference(*a, w, spec))(x, pos, table, c_kv, k_pe, w=weights)
    assert _rel(kv[0], want_kv[0]) < 1e-2  # layer 0's rows come from the same input
    assert _rel(kv, want_kv) < 2e-2 and _rel(got, want) < 2e-2


@pytest.mark.parametrize("position", [0, 200])
def test_attention_chain_reads_its_cache_layer_gpu(position):
    """One attention half whose cache is layer 1 of two (``cache_layer``, as the engine's dense layer after the MoE
    stack; cache layer 0 holds other values), its output also normed for the next sublayer (``out_norm``), against
    the reference on the same layer."""
    import jax

    from benchmarks.megakernel_probe import attention_inputs
    from pallas_kernels.decode_step_attention import AttentionWeights, attention_chain, attention_chain_reference

    x, pos, table, c_kv, k_pe, weights, spec = attention_inputs(2, position)
    last = AttentionWeights(*(w[1:] for w in weights))
    g = jnp.asarray(1 + np.random.default_rng(8).random(2048) / 4, jnp.float32)  # the MLP's norm after it
    run = lambda fn: jax.jit(lambda *a, w: fn(*a, w, spec, cache_layer=1, out_norm=(g, 1e-6)))(
        x, pos, table, c_kv, k_pe, w=last)
    got, kv, normed = run(attention_chain)
    want, want_kv, want_normed = run(attention_chain_reference)
    assert kv.shape == (1, 576) and _rel(kv, want_kv) < 1e-2 and _rel(got, want) < 2e-2
    assert normed.dtype == jnp.bfloat16 and _rel(normed, want_normed) < 2e-2
    # x_L in f32 (dispatch.DENSE_MLP_IN_PLACE's accumulator): its bf16 values
    got32 = jax.jit(lambda *a, w: attention_chain(*a, w, spec, cache_layer=1, out_norm=(g, 1e-6),
                                                  residual_dtype=jnp.float32))(x, pos, table, c_kv, k_pe, w=last)[0]
    assert got32.dtype == jnp.float32 and _rel(got32, want) < 2e-2
    np.testing.assert_array_equal(np.asarray(got32), np.asarray(got32.astype(jnp.bfloat16).astype(jnp.float32)))
    # the token's row read from the embedding table by the kernel (dispatch.STEP_KERNEL_EMBEDDING): x as token 5's
    # row gives x's outputs; an id past the table NaN, as the model's lookup
    embedding = jnp.asarray(np.random.default_rng(9).standard_normal((1000, 2048)), jnp.bfloat16).at[5].set(x)
    by_id = jax.jit(lambda token, *a, w: attention_chain(token, *a, w, spec, cache_layer=1, out_norm=(g, 1e-6),
                                                         embedding=embedding))
    got_id, kv_id, normed_id = by_id(jnp.int32(5), pos, table, c_kv, k_pe, w=last)
    assert _rel(got_id, want) < 2e-2 and _rel(kv_id, want_kv) < 1e-2 and _rel(normed_id, want_normed) < 2e-2
    assert np.isnan(np.asarray(by_id(jnp.int32(1000), pos, table, c_kv, k_pe, w=last)[0], np.float32)).all()


def _whole_layers(fn, spec, final_norm: bool = False):
    """``fn`` (``moe_layer_chain`` or its reference) jitted over the whole layers' inputs (``layer_inputs``' order,
    spec left out; with ``final_norm`` the final norm's weights g after them), the weights as arguments: closed
    over, their 2.3 GB are constants that take the compile minutes."""
    import jax

    from pallas_kernels.decode_step_moe import RouterSpec

    def call(x, pos, table, c_kv, k_pe, attention, norm, router, routed, shared, g=None):
        return fn(x, pos, table, c_kv, k_pe, attention, spec, norm, router, RouterSpec(1e-6), 6, *routed, shared,
                  **({"final_norm": (g, 1e-6)} if final_norm else {}))

    return jax.jit(call)


@pytest.mark.parametrize("position", [0, 200])
def test_moe_layer_chain_gpu(position):
    """Two whole V2-Lite layers at one token in one persistent kernel (the attention phases, o_proj, the MoE
    half) against the reference layers: each layer's new cache row, layer 0's routing, the output."""
    from benchmarks.megakernel_probe import layer_inputs
    from pallas_kernels.decode_step_moe import moe_layer_chain, moe_layer_chain_reference

    x, pos, table, c_kv, k_pe, attention, spec, norm, router, routed, shared = layer_inputs(2, position)
    operands = (x, pos, table, c_kv, k_pe, attention, norm, router, routed, shared)
    call = lambda fn: _whole_layers(fn, spec)(*operands)
    got, ids, weights, kv = call(moe_layer_chain)
    want, want_ids, want_weights, want_kv = call(moe_layer_chain_reference)
    assert _rel(kv[0], want_kv[0]) < 1e-2  # layer 0's rows come from the same input
    # The router reads the attention half's bf16 output, summed in another order than the reference's: two
    # experts within a rounding of each other may swap places (seen on the H200), so compare id-sorted pairs.
    mine, theirs = np.argsort(np.asarray(ids[0])), np.argsort(np.asarray(want_ids[0]))
    np.testing.assert_array_equal(np.asarray(ids[0])[mine], np.asarray(want_ids[0])[theirs])
    np.testing.assert_allclose(np.asarray(weights[0])[mine], np.asarray(want_weights[0])[theirs], rtol=2e-2)
    assert _rel(kv, want_kv) < 2e-2 and _rel(got, want) < 3e-2
    # the model's final norm in the kernel's tail (CTA 0 after the last layer), against the reference's
    g = jnp.asarray(1 + np.random.default_rng(7).random(2048) / 4, jnp.float32)
    final = lambda fn: _whole_layers(fn, spec, final_norm=True)(*operands, g)
    normed, want_normed = final(moe_layer_chain)[0], final(moe_layer_chain_reference)[0]
    assert normed.dtype == jnp.bfloat16 and _rel(normed, want_normed) < 3e-2


def test_moe_layer_chain_repeated_gpu():
    """The whole layers' grid barriers and flags order every read after the writes it needs: a reader that saw a
    count before the rows it covers would read partial sums (a K range, a CTA's output row missing), tens of percent
    off in the elements they feed, in some calls only. Two whole layers at a 201-token context, 40 calls of the kernel
    on the same inputs: each call's new cache rows and output against the reference, and the elements of layer 0's
    rows (the same inputs in every call) that differ from the first call's by more than a few roundings (none).
    Round 44 sent the signals after TMA copies as relaxed adds: this test failed in one of two runs, and the
    model's one-token steps (``test_one_token_steps_through_the_step_kernel_gpu``) in both."""
    from benchmarks.megakernel_probe import layer_inputs
    from pallas_kernels.decode_step_moe import moe_layer_chain, moe_layer_chain_reference

    x, pos, table, c_kv, k_pe, attention, spec, norm, router, routed, shared = layer_inputs(2, 200)
    operands = (x, pos, table, c_kv, k_pe, attention, norm, router, routed, shared)
    want, _, _, want_kv = _whole_layers(moe_layer_chain_reference, spec)(*operands)
    kernel = _whole_layers(moe_layer_chain, spec)
    first = None
    for call in range(40):
        got, _, _, kv = kernel(*operands)
        assert _rel(kv, want_kv) < 2e-2 and _rel(got, want) < 3e-2, call
        row0 = np.asarray(kv[0], np.float32)
        if first is None:
            first = row0
        off = np.abs(row0 - first) > 0.02 * np.abs(first) + 0.02 * np.sqrt(np.mean(first ** 2))
        assert not off.any(), (call, int(off.sum()))


def test_one_token_steps_through_the_step_kernel_gpu(monkeypatch):
    """A random V2-Lite-shaped model (bf16; a dense layer and 2 MoE layers): a 70-token prompt prefilled, then
    three one-token steps whose MoE stack runs as one persistent kernel (dispatch.STEP_KERNEL), with the dense
    layer's attention half as a kernel too or not (dispatch.STEP_KERNEL_DENSE_ATTENTION) and the final norm in the
    kernel's tail or not (dispatch.STEP_KERNEL_FINAL_NORM), then also the rope's cos and sin computed in both kernels
    (decode_step_attention.ROPE_IN_KERNEL), the dense MLP's expert launch adding into the attention kernel's f32
    output in place (dispatch.DENSE_MLP_IN_PLACE) and the token's embedding row read by the attention kernel
    (dispatch.STEP_KERNEL_EMBEDDING), the three kernels launched as programmatic dependents (dispatch.STEP_KERNEL_PDL),
    give the logits of the launches a layer. As built every knob but PDL is on (session 52)."""
    import dataclasses

    from dsjax.config import ModelConfig
    from dsjax.model import dispatch
    from dsjax.model.transformer import random_model
    from pallas_kernels import decode_step_attention, decode_step_moe
    from tests.model.test_model import _paged_logits

    config = dataclasses.replace(ModelConfig.preset("deepseek-v2-lite"), num_hidden_layers=3)
    tokens = np.random.default_rng(5).integers(3, 1000, size=73).astype(np.int32)
    chunks = [(0, 70), (70, 71), (71, 72), (72, 73)]
    calls = []
    chain = decode_step_moe.moe_layer_chain
    monkeypatch.setattr(decode_step_moe, "moe_layer_chain", lambda *a, **k: calls.append(1) or chain(*a, **k))
    dense_calls = []
    dense_chain = decode_step_attention.attention_chain
    monkeypatch.setattr(decode_step_attention, "attention_chain",
                        lambda *a, **k: dense_calls.append(k["cache_layer"]) or dense_chain(*a, **k))
    logits = {}
    # the third with the final norm in the kernel too, the fourth with session 51's four (rope, MLP, embedding, PDL)
    for on, dense, rope in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        monkeypatch.setattr(dispatch, "STEP_KERNEL", on)
        monkeypatch.setattr(dispatch, "STEP_KERNEL_DENSE_ATTENTION", dense)
        monkeypatch.setattr(dispatch, "STEP_KERNEL_FINAL_NORM", dense)
        monkeypatch.setattr(decode_step_attention, "ROPE_IN_KERNEL", rope)
        monkeypatch.setattr(dispatch, "DENSE_MLP_IN_PLACE", rope)
        monkeypatch.setattr(dispatch, "STEP_KERNEL_EMBEDDING", rope)
        monkeypatch.setattr(dispatch, "STEP_KERNEL_PDL", rope)
        model = random_model(config, dtype="bfloat16", kernel_backend="pallas", seed=1)
        assert model.prepare_step_kernel() is None
        logits[on, dense, rope] = _paged_logits(model, tokens, chunks, block_size=64, num_blocks=8,
                                                cache_dtype=jnp.bfloat16)
    assert calls and set(dense_calls) == {config.num_moe_layers}  # the one-token steps took the kernels
    for on in ((True, False, False), (True, True, False), (True, True, True)):
        assert _rel(logits[on][-3:], logits[False, False, False][-3:]) < 3e-2


def test_engine_greedy_steps_in_one_program_gpu(monkeypatch):
    """runner.GREEDY_IN_FORWARD: an engine over a random V2-Lite-shaped model (bf16; a dense layer and 2 MoE layers)
    whose one-token steps run the step kernel compiles bucket 1's forward with the greedy sampler inside; a greedy
    request after a 70-token prompt gives the tokens of the two programs a step."""
    import dataclasses

    from dsjax import LLM, SamplingParams
    from dsjax.config import ModelConfig
    from dsjax.engine import llm as llm_module
    from dsjax.engine import runner as runner_module
    from dsjax.model.transformer import random_model

    config = dataclasses.replace(ModelConfig.preset("deepseek-v2-lite"), num_hidden_layers=3)
    model = random_model(config, dtype="bfloat16", kernel_backend="pallas", seed=1)
    monkeypatch.setattr(llm_module, "load_model", lambda *args, **kwargs: model)
    prompt = np.random.default_rng(5).integers(3, 1000, size=70).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for on in (False, True):
        monkeypatch.setattr(runner_module, "GREEDY_IN_FORWARD", on)
        llm = LLM("deepseek-v2-lite", dtype="bfloat16", kernel_backend="pallas", max_num_seqs=1,
                  max_num_batched_tokens=128, max_model_len=256, block_size=64, num_kv_blocks=16, buckets=(1, 128),
                  enable_prefix_caching=False, progress=False)
        assert sorted(llm.engine.runner._greedy_forwards) == ([1] if on else [])
        tokens[on] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[True] == tokens[False]


def test_engine_multi_step_chunks_gpu(monkeypatch):
    """num_scheduler_steps=4 over a random V2-Lite-shaped model (bf16; a dense layer and 2 MoE layers) whose
    one-token steps run the step kernel: the chunk program runs the kernel 4 times a launch, each step's token
    the next one's input, and gives the tokens of single steps (a greedy request after a 70-token prompt, 10
    tokens: chunks of 4, 4 and 1 after the prefill's)."""
    import dataclasses

    from dsjax import LLM, SamplingParams
    from dsjax.config import ModelConfig
    from dsjax.engine import llm as llm_module
    from dsjax.model.transformer import random_model

    config = dataclasses.replace(ModelConfig.preset("deepseek-v2-lite"), num_hidden_layers=3)
    model = random_model(config, dtype="bfloat16", kernel_backend="pallas", seed=1)
    monkeypatch.setattr(llm_module, "load_model", lambda *args, **kwargs: model)
    prompt = np.random.default_rng(5).integers(3, 1000, size=70).tolist()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens, steps = {}, {}
    for chunk in (1, 4):
        llm = LLM("deepseek-v2-lite", dtype="bfloat16", kernel_backend="pallas", max_num_seqs=1,
                  max_num_batched_tokens=128, max_model_len=256, block_size=64, num_kv_blocks=16, buckets=(1, 128),
                  enable_prefix_caching=False, async_scheduling=True, num_scheduler_steps=chunk, progress=False)
        assert llm.engine.runner.runs_step_kernel(1)
        tokens[chunk] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        steps[chunk] = llm.engine.num_steps
    assert tokens[4] == tokens[1] and len(tokens[4]) == 10
    assert steps == {1: 10, 4: 4}
