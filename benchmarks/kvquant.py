"""8-bit latent caches (kv_cache_dtype int8 / fp8) against the model's dtype: capacity, accuracy, speed.

    python -m benchmarks.kvquant                 # CPU: capacity + default-model accuracy (minutes)
    python -m benchmarks.kvquant --gpu-parts     # one H200: + V2-Lite logit error, kernel bandwidth,
                                                 #   decode throughput at the memory wall (~5 min)
    python -m benchmarks.kvquant --decode-sweep  # one H200: the decode kernel's tiles x dot operand dtypes

- capacity: concurrent sequences a fixed KV budget holds, computed from bytes per token and measured by
  running that many requests through the engine (the most that ran at once, and any preemptions).
- accuracy on the embedded default model: held-out perplexity with every context token read back from
  the cache (chunked paged forward), and greedy agreement over 256 generated tokens.
- GPU: V2-Lite (random weights) logit error of the paged forward; the paged decode kernel's effective
  bandwidth counted on the bytes it reads (compressed for 8-bit caches); engine decode throughput with
  the largest batch each cache dtype fits in the same KV budget (the memory wall).
Writes benchmarks/results/kvquant.json (or --out).
"""

from __future__ import annotations

import argparse
import functools
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import device_time_us, environment, markdown_table, write_result
from dsjax import EngineConfig, SamplingParams, load_model, load_tokenizer
from dsjax.engine.llm_engine import LLMEngine
from dsjax.model.paged import PagedBatch, PagedKVCache
from pallas_kernels.kv_quant import num_scale_groups, quantize_latent
from pallas_kernels.mla_decode import mla_decode, mla_paged, mosaic_why_not

FORMATS = [("auto", None), ("int8", None), ("fp8", None), ("fp8", 128)]  # (kv_cache_dtype, group size)
COPY_TBS = 4.27  # measured H200 device-to-device copy


# Distance-aware precision on the default model (trained on 512-token windows): the latest 128 tokens full.
WINDOWED = [("int8", None, 128), ("fp8", None, 128)]  # (kv_cache_dtype, group size, full_precision_window)


def label(kind: str, group: int | None, window: int | None = None) -> str:
    return kind + (f"/{group}" if group else "") + (f" + window {window}" if window else "")


def usable_formats(config, formats=FORMATS):
    """The formats that apply to this latent width (a group as wide as the latent is per-token: dropped)."""
    return [(k, g) for k, g in formats if g is None or (config.kv_lora_rank % g == 0 and g < config.kv_lora_rank)]


# ----- capacity ---------------------------------------------------------------------------------------
def capacity_rows(config, dtype: str, budget_bytes: int, context: int, block_size: int) -> list[dict]:
    blocks_per_seq = -(-context // block_size)
    rows = []
    for kind, group in usable_formats(config):
        per_token = PagedKVCache.bytes_per_token(config, dtype, kind, group)
        blocks = budget_bytes // (per_token * block_size)
        rows.append({"kv_cache_dtype": label(kind, group), "bytes_per_token": per_token,
                     "bytes_per_token_per_layer": per_token / config.num_hidden_layers,
                     "blocks": int(blocks), "max_seqs": int(blocks // blocks_per_seq)})
    for kind, group, window in [("int8", None, 512)]:  # distance-aware: the last 512 tokens (+ a block) full
        recent = min(context, window + block_size)
        per_seq = (recent * PagedKVCache.bytes_per_token(config, dtype)
                   + (context - recent) * PagedKVCache.bytes_per_token(config, dtype, kind, group))
        rows.append({"kv_cache_dtype": label(kind, group, window), "bytes_per_token": per_seq / context,
                     "bytes_per_token_per_layer": per_seq / context / config.num_hidden_layers,
                     "blocks": None, "max_seqs": int(budget_bytes // per_seq)})
    base = rows[0]["max_seqs"]
    for row in rows:
        row["capacity_x"] = row["max_seqs"] / base if base else float("nan")
    return rows


def measured_capacity(model, tokenizer, kind, group, budget_bytes: int, prompt: int, gen: int, block_size: int,
                      requests: int) -> dict:
    """Runs ``requests`` identical-length requests with that KV budget: how many ran at once at most."""
    config = EngineConfig(max_num_seqs=requests, max_num_batched_tokens=max(requests, 256), max_model_len=prompt + gen,
                          block_size=block_size, kv_cache_memory=budget_bytes, enable_prefix_caching=False,
                          kv_cache_dtype=kind, kv_cache_group_size=group, buckets=(max(requests, 256),))
    engine = LLMEngine(model, tokenizer, config, progress=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"c{i}", None, params, prompt_token_ids=rng.integers(3, 200, prompt).tolist())
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    engine.block_manager.check_invariants()
    return {"kv_cache_dtype": label(kind, group), "num_blocks": engine.num_blocks, "max_running": most,
            "preemptions": engine.scheduler.num_preemptions}


# ----- accuracy ---------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(2,))
def _paged_chunk(graphdef, state, cache, tokens, positions, table):
    model = nnx.merge(graphdef, state)
    block_size = cache.block_size
    slots = table[positions // block_size] * block_size + positions % block_size
    batch = PagedBatch(positions, slots, jnp.zeros_like(positions), table[None, :])
    hidden, cache = model.forward_paged(tokens, cache, batch)
    return cache, model.compute_logits(hidden)


def paged_logits(model, token_ids, kind: str, group: int | None, chunk: int = 64, block_size: int = 16,
                 window: int | None = None):
    """Logits f32[T, vocab] of one sequence run through the paged path in ``chunk``-token steps: every
    key but the chunk's own is read back from a ``kind`` cache, as in chunked prefill and decode. With
    ``window``, the cache keeps the model's dtype and blocks wholly older than the last ``window``
    tokens move to a ``kind`` pool after each chunk, as the engine's full_precision_window does."""
    num_tokens = len(token_ids)
    padded = -(-num_tokens // chunk) * chunk
    width = -(-padded // block_size)
    cache = PagedKVCache.zeros(model.config, width, block_size, model.dtype, kv_cache_dtype=kind, group_size=group,
                               num_compressed_blocks=width if window else 0)
    graphdef, state = nnx.split(model)
    tokens = np.zeros(padded, np.int32)
    tokens[:num_tokens] = token_ids
    table = np.arange(width, dtype=np.int32)
    out = []
    for start in range(0, padded, chunk):
        positions = jnp.arange(start, start + chunk, dtype=jnp.int32)
        # Tokens are written by position into the full pool: the table maps positions to (full) slots
        # for the write and, once a block moved, to its compressed copy for reading.
        cache, logits = _paged_chunk(graphdef, state, cache, jnp.asarray(tokens[start:start + chunk]), positions,
                                     jnp.asarray(table))
        out.append(np.asarray(logits, np.float32))
        if window:
            moved = [i for i in range(max(0, start + chunk - window) // block_size) if table[i] < width]
            if moved:
                cache = cache.compress_blocks(jnp.asarray(moved, jnp.int32), jnp.asarray(moved, jnp.int32) + width)
                table[moved] += width
    return np.concatenate(out)[:num_tokens]


def nll(logits: np.ndarray, token_ids) -> np.ndarray:
    """Next-token negative log-likelihoods f32[T-1]."""
    logits = logits[:-1].astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return logz - logits[np.arange(len(logits)), np.asarray(token_ids[1:])]


def heldout_windows(tokenizer, num_windows: int, window: int) -> list[list[int]]:
    """Windows of the default model's held-out stdlib modules (never trained on)."""
    from dsjax.loader import DEFAULT_MODEL, EMBEDDED_MODELS
    from dsjax.train.corpus import load_corpus, read_text
    import json

    summary = json.loads((EMBEDDED_MODELS[DEFAULT_MODEL] / "train_summary.json").read_text())
    corpus = load_corpus(tuple(summary["data"]["heldout_modules"]))
    ids = [t for path in corpus.heldout_files for t in tokenizer.encode(read_text(path))]
    step = max(window, (len(ids) - window) // max(1, num_windows - 1))
    return [ids[i:i + window] for i in range(0, len(ids) - window + 1, step)][:num_windows]


def accuracy_default_model(num_windows: int, window: int, gen_tokens: int, num_prompts: int,
                           kinds: tuple[str, ...] = ("auto", "int8", "fp8")) -> dict:
    model = load_model("default", dtype="float32", kernel_backend="auto", progress=False)
    tokenizer = load_tokenizer("default")
    windows = heldout_windows(tokenizer, num_windows, window)
    rows, reference_logits = [], None
    greedy = {}
    prompts = [w[:64] for w in windows[:num_prompts]]
    formats = [(k, g, w) for k, g, w in [(k, g, None) for k, g in usable_formats(model.config)] + WINDOWED
               if k in kinds]
    for kind, group, precision_window in formats:
        logits = [paged_logits(model, w, kind, group, window=precision_window) for w in windows]
        losses = np.concatenate([nll(lg, w) for lg, w in zip(logits, windows)])
        row = {"kv_cache_dtype": label(kind, group, precision_window), "heldout_tokens": int(losses.size),
               "heldout_loss": float(losses.mean()), "perplexity": float(np.exp(losses.mean()))}
        if reference_logits is None:
            reference_logits = logits
        else:
            err = max(np.abs(a - b).max() / np.abs(b).max() for a, b in zip(logits, reference_logits))
            row["max_rel_logit_error"] = float(err)
            row["top1_agreement"] = float(np.mean(np.concatenate(
                [a.argmax(-1) == b.argmax(-1) for a, b in zip(logits, reference_logits)])))
        # Twice the blocks the prompts need: no preemption, and room for both pools with a window.
        config = EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=256, max_model_len=64 + gen_tokens,
                              block_size=16, num_kv_blocks=2 * len(prompts) * (-(-(64 + gen_tokens) // 16)),
                              kv_cache_dtype=kind, kv_cache_group_size=group, buckets=(16, 256),
                              full_precision_window=precision_window)
        engine = LLMEngine(model, tokenizer, config, progress=False)
        params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), None, params, prompt_token_ids=p, final_only=True)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[int(out.request_id)] = out.outputs[0].token_ids
        greedy[label(kind, group, precision_window)] = [done[i] for i in range(len(prompts))]
        rows.append(row)
    base_ppl = rows[0]["perplexity"]
    for row in rows:
        row["perplexity_change_pct"] = (row["perplexity"] / base_ppl - 1) * 100
        runs = greedy[row["kv_cache_dtype"]]
        same = [np.asarray(a) == np.asarray(b) for a, b in zip(runs, greedy[rows[0]["kv_cache_dtype"]])]
        row["greedy_positionwise_agreement"] = float(np.mean(np.concatenate(same)))
        row["greedy_identical_prefix_mean"] = float(np.mean([np.argmin(s) if not s.all() else len(s) for s in same]))
    return {"model": "default", "windows": len(windows), "window": window, "greedy_prompts": len(prompts),
            "greedy_tokens": gen_tokens, "rows": rows}


# ----- GPU parts --------------------------------------------------------------------------------------
def v2lite_logit_error(model, num_tokens: int) -> list[dict]:
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, num_tokens).tolist()
    ref = paged_logits(model, ids, "auto", None, chunk=128, block_size=64)
    rows = []
    for kind, group in usable_formats(model.config)[1:]:
        out = paged_logits(model, ids, kind, group, chunk=128, block_size=64)
        rows.append({"kv_cache_dtype": label(kind, group), "tokens": num_tokens,
                     "max_rel_logit_error": float(np.abs(out - ref).max() / np.abs(ref).max()),
                     "mean_abs_logit_error": float(np.abs(out - ref).mean()),
                     "top1_agreement": float(np.mean(out.argmax(-1) == ref.argmax(-1)))})
    return rows


def _full_cache(config, batch: int, context: int, block_size: int):
    """Random decode inputs over a full cache: f32 latents c_kv [P, bs, C] (to store in each format), bf16
    k_pe, queries q [B, H, C] / q_pe, shuffled block tables [B, context / bs], lengths = context."""
    heads, latent, rope = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    pages = batch * (context // block_size)
    key = jax.random.PRNGKey(0)
    return (jax.random.normal(key, (pages, block_size, latent), jnp.float32),
            jax.random.normal(key, (pages, block_size, rope), jnp.bfloat16),
            jax.random.normal(key, (batch, heads, latent), jnp.bfloat16),
            jax.random.normal(key, (batch, heads, rope), jnp.bfloat16),
            jax.random.permutation(key, pages).reshape(batch, -1).astype(jnp.int32),
            jnp.full((batch,), context, jnp.int32))


def kernel_bandwidth(config, batch: int, context: int, block_size: int = 64) -> list[dict]:
    """The paged decode kernel on a full cache: effective TB/s = cache bytes read / time."""
    heads, latent = config.num_attention_heads, config.kv_lora_rank
    pages_per_seq = context // block_size
    num_pages = batch * pages_per_seq
    c_kv, k_pe, q, q_pe, tables, lengths = _full_cache(config, batch, context, block_size)
    rows = []
    for kind, group in usable_formats(config):
        if kind == "auto":
            cache, scale = c_kv.astype(jnp.bfloat16), None
        else:
            cache, scale = quantize_latent(c_kv, kind, latent // (group or latent))
        nbytes = batch * context * (PagedKVCache.bytes_per_token(config, "bfloat16", kind, group)
                                    // config.num_hidden_layers)
        # The default kernel (mla_decode's impl="auto"), the Triton kernel reading 8-bit rows as bytes and as
        # 16-bit byte pairs, and for a scale a token the Mosaic GPU kernel (few heads:
        # pallas_kernels/mla_decode_8bit_mgpu.py; heads a multiple of 64: pallas_kernels/mla_decode_mgpu.py)
        variants = [("", {})]
        if kind != "auto":
            variants += [(", triton bytes", dict(impl="triton", paired=False)),
                         (", triton byte pairs", dict(impl="triton", paired=True))]
            if mosaic_why_not(heads, latent, config.qk_rope_head_dim, block_size, cache.dtype,
                              num_scale_groups(latent, group)) is None:
                variants.append((", mosaic", dict(impl="mosaic")))
        for name, options in variants:
            fn = lambda q, qp, c, kp, t, n, s, o=options: mla_decode(q, qp, c, kp, t, n, 0.1, c_kv_scale=s, **o)
            us = device_time_us(fn, (q, q_pe, cache, k_pe, tables, lengths, scale), estimate_s=nbytes / 3e12)
            rows.append({"kv_cache_dtype": label(kind, group) + name, "batch": batch,
                         "context": context, "heads": heads, "us": us, "bytes": nbytes, "TB/s": nbytes / us / 1e6,
                         "tokens_per_us": batch * context / us})
    # Two pools (full_precision_window = context / 4): each sequence's last quarter of pages full precision;
    # each lane reading its page's pool, and (uniform_pages) each 64-key iteration its one page's pool.
    for kind, uniform_pages in (("int8", False), ("fp8", False), ("int8", True), ("fp8", True)):
        recent = pages_per_seq // 4
        full_pages = batch * recent
        comp_pages = num_pages - full_pages
        full = c_kv[:full_pages].astype(jnp.bfloat16)
        comp, comp_scale = quantize_latent(c_kv[full_pages:], kind, 1)
        old = (jnp.arange(batch * (pages_per_seq - recent)) + full_pages).reshape(batch, -1)
        new = jnp.arange(full_pages).reshape(batch, recent)
        pool_tables = jnp.concatenate([old, new], axis=1).astype(jnp.int32)
        per_layer = lambda k: PagedKVCache.bytes_per_token(config, "bfloat16", k) // config.num_hidden_layers
        nbytes = batch * block_size * (full_pages // batch * per_layer("auto") + comp_pages // batch * per_layer(kind))
        fn = lambda q, qp, f, kp, t, pos, c, s, u=uniform_pages: mla_paged(
            q, qp, f, kp, t, jnp.arange(batch, dtype=jnp.int32), pos, 0.1, compressed=(c, s, jnp.int32(0)),
            pools=(full_pages, comp_pages), uniform_pages=u)
        us = device_time_us(fn, (q, q_pe, full, k_pe, pool_tables, lengths - 1, comp, comp_scale),
                            estimate_s=nbytes / 3e12)
        rows.append({"kv_cache_dtype": label(kind, None, context // 4) + (", pool per page" if uniform_pages else ""),
                     "batch": batch, "context": context,
                     "heads": heads, "us": us, "bytes": nbytes, "TB/s": nbytes / us / 1e6,
                     "tokens_per_us": batch * context / us})
    return rows


# (block_k, num_stages, num_warps) of the 8-bit decode sweep; block_h 16 (V2-Lite's heads)
SWEEP_TILES = [(32, 3, 4), (64, 2, 4), (64, 3, 4), (64, 3, 8), (64, 4, 4)]


def decode_sweep(config, batch: int, context: int, block_size: int = 64) -> list[dict]:
    """The Triton decode kernel over one cache per format (bf16, int8, fp8 per token) at each tile of
    ``SWEEP_TILES``, for the 8-bit rows in each dot operand dtype (the query's bf16, or float16) and read
    as 16-bit byte pairs (``paired``): where the 8-bit kernel's time goes. TB/s on each format's own
    bytes; loop time (``device_time_us``)."""
    c_kv, k_pe, q, q_pe, tables, lengths = _full_cache(config, batch, context, block_size)
    rows = []
    for kind in ("auto", "int8", "fp8"):
        cache, scale = (c_kv.astype(jnp.bfloat16), None) if kind == "auto" else quantize_latent(c_kv, kind, 1)
        nbytes = batch * context * (PagedKVCache.bytes_per_token(config, "bfloat16", kind) // config.num_hidden_layers)
        # (dot operand dtype, byte pairs): 8-bit rows as they are in either dtype, or read as 16-bit pairs
        # (paired=True) in the kernel's default dtype (bf16 for int8, float16 for fp8)
        variants = [("bfloat16", False)] if kind == "auto" else [("bfloat16", False), ("float16", False), (None, True)]
        for dot_dtype, paired in variants:
            for block_k, stages, warps in SWEEP_TILES:
                fn = lambda q, qp, c, kp, t, n, s, cfg=(dot_dtype, paired, block_k, stages, warps): mla_decode(
                    q, qp, c, kp, t, n, 0.1, c_kv_scale=s, dot_dtype=cfg[0], paired=cfg[1], block_h=16,
                    block_k=cfg[2], num_stages=cfg[3], num_warps=cfg[4])
                us = device_time_us(fn, (q, q_pe, cache, k_pe, tables, lengths, scale), estimate_s=nbytes / 3e12)
                rows.append({"kv_cache_dtype": kind, "dot_dtype": dot_dtype or "default", "paired": paired,
                             "block_k": block_k, "num_stages": stages, "num_warps": warps, "us": us,
                             "TB/s": nbytes / us / 1e6})
                print(f"  {kind:5} {dot_dtype or 'default':9} {'pairs' if paired else 'bytes'} {block_k:3} keys "
                      f"{stages} stages {warps} warps: {us:7.1f} us {rows[-1]['TB/s']:5.2f} TB/s", flush=True)
    return rows


def memory_wall_throughput(model, budget_bytes: int, prompt: int, steps: int) -> list[dict]:
    from benchmarks.decode_probe import measure

    rows = []
    # decode_probe.measure generates steps + (prefill steps) + 8 tokens; at most 256 sequences of
    # `prompt` tokens take 128 prefill steps of 2048 tokens.
    max_len = prompt + steps + 160
    for kind, group in usable_formats(model.config)[:3]:
        per_seq = PagedKVCache.bytes_per_token(model.config, model.dtype, kind, group) * max_len
        fits = int(budget_bytes // per_seq)
        batch = min(256, 1 << (fits.bit_length() - 1))  # the largest power of two that fits: one step shape
        config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch, 2048),
                              max_model_len=max_len, block_size=64, kv_cache_memory=budget_bytes,
                              enable_prefix_caching=False, kv_cache_dtype=kind, kv_cache_group_size=group,
                              buckets=tuple(sorted({batch, max(batch, 2048)})))
        llm = _EngineHolder(LLMEngine(model, load_tokenizer("deepseek-v2-lite"), config, progress=False))
        row = measure(llm, batch, prompt, steps)
        rows.append({"kv_cache_dtype": label(kind, group), "fits_seqs": fits, **row})
        del llm
        gc.collect()
    return rows


class _EngineHolder:
    """The .engine attribute decode_probe.measure expects from an LLM."""

    def __init__(self, engine):
        self.engine = engine


# ----- main -------------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-parts", action="store_true", help="also the V2-Lite and H200 measurements")
    parser.add_argument("--budget-gib", type=float, default=4.0, help="KV budget of the capacity table")
    parser.add_argument("--context", type=int, default=2048, help="tokens per sequence of the capacity table")
    parser.add_argument("--windows", type=int, default=12, help="held-out windows of 512 tokens")
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4, help="greedy-agreement prompts")
    parser.add_argument("--capacity-requests", type=int, default=48)
    parser.add_argument("--kernels-only", action="store_true", help="only the GPU kernel bandwidth table")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="only the GPU decode kernel's tiles x dot operand dtypes per cache format")
    parser.add_argument("--kinds", nargs="+", default=["auto", "int8", "fp8"], choices=["auto", "int8", "fp8"],
                        help="cache dtypes of the default-model measurements (auto is the baseline: keep it first)")
    parser.add_argument("--out", default="kvquant", help="results name under benchmarks/results (or a path)")
    args = parser.parse_args(argv)
    if (args.kernels_only or args.decode_sweep) and jax.default_backend() != "gpu":
        parser.error("--kernels-only and --decode-sweep time the Triton kernels: they need a GPU")
    start = time.perf_counter()
    from dsjax import load_config

    budget = int(args.budget_gib * 2**30)
    if args.decode_sweep:
        rows = decode_sweep(load_config("deepseek-v2-lite"), 64, 4096)
        table = markdown_table(rows, ["kv_cache_dtype", "dot_dtype", "paired", "block_k", "num_stages", "num_warps", "us",
                                      "TB/s"])
        print(table)
        print("wrote", write_result(args.out, {**environment(), "batch": 64, "context": 4096, "decode_sweep": rows,
                                               "table": table}))
        return
    if args.kernels_only:
        rows = kernel_bandwidth(load_config("deepseek-v2-lite"), 64, 4096)
        table = markdown_table(rows, ["kv_cache_dtype", "batch", "context", "heads", "us", "TB/s", "tokens_per_us"])
        print(table)
        print("wrote", write_result(args.out, {**environment(), "kernel_bandwidth": rows, "table": table}))
        return
    result = {**environment(), "capacity": {}}
    for preset in ("deepseek-v2-lite", "deepseek-v3"):
        result["capacity"][preset] = capacity_rows(load_config(preset), "bfloat16", budget, args.context, 64)
    default = load_model("default", dtype="float32", progress=False)
    # 16 sequences of 128 tokens at f32; 48 requests, so every format runs into its limit.
    small_budget = 128 * PagedKVCache.bytes_per_token(default.config, "float32") * 16
    result["capacity_measured"] = {
        "model": "default", "budget_bytes": small_budget, "prompt": 96, "gen": 32, "block_size": 16,
        "requests": args.capacity_requests,
        "rows": [measured_capacity(default, load_tokenizer("default"), k, g, small_budget, 96, 32, 16,
                                   args.capacity_requests) for k, g in usable_formats(default.config) if k in args.kinds]}
    result["accuracy_default"] = accuracy_default_model(args.windows, 512, args.gen_tokens, args.prompts,
                                                        tuple(args.kinds))
    if args.gpu_parts and jax.default_backend() == "gpu":
        v2 = load_model("deepseek-v2-lite", dtype="bfloat16", progress=False)
        result["v2lite_logit_error"] = v2lite_logit_error(v2, 512)
        result["kernel_bandwidth"] = (kernel_bandwidth(v2.config, 64, 4096)
                                      + kernel_bandwidth(load_config("deepseek-v3"), 128, 2048))
        result["memory_wall"] = memory_wall_throughput(v2, 8 << 30, 1024, 16)
    tables = [markdown_table(result["capacity"]["deepseek-v2-lite"],
                             ["kv_cache_dtype", "bytes_per_token_per_layer", "max_seqs", "capacity_x"]),
              markdown_table(result["capacity_measured"]["rows"],
                             ["kv_cache_dtype", "num_blocks", "max_running", "preemptions"]),
              markdown_table(result["accuracy_default"]["rows"],
                             ["kv_cache_dtype", "heldout_loss", "perplexity", "perplexity_change_pct",
                              "top1_agreement", "greedy_positionwise_agreement", "greedy_identical_prefix_mean"])]
    for key, columns in (("v2lite_logit_error", ["kv_cache_dtype", "max_rel_logit_error", "top1_agreement"]),
                         ("kernel_bandwidth", ["kv_cache_dtype", "batch", "context", "heads", "us", "TB/s",
                                               "tokens_per_us"]),
                         ("memory_wall", ["kv_cache_dtype", "fits_seqs", "batch", "step_ms", "tok_per_s"])):
        if key in result:
            tables.append(markdown_table(result[key], columns))
    result["table"] = "\n\n".join(tables)
    result["seconds"] = time.perf_counter() - start
    print(result["table"])
    print("wrote", write_result(args.out, result))


if __name__ == "__main__":
    main()
