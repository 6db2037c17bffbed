"""Probe of the few-head 8-bit Mosaic GPU decode kernel (pallas_kernels/mla_decode_8bit_mgpu.py) on the
H200: per-query error against the reference with each part of the scores switched off in turn (latent,
rope, both) for each count of compute warpgroups and both scale placements, timings of (compute
warpgroups, stages, chunk, splits, scale placement) variants at V2-Lite batch 64 / 4k context, and the
default variant's per-warpgroup trace over an int8 and an fp8 cache (Perfetto JSONs in $OUT; alone with
``--trace``). ``--many-heads`` instead times the many-head kernel (pallas_kernels/mla_decode_mgpu.py)
over each cache dtype at DeepSeek-V3's 128 heads, batch 128, 2k context, and traces it over a bf16 and
an int8 cache.

    OUT=/tmp/probe python -m benchmarks.mla_8bit_probe      # or: bash benchmarks/run_h200.sh mla8
    python -m benchmarks.mla_8bit_probe --many-heads        # or: bash benchmarks/run_h200.sh mla8-many
    python -m benchmarks.mla_8bit_probe --timings           # variant timings only (a minute)
    python -m benchmarks.mla_8bit_probe --release-fence     # the proxy fence off / on, in turns
"""
import os
import sys

import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_time_us, environment, markdown_table, traced, write_result
from benchmarks.kvquant import _full_cache
from dsjax import load_config
from dsjax.model.paged import PagedKVCache
from pallas_kernels import mla_decode_8bit_mgpu as k8
from pallas_kernels import mla_decode_mgpu
from pallas_kernels.kv_quant import quantize_latent
from pallas_kernels.mla_decode import combine_splits, mla_decode_reference

f32 = lambda a: a.astype(jnp.float32)


def paged(rng, batch, heads, lengths, bs=64):
    width = max(-(-n // bs) for n in lengths)
    nb = batch * width + 3
    perm = rng.permutation(nb)[:batch * width].reshape(batch, width).astype(np.int32)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    return mk(batch, heads, 512), mk(batch, heads, 64), mk(nb, bs, 512) * 3, mk(nb, bs, 64), jnp.asarray(perm), \
        jnp.asarray(lengths, jnp.int32)


# Contexts that leave a split empty, short or uneven: the probe's error checks run over these.
ERROR_LENGTHS = [1, 63, 64, 65, 128, 700, 1500, 2048]


def _decode(q, qpe, stored, kpe, scale, tables, lens, **options):
    """The kernel's output [T, H, C] f32 (partials merged) for the keyword ``options``."""
    out = k8.mla_decode_8bit_mgpu(q, qpe, stored, kpe, scale, tables, jnp.arange(len(lens), dtype=jnp.int32), lens,
                                  0.1, **options)
    if options.get("num_splits", 1) > 1:
        m, l, acc = out
        return np.asarray(combine_splits(m, l, acc.swapaxes(2, 3), jnp.float32, splits_axis=1), np.float32)
    return np.asarray(out.swapaxes(1, 2), np.float32)


def _per_query(got, want) -> str:
    """Each query's relative error, as the probe prints it."""
    return " ".join(f"{np.linalg.norm(g - w) / np.linalg.norm(w):.3g}" for g, w in zip(got, want))


def errors(compute_wgs):
    """Per-query relative error against the reference, each part of the scores switched off in turn, for
    each count of compute warpgroups in ``compute_wgs`` (the other parts with the first of them)."""
    rng = np.random.default_rng(0)
    q0, qpe0, ckv, kpe, tables, lens = paged(rng, len(ERROR_LENGTHS), 16, ERROR_LENGTHS)
    zero = lambda a: jnp.zeros_like(a)
    for kind in ("int8", "fp8"):
        stored, scale = quantize_latent(ckv, kind, 1)
        for name, q, qpe in (("both", q0, qpe0), ("no rope", q0, zero(qpe0)), ("rope only", zero(q0), qpe0),
                             ("uniform", zero(q0), zero(qpe0)), ("small q", q0 * 0.05, qpe0 * 0.05)):
            want = np.asarray(mla_decode_reference(f32(q), f32(qpe), stored, f32(kpe), tables, lens, 0.1, scale))
            for dequantize, wgs, defer_sum in [(d, n, f) for d in (False, True)
                                               for n in (compute_wgs if name == "both" else compute_wgs[:1])
                                               for f in (False, True)]:
                got = _decode(q, qpe, stored, kpe, scale, tables, lens, num_splits=1, dequantize=dequantize,
                              compute_wgs=wgs, defer_sum=defer_sum)
                print(kind, name, "dequantize" if dequantize else "scaled", f"wgs {wgs}", f"defer_sum {defer_sum}",
                      "per-query rel err", _per_query(got, want))
        sys.stdout.flush()


# Variants as the kernel's keyword arguments (besides them: stages as fit, chunks of 128, the scale on
# the scores). The denominators summed every step and after the loop (the default), over two compute
# warpgroups (the default) and one, 2 splits:
DENOMINATOR_VARIANTS = [dict(compute_wgs=wgs, num_splits=2, defer_sum=defer_sum) for wgs in (2, 1)
                        for defer_sum in (False, True)]
# The memory warpgroup's proxy fence before each ring slot's reload (RELEASE_FENCE, on as built), without
# and with it, in turns (calls vary ~5%: only same-call pairs count); one split (each query's 4k context reloads every
# slot 30 times) and two:
FENCE_VARIANTS = [dict(num_splits=splits, release_fence=fence) for splits in (2, 1) for _ in range(2)
                  for fence in (False, True)]


def timings(inputs, variants):
    """Device time of each variant (keyword arguments of the kernel) over an int8 and an fp8 cache."""
    (c, kp, qq, qp, tb, ln), nbytes = inputs
    seq_ids = jnp.arange(qq.shape[0], dtype=jnp.int32)
    for kind in ("int8", "fp8"):
        stored, scale = quantize_latent(c, kind, 1)
        for v in variants:
            label = f"{kind} " + " ".join(f"{k} {x}" for k, x in v.items())
            fn = lambda *a, v=v: k8.mla_decode_8bit_mgpu(*a, 0.1, **v)
            try:
                us = device_time_us(fn, (qq, qp, stored, kp, scale, tb, seq_ids, ln), estimate_s=1e-4)
                print(f"{label}: {us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
            except Exception as e:
                print(f"{label}: failed {type(e).__name__}: {e}"[:300])
            sys.stdout.flush()


def many_heads(batch: int = 128, context: int = 2048, num_splits: int = 1):
    """The many-head kernel at DeepSeek-V3's shape: error against the reference on the first 4 queries and
    device time, over a bf16, an int8 and an fp8 cache; a JSON of the rows in $OUT (mla8_many_heads.json)."""
    config = load_config("deepseek-v3")
    c, kp, qq, qp, tb, ln = _full_cache(config, batch, context, 64)
    seq_ids = jnp.arange(batch, dtype=jnp.int32)
    tokens_per_split = context // num_splits
    caches = {kind: quantize_latent(c, kind, 1) for kind in ("int8", "fp8")}
    caches = {"bfloat16": (c.astype(jnp.bfloat16), None), **caches}
    fn = lambda q, qpe, ckv, s, profile_dir=None, lengths=ln: mla_decode_mgpu.mla_decode_mgpu(
        q, qpe, ckv, kp, tb, seq_ids, lengths, 0.1, num_splits=num_splits, tokens_per_split=tokens_per_split,
        c_kv_scale=s, profile_dir=profile_dir)
    rows = []
    for kind, (cache, scale) in caches.items():
        label = f"{kind} heads {qq.shape[1]} batch {batch} context {context} splits {num_splits}"
        try:
            got = fn(qq, qp, cache, scale)
            if num_splits > 1:
                got = combine_splits(*got, jnp.float32, splits_axis=1)
            want = mla_decode_reference(f32(qq[:4]), f32(qp[:4]), cache if scale is not None else f32(cache), f32(kp),
                                        tb[:4], ln[:4], 0.1, scale)
            err = float(jnp.linalg.norm(f32(got[:4]) - want) / jnp.linalg.norm(want))
            us = device_time_us(fn, (qq, qp, cache, scale), estimate_s=2e-4)
            print(f"{label}: rel err {err:.4f}, {us:.1f} us")
            rows.append({"kv_cache_dtype": kind, "heads": qq.shape[1], "batch": batch, "context": context,
                         "splits": num_splits, "rel_err": err, "us": us})
        except Exception as e:
            print(f"{label}: failed {type(e).__name__}: {e}"[:300])
        sys.stdout.flush()
    table = markdown_table(rows, ["kv_cache_dtype", "heads", "batch", "context", "splits", "rel_err", "us"])
    print(table)
    print("wrote", write_result("mla8_many_heads", {**environment(), "rows": rows, "table": table},
                                os.environ.get("OUT", "benchmarks/results")))
    out = os.environ.get("OUT", "/tmp")
    # each warpgroup's named scopes (Perfetto JSONs in $OUT) over 512-token contexts: the kernel's trace
    # space holds 16 steps of its first compute warpgroup (a 2k context ran out of it)
    for kind in ("bfloat16", "int8"):
        try:
            traced(lambda d: fn(qq, qp, *caches[kind], profile_dir=d, lengths=jnp.minimum(ln, 512)),
                   os.path.join(out, f"trace_many_heads_{kind}"))
        except Exception as e:
            print(f"{kind} trace failed {type(e).__name__}: {e}"[:300])


def trace_default(inputs, out: str):
    """The default variant's per-warpgroup trace over an int8 and an fp8 cache (in out/trace_default_<kind>)."""
    (c, kp, qq, qp, tb, ln), _ = inputs
    seq_ids = jnp.arange(qq.shape[0], dtype=jnp.int32)
    for kind in ("int8", "fp8"):
        stored, scale = quantize_latent(c, kind, 1)
        traced(lambda d: k8.mla_decode_8bit_mgpu(qq, qp, stored, kp, scale, tb, seq_ids, ln, 0.1, num_splits=2,
                                                 profile_dir=d), os.path.join(out, f"trace_default_{kind}"))


def main():
    if "--many-heads" in sys.argv[1:]:
        return many_heads()
    out = os.environ.get("OUT", "/tmp")
    # V2-Lite batch 64, 4k context: the inputs of benchmarks.kvquant's kernel table
    config = load_config("deepseek-v2-lite")
    batch, context = 64, 4096
    inputs = (_full_cache(config, batch, context, 64),
              batch * context * (PagedKVCache.bytes_per_token(config, "bfloat16", "int8") // config.num_hidden_layers))
    if "--trace" in sys.argv[1:]:
        return trace_default(inputs, out)
    if "--timings" in sys.argv[1:]:  # the scale-placement and denominator variants alone
        return timings(inputs, DENOMINATOR_VARIANTS)
    if "--release-fence" in sys.argv[1:]:
        return timings(inputs, FENCE_VARIANTS)
    errors([2, 1, 4])
    # the rows dequantized beside them (four warpgroups and the chunk / splits sweep: sessions 21-23,
    # docs/kv_memory.md)
    timings(inputs, DENOMINATOR_VARIANTS + [dict(num_splits=2, dequantize=True)])
    trace_default(inputs, out)


if __name__ == "__main__":
    main()
