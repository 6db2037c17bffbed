"""Do weights read into L2 ahead of time make batch 1's expert launch faster?

At batch 1 a V2-Lite layer's attention block is a chain of small launches that leaves HBM mostly idle
(~22 µs a layer at ~1 TB/s, decode_profile.md round 13), and the expert launch that follows
(``pallas_kernels/moe_decode.py``) streams 139 MB at ~3.5 TB/s. The shared experts' 34.6 MB do not
depend on the routing, so something running beside the attention chain (a concurrent launch, or idle
programs of the chain's own kernels) could read them into the H200's 50 MB L2 first. This probe prices
the outcome before any of that is built: the expert launch's own kernel time with L2 flushed before it
(``cold``), and after a launch that reads (stages) part of its weights once L2 is flushed:

- ``shared``: both shared experts (gate, up, down: 34.6 MB);
- ``shared gate/up``: their gate and up columns (23.1 MB);
- ``shared down``: their down rows (11.5 MB);
- ``routed 2``: two of the six routed experts the token picked (34.6 MB), to tell L2 hits from the
  position of the staged tiles in the launch.

The flush is a reduction over a 256 MB buffer, the staging a reduction over the staged weights (both
XLA launches); ``lax.optimization_barrier`` orders flush, staging and experts. Kernel times come from a
profiler trace of back-to-back calls (``benchmarks.common.kernel_time_us``): the expert launch's µs
and its rate over the layer's bytes, beside the cold launch of the same call.

The expert launch did not move (round 13), but that reading is weak: the launch runs its shared
programs last, after ~104 MB of routed weights (more than staged lines survive, as the chain target
below found), and the same flush-then-stage design left the attention launches' weights warm in a
first attention target (see below). ``--target experts-chain`` asks again. ``--target chain`` asks what L2 does for the attention
chain's two largest GEMV launches, the fused RMSNorm + q_proj + kv_a (15 MB) and o_proj (8.4 MB), which
take 6.9 / 4.55 µs inside the compiled step (decode_profile.md round 15) but ~4.9 / 3.2 when timed
alone on one layer's weights, call after call. A scan over 27 stacked layers runs both launches a layer
(o_proj on rows that depend on the first launch's products), every layer reading:

- ``fixed``: layer 1's weights (the same lines each time); ``layer i``: its own, as the engine does;
  ``layer i % 2`` / ``% 8``: footprints of two and eight layers (46 / 185 MB);
- ``fixed, L2 flushed``: layer 1's after a 256 MB reduction;
- ``layer i, next pages touched`` / ``touch ...``: its own, after an XLA gather or a Pallas kernel of 132
  or 1056 programs read one element every 2 MiB or 64 KiB of the next layer's weights (is the cost the
  translation of pages not seen for a step?);
- ``layer i, staged[, N MB after]``: its own, after an XLA reduction read them, then N MB of other
  bytes (what a prefetch during the expert launch would have to outlast).

Measured (2026-12-02, ``l2_chain_h200.json``, ``l2_chain_touch_h200.json``, ``l2_chain_flush_h200.json``,
``l2_chain_staged_h200.json``; µs for the two launches): fixed 4.87 / 3.15, layer i 7.09 / 4.35; touched
pages 6.76-6.83 / 4.28-4.35 (translation is not it); layer 1 flushed 7.18 / 4.40, i % 2 5.40 / 3.40, i % 8
6.82 / 4.32 (it is L2); staged 5.07 / 3.19, then 20 MB 6.02 / 3.86, then 40 MB 7.18 / 4.36. Staged lines
outlast ~20 MB of later traffic, not the tail of a 139 MB expert launch; the expert launch prefetching
the next layer's attention weights lost 6 µs a layer (decode_profile.md round 18). A first
``--target attention`` (flush, stage, then the two launches alone, each call) found its cold and staged
launches equally fast, at the fixed layer's times: its flush did not leave the weights cold, so it was
removed.

``--target experts-chain`` asks round 13's question again in a scan (8 layers, each layer's weights its
own, so L2 starts cold for each): does the expert launch gain from its shared experts staged in L2
just before it? Variants: as built; the shared experts (34.6 MB) or their gate and up (23 MB) read by
an XLA reduction right before. The expert launch's µs a layer beside the staging's. (Measured in
session 33, ``l2_experts_chain_h200.json``: 37.85 µs staged against 39.7, the staging 19 µs; a variant
with the shared programs first, 40.75, lost, and its ``DecodeTiles.shared_first`` knob was removed.)

    python -m benchmarks.l2_staging_probe --out benchmarks/results/l2_staging_h200.json
    python -m benchmarks.l2_staging_probe --target chain --out benchmarks/results/l2_chain_h200.json
    python -m benchmarks.l2_staging_probe --target experts-chain --out benchmarks/results/l2_experts_chain_h200.json
    python -m benchmarks.l2_staging_probe --quick      # tiny shapes in interpret mode (CPU)
"""

from __future__ import annotations

import argparse

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.common import kernel_time_us, markdown_table, run_interpret, write_probe
from pallas_kernels.moe_decode import DecodeTiles, moe_decode
from pallas_kernels.stacked_gemv import stacked_gemv, stacked_gemvs

# (hidden, moe intermediate, routed experts, top-k, shared intermediate, flush MB)
V2_LITE = (2048, 1408, 64, 6, 2816, 256)
QUICK = (64, 32, 8, 2, 64, 1)
QUICK_TILES = DecodeTiles(block_i=16, block_k=16, block_d=32, num_warps=4, num_stages=2)
STAGED = ("cold", "shared", "shared gate/up", "shared down", "routed 2")
# (hidden, q_proj width, kv_a width, o_proj depth, flush MB)
ATTENTION_V2_LITE = (2048, 3072, 576, 2048, 256)
ATTENTION_QUICK = (64, 96, 32, 64, 1)
CHAIN = ("fixed", "layer i", "layer i, next pages touched", "touch 2 MiB x132", "touch 64 KiB x132",
         "touch 2 MiB x1056", "fixed, L2 flushed", "layer i % 2", "layer i % 8", "layer i, staged",
         "layer i, staged, 20 MB after", "layer i, staged, 40 MB after")
CHAIN_LAYERS, CHAIN_QUICK_LAYERS = 27, 2
EXPERTS_CHAIN = ("as built", "shared staged", "shared gate/up staged")
EXPERTS_CHAIN_LAYERS = 8  # each layer 8 experts: the 6 a token picks and two more
PAGE_ELEMENTS = 2**20  # bf16 elements in 2 MiB
EPS = 1e-6


def _inputs(shape, seed: int = 0):
    hidden, inter, experts, top_k, shared_inter, flush_mb = shape
    rng = np.random.default_rng(seed)
    key = iter(jax.random.split(jax.random.key(seed), 8))
    mk = lambda *s: (jax.random.normal(next(key), s, jnp.float32) * 0.02).astype(jnp.bfloat16)
    routed = (mk(1, experts, hidden, inter), mk(1, experts, hidden, inter), mk(1, experts, inter, hidden))
    shared = (mk(1, hidden, shared_inter), mk(1, hidden, shared_inter), mk(1, shared_inter, hidden))
    x = jnp.asarray(rng.standard_normal((1, hidden)), jnp.bfloat16)
    weights = jnp.asarray(rng.random((1, top_k)), jnp.float32)
    ids = jnp.asarray(rng.permutation(experts)[:top_k][None], jnp.int32)
    flush = jnp.ones((flush_mb * 2**20 // 2,), jnp.bfloat16)
    return x, weights, ids, routed, shared, flush


def _staged_arrays(staged: str, ids, routed, shared):
    """The weights a variant reads into L2 before the expert launch."""
    if staged == "shared":
        return list(shared)
    if staged == "shared gate/up":
        return list(shared[:2])
    if staged == "shared down":
        return [shared[2]]
    if staged == "routed 2":
        return [w[0, ids[0, j]] for w in routed for j in range(2)]
    return []


def layer_call(staged: str, tiles: DecodeTiles, interpret: bool):
    """fn(x, weights, ids, routed, shared, flush): L2 flushed, ``staged`` read, then the experts."""
    def fn(x, weights, ids, routed, shared, flush):
        done = jnp.max(flush)
        stage = _staged_arrays(staged, ids, routed, shared)
        if stage:
            done, stage = jax.lax.optimization_barrier((done, stage))
            done = done + sum(jnp.max(w).astype(done.dtype) for w in stage)
        x, routed, shared = jax.lax.optimization_barrier((x, routed, shared, done))[:3]
        return moe_decode(x, weights, ids, *routed, jnp.int32(0), shared, tiles=tiles, interpret=interpret)
    return fn


def _attention_inputs(shape, seed: int = 0, layers: int = 2):
    hidden, q_width, kv_width, o_depth, flush_mb = shape
    key = iter(jax.random.split(jax.random.key(seed), 8))
    mk = lambda *s: (jax.random.normal(next(key), s, jnp.float32) * 0.02).astype(jnp.bfloat16)
    # ``layers`` layers of each stacked weight
    ws = dict(norm=1.0 + mk(layers, hidden), q=mk(layers, hidden, q_width), kv_a=mk(layers, hidden, kv_width),
              o=mk(layers, o_depth, hidden))
    x = mk(1, hidden) * 50
    flush = jnp.ones((flush_mb * 2**20 // 2,), jnp.bfloat16)
    return x, ws, flush


def _touch_kernel(layer_ref, *refs, strides):
    # refs: flattened stacked weights [L, n_i], then f32[programs, 16]: each program reads one element
    # every strides[i] of layer layer_ref[0]'s slice of each weight and stores their sum
    *w_refs, o_ref = refs
    layer, total = layer_ref[0], jnp.zeros((), jnp.float32)
    for w_ref, stride in zip(w_refs, strides):
        n = w_ref.shape[1]
        offs = jnp.arange(pl.next_power_of_2(pl.cdiv(n, stride))) * stride
        total += jnp.sum(plgpu.load(w_ref.at[layer, offs], mask=offs < n, other=0).astype(jnp.float32))
    o_ref[pl.program_id(0), :] = jnp.full((16,), total, jnp.float32)


def touch_pages(ws, layer, *, stride_bytes: int, programs: int, interpret: bool):
    """Each of ``programs`` programs reads one element every ``stride_bytes`` of layer ``layer``'s slice of
    each stacked weight of ``ws`` -> f32[programs, 16] (their sums, for a consumer to depend on)."""
    flat = [w.reshape(w.shape[0], -1) for w in ws]
    strides = tuple(max(1, stride_bytes // w.dtype.itemsize) for w in flat)
    return pl.pallas_call(
        functools.partial(_touch_kernel, strides=strides), grid=(programs,),
        out_shape=jax.ShapeDtypeStruct((programs, 16), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1), interpret=interpret, name="touch_pages",
    )(jnp.asarray(layer, jnp.int32).reshape(1), *flat)


def chain_call(variant: str, layers: int, interpret: bool):
    """fn(x, ws, flush): a scan over ``layers`` layers, each the norm + q + kv_a launch, then o_proj on rows that
    depend on its products (a chain, as in the decode step)."""

    def touch(ws, layer):
        # one element every 2 MiB of each weight's layer slice: the pages' translations, not their bytes
        # (a gather of those elements only, never a copy of the slice)
        flat = {k: ws[k].reshape(layers, -1) for k in ("q", "kv_a", "o")}
        return sum(jnp.sum(flat[k][layer, jnp.arange(0, flat[k].shape[1], PAGE_ELEMENTS)].astype(jnp.float32))
                   for k in flat)

    def fn(x, ws, flush):
        def body(carry, i):
            x, done = carry
            layer = (jnp.int32(1) if variant.startswith("fixed") else
                     i % int(variant.split("%")[1]) if "%" in variant else i)
            if "flushed" in variant:  # 256 MB read through L2 before the layer's launches
                done = done + jnp.max(jax.lax.optimization_barrier((flush, done))[0]).astype(jnp.float32)
            if "touched" in variant:
                done = done + touch(ws, jnp.minimum(i + 1, layers - 1))
            if variant.startswith("touch "):
                _, size, unit, programs = variant.split()
                stride = int(size) * (2**20 if unit == "MiB" else 2**10)
                touched = touch_pages([ws[k] for k in ("q", "kv_a", "o")], jnp.minimum(i + 1, layers - 1),
                                      stride_bytes=stride, programs=int(programs[1:]), interpret=interpret)
                done = done + touched[0, 0]
            if "staged" in variant:  # this layer's weights read through L2 by an XLA reduction, then maybe
                # other bytes (what a prefetch during the expert launch would have to outlast)
                staged = jax.lax.optimization_barrier((ws, done))[0]
                done = done + sum(jnp.max(jax.lax.dynamic_index_in_dim(staged[k], layer, keepdims=False))
                                  .astype(jnp.float32) for k in ("q", "kv_a", "o"))
                if "after" in variant:
                    mb = int(variant.split(", ")[-1].split()[0])
                    other = jax.lax.optimization_barrier((flush, done))[0][:mb * 2**20 // 2]
                    done = done + jnp.max(other).astype(jnp.float32)
            x = jax.lax.optimization_barrier((x, done))[0]
            q, _, _ = stacked_gemvs(x, (ws["q"], ws["kv_a"]), layer, ws["norm"], eps=EPS, partials=True,
                                    interpret=interpret)
            o_in = (x.astype(jnp.float32) + 1e-3 * q[:1, :x.shape[1]]).astype(x.dtype)
            o = stacked_gemv(o_in, ws["o"], layer, interpret=interpret)
            return (x + (1e-3 * o).astype(x.dtype), done), None

        (x, done), _ = jax.lax.scan(body, (x, jnp.float32(0)), jnp.arange(layers, dtype=jnp.int32))
        return x, done
    return fn


def chain_main(args) -> dict:
    shape, layers = (ATTENTION_QUICK, CHAIN_QUICK_LAYERS) if args.quick else (ATTENTION_V2_LITE, CHAIN_LAYERS)
    x, ws, flush = _attention_inputs(shape, layers=layers)
    rows = []
    for variant in CHAIN:
        fn = chain_call(variant, layers, args.quick)
        if args.quick:
            out = np.asarray(run_interpret(fn, x, ws, flush)[0], np.float32)
            assert np.isfinite(out).all()
            rows.append(dict(variant=variant))
            continue
        times = kernel_time_us(fn, (x, ws, flush), calls=args.calls // 4 if "flushed" in variant else args.calls)
        qkv = sum(t for name, t in times.items() if name.startswith("stacked_gemv2_norm")) / layers
        o = sum(t for name, t in times.items() if name.startswith("stacked_gemv_s")) / layers
        touched = sum(t for name, t in times.items() if not name.startswith("stacked_gemv") and name != "total")
        rows.append(dict(variant=variant, qkv_us=round(qkv, 2), o_proj_us=round(o, 2),
                         other_us_a_layer=round(touched / layers, 2)))
        print(rows[-1], flush=True)
    columns = ["variant"] + ([] if args.quick else ["qkv_us", "o_proj_us", "other_us_a_layer"])
    return write_probe(rows, markdown_table(rows, columns), args.out, layers=layers,
                       command="python -m benchmarks.l2_staging_probe --target chain")


def experts_chain_call(variant: str, layers: int, tiles: DecodeTiles, interpret: bool):
    """fn(x, weights, ids, routed, shared): a scan over ``layers`` layers, each the expert launch on its own
    layer's weights (its rows from the previous layer's output), after the variant's staging."""
    def fn(x, weights, ids, routed, shared):
        def body(carry, layer):
            x, done = carry
            if "staged" in variant:
                staged = shared[:2] if "gate/up" in variant else shared
                staged = jax.lax.optimization_barrier((staged, done))[0]
                done = done + sum(jnp.max(jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)).astype(jnp.float32)
                                  for w in staged)
            x = jax.lax.optimization_barrier((x, done))[0]
            out = moe_decode(x, weights, ids, *routed, layer, shared, tiles=tiles, interpret=interpret)
            return (x + (out * 1e-3).astype(x.dtype), done), None

        (x, done), _ = jax.lax.scan(body, (x, jnp.float32(0)), jnp.arange(layers, dtype=jnp.int32))
        return x, done
    return fn


def experts_chain_main(args) -> dict:
    hidden, inter, _, top_k, shared_inter, _ = QUICK if args.quick else V2_LITE
    layers = 2 if args.quick else EXPERTS_CHAIN_LAYERS
    experts = top_k + 2
    tiles = QUICK_TILES if args.quick else DecodeTiles()
    key = iter(jax.random.split(jax.random.key(0), 8))
    mk = lambda *s: (jax.random.normal(next(key), s, jnp.float32) * 0.02).astype(jnp.bfloat16)
    routed = (mk(layers, experts, hidden, inter), mk(layers, experts, hidden, inter), mk(layers, experts, inter, hidden))
    shared = (mk(layers, hidden, shared_inter), mk(layers, hidden, shared_inter), mk(layers, shared_inter, hidden))
    x = mk(1, hidden) * 50
    weights = jnp.full((1, top_k), 1.0 / top_k, jnp.float32)
    ids = jnp.arange(top_k, dtype=jnp.int32)[None]
    inputs = (x, weights, ids, routed, shared)
    rows, first = [], None
    for variant in EXPERTS_CHAIN:
        fn = experts_chain_call(variant, layers, tiles, args.quick)
        if args.quick:  # the order and the staging never change the result beyond the partials' order
            got = np.asarray(run_interpret(fn, *inputs)[0], np.float32)
            first = got if first is None else first
            np.testing.assert_allclose(got, first, rtol=2e-2, atol=2e-2)
            rows.append(dict(variant=variant))
            continue
        times = kernel_time_us(fn, inputs, calls=args.calls // 4)
        experts_us = sum(t for name, t in times.items() if name.startswith("moe_decode")) / layers
        other = sum(t for name, t in times.items() if not name.startswith("moe_decode") and name != "total") / layers
        rows.append(dict(variant=variant, moe_decode_us=round(experts_us, 2), other_us_a_layer=round(other, 2)))
        print(rows[-1], flush=True)
    columns = ["variant"] + ([] if args.quick else ["moe_decode_us", "other_us_a_layer"])
    return write_probe(rows, markdown_table(rows, columns), args.out, layers=layers,
                       command="python -m benchmarks.l2_staging_probe --target experts-chain")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU)")
    parser.add_argument("--target", choices=("experts", "chain", "experts-chain"), default="experts")
    args = parser.parse_args(argv)
    if args.target == "experts-chain":
        return experts_chain_main(args)
    if args.target == "chain":
        return chain_main(args)
    shape, tiles = (QUICK, QUICK_TILES) if args.quick else (V2_LITE, DecodeTiles())
    inputs = _inputs(shape)
    x, weights, ids, routed, shared, _ = inputs
    layer_bytes = sum(int(np.prod(w.shape[2:])) * 2 for w in routed) * shape[3] + sum(w.size * 2 for w in shared)
    staged_mb = {s: sum(w.size * 2 for w in _staged_arrays(s, ids, routed, shared)) / 1e6 for s in STAGED}
    rows, cold = [], None
    for staged in STAGED:
        fn = layer_call(staged, tiles, args.quick)
        if args.quick:  # staging reorders launches, never the experts' result
            got = np.asarray(run_interpret(fn, *inputs), np.float32)
            cold = got if cold is None else cold
            np.testing.assert_array_equal(got, cold)
            rows.append(dict(staged=staged, staged_mb=round(staged_mb[staged], 3)))
            continue
        times = kernel_time_us(fn, inputs, calls=args.calls)
        us = sum(t for name, t in times.items() if name.startswith("moe_decode"))
        rows.append(dict(staged=staged, staged_mb=round(staged_mb[staged], 1), moe_decode_us=round(us, 2),
                         tb_s=round(layer_bytes / us / 1e6, 2)))
        print(rows[-1], flush=True)
    columns = ["staged", "staged_mb"] + ([] if args.quick else ["moe_decode_us", "tb_s"])
    return write_probe(rows, markdown_table(rows, columns), args.out, layer_mb=round(layer_bytes / 1e6, 1),
                       command="python -m benchmarks.l2_staging_probe")


if __name__ == "__main__":
    main()
