"""full_precision_window: older blocks move to the 8-bit pool as sequences grow; the paged kernel over
both pools matches the reference in the engine; the moved blocks hold exactly the quantized latents."""

from __future__ import annotations

import numpy as np
import pytest

from dsjax import LLM, SamplingParams
from dsjax.config import ConfigError, EngineConfig
from dsjax.engine.llm_engine import kv_pool_sizes
from dsjax.loader import load_config
from pallas_kernels.kv_quant import quantize_latent

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4, buckets=(16,),
              enable_prefix_caching=False, progress=False)
PROMPTS = [list(range(10, 33)), [5, 6, 7], list(range(40, 52))]


def run(backend, **engine):
    llm = LLM("tiny", dtype="float32", kernel_backend=backend, **{**ENGINE, **engine})
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["int8"])  # fp8 pools: tests/pallas_kernels/test_kv_quant.py
def test_window_engine_kernels_match_reference_and_blocks_move(kv_cache_dtype):
    window = dict(kv_cache_dtype=kv_cache_dtype, full_precision_window=8, num_kv_blocks=40)
    ref_llm, ref = run("reference", **window)
    llm, out = run("interpret", **window)
    assert out == ref
    bm = llm.engine.block_manager
    # 40 blocks' worth of f32 memory: 4 x (2 + 2) + 16 / 4 = 20 full blocks, the rest 8-bit (tiny: 4 layers,
    # latent 64 + rope 32: 1280 bytes a token in f32, 528 with an int8 latent).
    assert llm.engine.runner.cache.pools == (bm.num_blocks_total, bm.num_compressed_blocks) == (20, 48)
    assert bm.num_blocks_compressed >= 8
    bm.check_invariants([])
    assert bm.num_compressed_blocks_free == bm.num_compressed_blocks  # all returned


def test_moved_blocks_hold_the_quantized_latents():
    """Layer 0's latents depend only on the tokens: the compressed pool must hold exactly
    quantize(full-precision latents) of the prompt positions it received."""
    engine = dict(kv_cache_dtype="int8", full_precision_window=4, num_kv_blocks=40)
    llm = LLM("tiny", dtype="float32", kernel_backend="reference", **{**ENGINE, **engine})
    full = LLM("tiny", dtype="float32", kernel_backend="reference", **ENGINE)
    prompt = list(range(10, 33))  # 23 tokens: blocks 0..4 leave a 4-token window by the end of prefill
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for e in (llm.engine, full.engine):
        e.add_request("r", None, params, prompt_token_ids=prompt)
    llm.engine.step(), full.engine.step()  # first 16-token chunk: blocks 0..2 lie outside the window
    llm.engine.runner.compress(llm.engine.block_manager.take_pending_copies())  # as the next step() would first
    table = llm.engine.scheduler.running[0].block_table
    full_table = full.engine.scheduler.running[0].block_table
    moved = [i for i, block in enumerate(table) if block >= llm.engine.block_manager.num_blocks_total]
    assert moved == [0, 1, 2]
    cache, full_cache = llm.engine.runner.cache, full.engine.runner.cache
    for i in moved:
        expected, expected_scale = quantize_latent(full_cache.c_kv[0, full_table[i]], "int8", 1)
        slot = table[i] - llm.engine.block_manager.num_blocks_total
        np.testing.assert_array_equal(np.asarray(cache.c_kv_compressed[0, slot]), np.asarray(expected))
        np.testing.assert_allclose(np.asarray(cache.compressed_scale[0, slot]), np.asarray(expected_scale),
                                   rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(cache.k_pe[0, table[i]]), np.asarray(full_cache.k_pe[0, full_table[i]]))


def test_pool_split_and_validation():
    config = load_config("deepseek-v2-lite")
    engine = EngineConfig(kv_cache_dtype="int8", full_precision_window=512, num_kv_blocks=4096, max_num_seqs=64,
                          max_num_batched_tokens=2048)
    num_full, num_compressed = kv_pool_sizes(config, engine, "bfloat16")
    assert num_full == 64 * (8 + 2) + 32  # each sequence's window + 2 blocks, plus one step of new tokens
    assert num_compressed == (4096 - num_full) * 1152 // 644  # the rest of the budget, 8-bit
    assert kv_pool_sizes(config, engine.replace(full_precision_window=None), "bfloat16") == (4096, 0)
    small = kv_pool_sizes(config, engine.replace(num_kv_blocks=400), "bfloat16")  # less than the windows need
    assert small == (300, 100 * 1152 // 644)
    with pytest.raises(ConfigError, match="full_precision_window.*null unless kv_cache_dtype is int8 or fp8"):
        EngineConfig(full_precision_window=512)
    with pytest.raises(ConfigError, match="full_precision_window.*positive"):
        EngineConfig(kv_cache_dtype="fp8", full_precision_window=0)
