"""kv_cache_dtype int8 / fp8: the engine quantizes latents as it writes them and its kernels read the
8-bit pages; pool sizing counts the compressed bytes; bad settings are refused by name."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import LLM, SamplingParams
from dsjax.config import ConfigError, EngineConfig
from dsjax.engine.llm_engine import kv_cache_num_blocks
from dsjax.model.paged import PagedKVCache
from dsjax.serve.config import config_from_args

# One step shape (16 tokens): each compile of an interpret-mode step is seconds on CPU.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, buckets=(16,),
              progress=False)
PROMPTS = [[5, 6, 7], list(range(10, 31)), [9]]


# fp8 with 4 scale groups a token here; int8 per token runs through the same kernel in
# tests/engine/test_full_precision_window.py (two pools) and tests/pallas_kernels/test_kv_quant.py.
@pytest.mark.parametrize("kv_cache_dtype, group_size", [("fp8", 16)])
def test_quantized_engine_kernels_match_reference(kv_cache_dtype, group_size):
    """The paged kernel (interpret mode) over 8-bit pages gives the reference path's greedy tokens, with
    chunked prefill (16-token steps) re-reading earlier chunks from the quantized cache."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("reference", "interpret"):
        llm = LLM("tiny", dtype="float32", kernel_backend=backend, kv_cache_dtype=kv_cache_dtype,
                  kv_cache_group_size=group_size, **ENGINE)
        assert llm.engine.runner.cache.quantization == kv_cache_dtype
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.engine.block_manager.check_invariants()
    assert outs["interpret"] == outs["reference"]


def test_default_model_greedy_survives_8bit_caches():
    """On the trained default model an 8-bit cache changes the logits a little, not the argmax of the
    first steps; and the cache really holds 8-bit values with per-token scales."""
    engine = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128, block_size=16, num_kv_blocks=16,
                  buckets=(64,), progress=False)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = ["import os\n\n\ndef main(argv):\n    for name in"]
    tokens = {}
    for kind in ("auto", "int8", "fp8"):
        llm = LLM("default", dtype="float32", kv_cache_dtype=kind, **engine)
        tokens[kind] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        cache = llm.engine.runner.cache
        if kind != "auto":
            assert cache.c_kv.dtype.itemsize == 1 and cache.c_kv_scale.shape[-1] == 1
            assert np.count_nonzero(np.asarray(cache.c_kv.astype(np.float32))) > 0
    assert tokens["int8"][:4] == tokens["auto"][:4] and tokens["fp8"][:4] == tokens["auto"][:4]


def test_pool_sizing_counts_compressed_bytes():
    v2 = dsjax.load_config("deepseek-v2-lite")  # 27 layers, latent 512, rope 64
    bf16 = PagedKVCache.bytes_per_token(v2, "bfloat16")
    assert bf16 == 27 * 1152
    assert PagedKVCache.bytes_per_token(v2, "bfloat16", "int8") == 27 * (512 + 4 + 128)
    # DeepSeek's FP8 MLA layout: 512 fp8 + 4 f32 scales (one per 128) + 64 bf16 rope dims = 656 bytes.
    assert PagedKVCache.bytes_per_token(v2, "bfloat16", "fp8", 128) == 27 * 656
    memory = 1 << 30
    blocks = {kind: kv_cache_num_blocks(v2, EngineConfig(kv_cache_memory=memory, kv_cache_dtype=kind), "bfloat16")
              for kind in ("auto", "int8")}
    assert 1.75 < blocks["int8"] / blocks["auto"] < 1.8


def test_bad_kv_cache_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="kv_cache_dtype.*'int4'.*auto, int8, fp8"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="kv_cache_group_size.*null unless kv_cache_dtype is int8 or fp8"):
        EngineConfig(kv_cache_group_size=128)
    with pytest.raises(ConfigError, match="kv_cache_group_size.*power of two"):
        EngineConfig(kv_cache_dtype="fp8", kv_cache_group_size=96)
    with pytest.raises(ValueError, match="kv_cache_group_size=256 must divide kv_lora_rank=128"):
        LLM("default", dtype="float32", kv_cache_dtype="int8", kv_cache_group_size=256, **ENGINE)
    config = config_from_args(["--kv-cache-dtype", "fp8", "--kv-cache-group-size", "128"])
    assert (config.engine_config().kv_cache_dtype, config.engine_config().kv_cache_group_size) == ("fp8", 128)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_copy_blocks_moves_latents_scales_and_rope_keys(kv_cache_dtype):
    """Partial prefix hits copy a cached block into a fresh one: every array of every layer, and a
    padded pair (destination past the pool) is dropped."""
    config = dsjax.load_config("tiny")
    cache = PagedKVCache.zeros(config, 6, 4, "float32", kv_cache_dtype=kv_cache_dtype)
    rng = np.random.default_rng(0)
    fill = lambda a: None if a is None else jnp.asarray(rng.standard_normal(a.shape) * 10, a.dtype)
    cache = PagedKVCache(*(fill(a) for a in cache))
    copied = cache.copy_blocks(np.array([1, 4, 0], np.int32), np.array([3, 1, 6], np.int32))
    for before, after in zip(cache, copied):
        if before is None:
            continue
        before, after = np.asarray(before), np.asarray(after)
        # Sources are read before any write: block 1's old content lands in 3, block 4's in 1.
        np.testing.assert_array_equal(after[:, 3], before[:, 1])
        np.testing.assert_array_equal(after[:, 1], before[:, 4])
        np.testing.assert_array_equal(after[:, [0, 2, 4, 5]], before[:, [0, 2, 4, 5]])
    assert (copied.c_kv_scale is None) == (kv_cache_dtype == "auto")
