"""Batch-1 decode as one persistent kernel a step: what its weight stream and grid barriers cost together.

Today a batch-1 layer of V2-Lite is ~13 dependent launches (decode_profile.md rounds 15-20): ~77 µs a
layer for ~167 MB of weights, which the H200 copies in ~40 µs. Round 11's probe measured one piece of
the alternative, a persistent kernel whose CTAs meet at grid-wide barriers (~1.5 µs each), with each
phase's weights prefetched a few phases ahead; it left open what a whole layer would take. This probe
runs the layer's schedule with stand-in arithmetic: every CTA (one an SM) streams its share of a layer
as 16 KiB boxes (two [64, 64] halves, the expert launch's boxes) through one ring of ``ring`` slots,
refilled as each box is consumed, across the phases and the layers, and the CTAs meet at a grid barrier
after each phase whose output the next phase needs:

    phase            boxes a CTA   V2-Lite's bytes
    q_proj + kv_a    7             15.0 MB
    W_UK             1             2.1 MB
    attention        1             (a short context's latents)
    W_UV             1             2.1 MB
    o_proj           4             8.4 MB
    router           1             0.3 MB
    shared experts   16            34.6 MB   (need only the normed hidden: no routing)
    routed experts   48            103.8 MB  (addresses from the routing: issued after the router's barrier)

79 boxes a CTA (171 MB at 132 CTAs) and 7 barriers a layer, 26 layers a call (the MoE stack). At each
barrier a CTA writes a row ([8, 128] f32) and after it reads its neighbour's (round 11's check: the rows
come out exact or a barrier is broken); the routed boxes' CTA is shifted by a value read from that row, so
their addresses depend on the router's barrier, as an expert's id does. ``products``: each box is also
multiplied as the expert launch does (two wgmma of a half^T x an [8, 64] tile), so the tensor work sits
in the stream, either waited for before the box's slot is refilled ("serial") or with one box's products
in flight ("lag"), each box one wgmma chain or two ("halves", "halves_lag", "halves_lag2": each half
into its own accumulator, one or two boxes in flight); ``producer``: a second warpgroup issues the copies
as slots free up, so that refills never wait behind the products or a barrier.

Rows of the table: the schedule as described (``barriers``), the same stream with no barriers (the
floor), and the barriers alone with no weights (the chain's own cost), µs a layer from a profiler trace.
Measured (round 20): 42.2 µs a layer with a producer warpgroup, two chains a box, two boxes in flight and
8 slots, against ~77 for today's launches; so the step kernel is being built
(``pallas_kernels/decode_step_mgpu.py``, ``decode_step_moe.py``), and its phases are timed here too
(``--gemv-chain``, ``--moe-chain``, ``--moe-block-chain``).

    python -m benchmarks.megakernel_probe --out benchmarks/results/megakernel_probe_h200.json
    python -m benchmarks.megakernel_probe --quick   # lower every variant for an abstract H200 (CPU)
    python -m benchmarks.megakernel_probe --trace DIR  # per-CTA traces of the serial-products configs
    python -m benchmarks.megakernel_probe --only barriers/8/halves_lag2/producer  # named configs only
    python -m benchmarks.megakernel_probe --gemv-chain  # the step kernel's GEMV phase, a chain of
        # dependent D x D GEMVs (pallas_kernels/decode_step_mgpu.gemv_chain), against one launch a layer
    python -m benchmarks.megakernel_probe --moe-chain 8  # its expert phase (8 layers), both plans, against
        # moe_decode_mgpu a layer
    python -m benchmarks.megakernel_probe --moe-block-chain 8  # the MoE half: norm, router, routing, experts
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import device_time_us, kernel_time_us, markdown_table, traced, write_probe
from benchmarks.pdl_probe import ROWS
from pallas_kernels.common import lower_for_h200

HALF = 64  # a box is two [64, 64] bf16 halves: 16 KiB
# (phase, boxes a CTA); a barrier follows every phase but the shared experts' (the routed experts' boxes
# follow in the same stream), and the routed experts end the layer
PHASES = (("q_proj + kv_a", 7), ("W_UK", 1), ("attention", 1), ("W_UV", 1), ("o_proj", 4), ("router", 1),
          ("shared experts", 16), ("routed experts", 48))
BARRIER_AFTER = (True, True, True, True, True, True, False, True)
ROUTED = len(PHASES) - 1  # the phase whose addresses come from the router's barrier
VARIANTS = ("barriers", "stream", "chain")


def _starts() -> list[int]:
    starts, n = [], 0
    for _, count in PHASES:
        starts.append(n)
        n += count
    return starts + [n]


PRODUCTS = ("none", "serial", "lag", "halves", "halves_lag", "halves_lag2")
LAG = {"lag": 1, "halves_lag": 1, "halves_lag2": 2}  # boxes whose products may be in flight behind the newest


def layer_chain(x, w, *, variant: str, ring: int, products: str = "none", producer: bool = False,
                profile_dir: str | None = None):
    """x f32[C, 8, 128] (the CTAs' rows), w bf16[L, C, B, 2, 64, 64] (each layer's boxes a CTA, B =
    sum of PHASES) -> (the rows after L layers' barriers, f32[C, 64] the products' accumulators' row
    sums). ``products``: none; "serial" (each box's products waited for before its slot is refilled);
    "lag" (a box's slot refilled once the next box's products are issued: one box's in flight); "halves"
    and "halves_lag": the same with each half of a box into an accumulator of its own (and, lagged,
    consecutive boxes into different pairs), so that the products are two chains of dependent wgmma
    instructions, not one; "halves_lag2": two boxes' products in flight behind the newest.
    ``producer``: a second warpgroup issues the copies, slot after slot as the products free them (else
    the computing warpgroup issues them as it goes). ``profile_dir``: a per-CTA trace of the named scopes
    (wait for a box, products, refill, grid barrier; the producer's wait for a free slot and its copies)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; accepted: {', '.join(VARIANTS)}")
    if products not in PRODUCTS:
        raise ValueError(f"products={products!r}; accepted: {', '.join(PRODUCTS)}")
    num_layers, num_ctas, boxes = w.shape[:3]
    starts = _starts()
    if boxes != starts[-1]:
        raise ValueError(f"w has {boxes} boxes a layer; PHASES add up to {starts[-1]}")
    if not 1 <= ring <= starts[ROUTED]:
        raise ValueError(f"ring={ring}: accepted 1 to {starts[ROUTED]} (a refill crosses at most one layer)")
    streams, syncs = variant != "chain", variant != "stream"
    if not streams and (products != "none" or producer):
        raise ValueError("variant='chain' streams nothing: products='none' and producer=False only")
    per_layer = sum(BARRIER_AFTER)
    router_barrier = sum(BARRIER_AFTER[:ROUTED - 1])  # the layer's barriers up to the router's
    tiling = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def body(x_ref, w_ref, o_ref, acc_out, ring_smem, tile_smem, acc_smem, bars, free):
        c = lax.axis_index("c")
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        neighbour = lax.rem(c + 1, num_ctas)

        def issue(layer, n: int, shift, slot):
            """Box ``n`` of ``layer`` into ``slot``; a routed box from CTA (c + shift) % C's share."""
            cta = lax.rem(c + shift, num_ctas) if n >= starts[ROUTED] else c
            for h in range(2):
                plgpu.copy_gmem_to_smem(w_ref.at[layer, cta, n, h], ring_smem.at[slot, h], bars.at[slot])

        def slot_of(layer, n: int):
            return lax.rem(layer * boxes + n, ring)

        def routed_shift(count):
            """The routed boxes' CTA shift, from the neighbour's row of barrier ``count``."""
            return lax.rem(o_ref[lax.rem(count, 2), neighbour, 0, 0].astype(jnp.int32), num_ctas)

        def arrive_and_wait(count, parity, rows):
            """This CTA's rows out, counted; once all C have arrived ``count`` times, the neighbour's + 1."""
            o_ref.at[parity, c][...] = rows
            plgpu.semaphore_signal(sem, 1, memory_scope="gpu")
            plgpu.semaphore_wait(sem, num_ctas * count, decrement=False, memory_scope="gpu")
            return o_ref.at[parity, neighbour][...] + 1.0

        def loads():
            """The producer warpgroup: every box in order, each once its slot is free."""
            def layer_loads(layer, shift):
                for n in range(boxes):
                    if n == starts[ROUTED] and syncs:
                        count = layer * per_layer + router_barrier
                        plgpu.semaphore_wait(sem, num_ctas * count, decrement=False, memory_scope="gpu")
                        shift = routed_shift(count)
                    slot = slot_of(layer, n)
                    with jax.named_scope("free"):
                        pl.when(layer * boxes + n >= ring)(lambda slot=slot: plgpu.barrier_wait(free.at[slot]))
                    with jax.named_scope("issue"):
                        issue(layer, n, shift, slot)
                return shift

            lax.fori_loop(0, num_layers, layer_loads, jnp.int32(0))

        def compute(acc_refs):
            lag = LAG.get(products, 0)

            def acc_of(n: int, h: int):
                return acc_refs[0] if products in ("serial", "lag") else acc_refs[2 * (n % (lag + 1)) + h]

            if products != "none":  # the token's tile: ones in its first row
                row = plgpu.broadcasted_iota(jnp.int32, (HALF, HALF), 0, layout=plgpu.Layout.WGMMA)
                tile_smem[...] = jnp.where(row == 0, 1.0, 0.0).astype(jnp.bfloat16)
                plgpu.commit_smem()
            if streams and not producer:
                for n in range(ring):
                    issue(0, n, jnp.int32(0), n)
            tile = tile_smem.at[pl.ds(0, 8)].transpose((1, 0))

            def layer_body(layer, carry):
                rows, shift = carry
                count = layer * per_layer
                routing_known = False
                deferred = []  # routed boxes due before the router's barrier

                def consumed(n: int):
                    """Box ``n``'s slot is free: the producer told, or box n + ring issued (or deferred)."""
                    if producer:
                        plgpu.barrier_arrive(free.at[slot_of(layer, n)])
                        return
                    m = n + ring
                    if m >= boxes:
                        pl.when(layer + 1 < num_layers)(
                            lambda: issue(layer + 1, m - boxes, shift, slot_of(layer + 1, m - boxes)))
                    elif m >= starts[ROUTED] and not routing_known:
                        deferred.append(m)
                    else:
                        issue(layer, m, shift, slot_of(layer, m))

                for p, (_, num) in enumerate(PHASES):
                    if p == ROUTED - 1:  # the router's barrier has passed
                        routing_known = True
                        for m in deferred if streams else ():
                            issue(layer, m, shift, slot_of(layer, m))
                    for n in range(starts[p], starts[p] + num):
                        if not streams:
                            continue
                        slot = slot_of(layer, n)
                        with jax.named_scope("wait"):
                            plgpu.barrier_wait(bars.at[slot])
                        with jax.named_scope("products"):
                            if products != "none":
                                for h in range(2):
                                    plgpu.wgmma(acc_of(n, h), ring_smem.at[slot, h].transpose((1, 0)),
                                                tile)
                            if products in ("serial", "halves"):
                                plgpu.wgmma_wait(0)
                            if lag and n >= lag:  # box n - lag's products are done, the later ones may run on
                                plgpu.wgmma_wait(2 * lag)
                            if lag and n == boxes - 1:
                                plgpu.wgmma_wait(0)
                        with jax.named_scope("refill"):
                            if lag:
                                if n >= lag:
                                    consumed(n - lag)
                                if n == boxes - 1:
                                    for m in range(n - lag + 1, n + 1):
                                        consumed(m)
                            else:
                                consumed(n)
                    if BARRIER_AFTER[p] and syncs:
                        count = count + 1
                        with jax.named_scope("grid"):
                            rows = arrive_and_wait(count, lax.rem(count, 2), rows)
                        if p == ROUTED - 2:  # the router's barrier: the routed boxes' CTA from the rows
                            shift = routed_shift(count)
                return rows, shift

            rows, _ = lax.fori_loop(0, num_layers, layer_body, (x_ref.at[c][...], jnp.int32(0)))
            o_ref.at[2, c][...] = rows
            plgpu.wgmma_wait(0)
            acc_smem[...] = jnp.sum(sum(acc[...] for acc in acc_refs), axis=1)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(acc_smem, acc_out.at[c])
            plgpu.wait_smem_to_gmem(0)
            if syncs:
                @pl.when(c == 0)
                def _():  # every CTA has passed its last wait once all arrive again: the semaphore to zero
                    plgpu.semaphore_signal(sem, 1, memory_scope="gpu")
                    plgpu.semaphore_wait(sem, num_ctas * (num_layers * per_layer + 1), decrement=True,
                                         memory_scope="gpu")

                @pl.when(c != 0)
                def _():
                    plgpu.semaphore_signal(sem, 1, memory_scope="gpu")

        def warpgroups():
            zeros = plgpu.layout_cast(jnp.zeros((HALF, 8), jnp.float32), plgpu.Layout.WGMMA)

            def computing():
                pl.run_state(compute)(tuple(plgpu.ACC.init(zeros) for _ in range(6)))

            if producer:
                pl.when(lax.axis_index("wg") == 0)(computing)
                pl.when(lax.axis_index("wg") == 1)(loads)
            else:
                computing()

        warpgroups()

    rows_out, acc = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((3, *x.shape), jnp.float32),
                  jax.ShapeDtypeStruct((num_ctas, HALF), jnp.float32)),
        scratch_types=[plgpu.SMEM((ring, 2, HALF, HALF), jnp.bfloat16, transforms=tiling),
                       plgpu.SMEM((HALF, HALF), jnp.bfloat16, transforms=tiling),
                       plgpu.SMEM((HALF,), jnp.float32),
                       plgpu.Barrier(num_arrivals=2, num_barriers=ring),  # a box landed
                       plgpu.Barrier(num_barriers=ring)],  # its slot is free (with a producer warpgroup)
        grid=(num_ctas,),
        grid_names=("c",),
        **({"num_threads": 2, "thread_name": "wg"} if producer else {}),
        compiler_params=plgpu.CompilerParams(
            **({"profile_space": TRACE_WORDS, "profile_dir": profile_dir} if profile_dir else {})),
    )(x, w)
    return rows_out[2], acc


def expected_rows(x0, layers: int):
    """Each barrier reads the right neighbour's row + 1: after S of them, row c is x0's row c + S, + S."""
    steps = layers * sum(BARRIER_AFTER)
    return jnp.roll(x0, -steps, axis=0) + steps


def _inputs(layers: int, ctas: int, abstract: bool = False):
    shapes = ((ctas, *ROWS), (layers, ctas, _starts()[-1], 2, HALF, HALF))
    if abstract:
        return (jax.ShapeDtypeStruct(shapes[0], jnp.float32), jax.ShapeDtypeStruct(shapes[1], jnp.bfloat16))
    x0 = jnp.floor(jax.random.uniform(jax.random.key(ctas), shapes[0], jnp.float32, 0.0, 1000.0))
    return x0, jnp.ones(shapes[1], jnp.bfloat16)


TRACE_WORDS = 2048  # a CTA's trace words with profile_dir (an event is 2): two layers' scopes, at 8 slots
# (variant, ring, products, producer warpgroup)
CONFIGS = (("barriers", 12, "none", False), ("barriers", 12, "serial", False), ("barriers", 12, "lag", False),
           ("barriers", 12, "none", True), ("barriers", 12, "serial", True), ("barriers", 12, "lag", True),
           ("barriers", 8, "lag", True), ("stream", 12, "lag", False), ("stream", 12, "lag", True),
           ("chain", 12, "none", False), ("barriers", 12, "halves", True), ("barriers", 12, "halves_lag", True),
           ("barriers", 12, "halves", False), ("barriers", 12, "halves_lag", False),
           ("barriers", 12, "halves_lag2", True), ("barriers", 8, "halves_lag2", True),
           ("stream", 12, "halves_lag2", True))


def _call(x, w, variant, ring, products, producer):
    return layer_chain(x, w, variant=variant, ring=ring, products=products, producer=producer)


def _name(variant, ring, products, producer) -> str:
    return f"{variant}/{ring}/{products}" + ("/producer" if producer else "")


def _rel(got, want) -> float:
    """|got - want| / |want| in f32 (Frobenius norms)."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def _gemv_chain(args, depth: int = 2048) -> dict:
    """decode_step_mgpu.gemv_chain against a scan of launches over the same [L, D, D] weights: relative
    error against the f32-summed reference, kernel time (profiler trace) and loop time a call (launch
    gaps included), µs a layer."""
    from pallas_kernels.decode_step_mgpu import gemv_chain, gemv_chain_reference
    from pallas_kernels.stacked_gemv import stacked_gemv

    def triton(x, w):
        def layer(x, index):
            return stacked_gemv(x[None], w, index)[0].astype(x.dtype), None
        return lax.scan(layer, x, jnp.arange(w.shape[0]))[0]

    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (depth,), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (args.layers, depth, depth), jnp.float32) / depth ** 0.5).astype(jnp.bfloat16)
    want = jax.jit(gemv_chain_reference)(x, w).astype(jnp.float32)
    rows = []
    for name, fn in (("one kernel (gemv_chain)", gemv_chain), ("Triton stacked_gemv a layer", triton),
                     ("XLA dot a layer", gemv_chain_reference)):
        got = jax.jit(fn)(x, w).astype(jnp.float32)
        error = _rel(got, want)
        kernels = kernel_time_us(fn, (x, w), calls=args.calls)["total"]
        loop = device_time_us(fn, (x, w), estimate_s=args.layers * 5e-6)
        rows.append(dict(kernel=name, layers=args.layers, rel_error=round(error, 5),
                         kernel_us_per_layer=round(kernels / args.layers, 2),
                         loop_us_per_layer=round(loop / args.layers, 2),
                         tb_s=round(w.size * 2 / loop / 1e6, 3)))
        print(rows[-1], flush=True)
    if args.trace:  # the one kernel's scopes a layer (barrier, input, tiles, products, store, stores out)
        traced(lambda d: jax.jit(functools.partial(gemv_chain, profile_dir=d))(x, w), f"{args.trace}/gemv_chain")
    columns = ["kernel", "layers", "rel_error", "kernel_us_per_layer", "loop_us_per_layer", "tb_s"]
    return write_probe(rows, markdown_table(rows, columns), args.out, calls=args.calls, depth=depth,
                       command="python -m benchmarks.megakernel_probe --gemv-chain")


def _constant(setting: str) -> tuple:
    """A trace-time kernel constant's (module, attribute): NAME of decode_step_moe, or MODULE.NAME of a
    pallas_kernels module (decode_step_attention.MERGE_GROUP)."""
    import importlib

    module, _, name = setting.rpartition(".")
    return importlib.import_module(f"pallas_kernels.{module or 'decode_step_moe'}"), name


def _under(setting: str, value, fn):
    """``fn`` traced with the trace-time module constant ``setting`` (``_constant``: EXPERT_PLAN,
    decode_step_attention.MERGE_GROUP) set to ``value``; a new function each time, so jit traces it anew."""
    module, name = _constant(setting)

    def call(*args, **options):
        built = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn(*args, **options)
        finally:
            setattr(module, name, built)
    return call


def _moe_chain(args) -> dict:
    """decode_step_moe.moe_chain against a scan of the one-token expert launch (its residual added where
    XLA sums the partial rows), V2-Lite's layers: error against the reference chain, kernel time (trace)
    and loop time a call, µs a layer."""
    from pallas_kernels.decode_step_moe import moe_chain, moe_chain_reference
    from pallas_kernels.moe_decode_mgpu import moe_decode_mgpu

    layers = args.moe_chain
    keys = iter(jax.random.split(jax.random.key(1), 8))
    w = lambda *s: (jax.random.normal(next(keys), s, jnp.float32) * s[-2] ** -0.5).astype(jnp.bfloat16)
    x = jax.random.normal(next(keys), (2048,), jnp.float32).astype(jnp.bfloat16)
    # the down projections scaled by 1/8: with no norm between layers, the unscaled chain (quadratic in x a layer)
    # overflows within 8 layers (round 22: NaN in both the kernel and the reference)
    routed = (w(layers, 64, 2048, 1408), w(layers, 64, 2048, 1408), w(layers, 64, 1408, 2048) / 8)
    shared = (w(layers, 2048, 2816), w(layers, 2048, 2816), w(layers, 2816, 2048) / 8)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.stack([rng.permutation(64)[:6] for _ in range(layers)]), jnp.int32)
    weights = jnp.asarray(rng.random((layers, 6)), jnp.float32)

    def launches(x, weights, ids, *experts):
        *routed, shared = experts
        def layer(x, index):
            out = moe_decode_mgpu(x[None], weights[index][None], ids[index][None], *routed, index, shared, x[None])
            return out[0], None
        return lax.scan(layer, x, jnp.arange(layers))[0]

    inputs = (x, weights, ids, *routed, shared)
    want = jax.jit(moe_chain_reference)(*inputs).astype(jnp.float32)
    layer_mb = (6 * 3 * 2048 * 1408 + 3 * 2048 * 2816) * 2 / 1e6  # bytes a layer reads: top-6 + shared
    dealt = _under("EXPERT_PLAN", "dealt", moe_chain)  # each CTA the same number of boxes (decode_step_moe.expert_plan)
    split = _under("EXPERT_PLAN", "split", moe_chain)
    rows = []
    for name, fn in (("one kernel (moe_chain), tiles whole a CTA", _under("EXPERT_PLAN", "tiles", moe_chain)),
                     ("one kernel (moe_chain), boxes dealt evenly", dealt),
                     ("one kernel (moe_chain), 44 tiles split in K ranges", split),
                     ("moe_decode_mgpu a layer", launches)):
        got = jax.jit(fn)(*inputs).astype(jnp.float32)
        error = _rel(got, want)
        kernels = kernel_time_us(fn, inputs, calls=args.calls)["total"]
        loop = device_time_us(fn, inputs, estimate_s=layers * 40e-6)
        rows.append(dict(kernel=name, layers=layers, rel_error=round(error, 5),
                         kernel_us_per_layer=round(kernels / layers, 2), loop_us_per_layer=round(loop / layers, 2),
                         tb_s=round(layer_mb * layers / loop, 3)))
        print(rows[-1], flush=True)
    if args.trace:
        traced(lambda d: dealt(*inputs, profile_dir=d), f"{args.trace}/moe_chain_dealt")
        traced(lambda d: split(*inputs, profile_dir=d), f"{args.trace}/moe_chain_split")
    columns = ["kernel", "layers", "rel_error", "kernel_us_per_layer", "loop_us_per_layer", "tb_s"]
    return write_probe(rows, markdown_table(rows, columns), args.out, calls=args.calls, layer_mb=round(layer_mb, 1),
                       command=f"python -m benchmarks.megakernel_probe --moe-chain {layers}")


def _moe_block_chain(args) -> dict:
    """decode_step_moe.moe_block_chain (each plan) against moe_chain given the same routing: what the norm,
    the router's products, its barrier and the routing add to a layer. Today's launches for the same work
    (round 20's profile): router products + their sum + routing + experts + their sum, ~44 µs a layer. Then
    moe_layer_tail_chain: o_proj (2048 x 2048) and its barrier in front (today: o_proj's launch, 4.5 µs, and
    the residual's sum)."""
    from pallas_kernels.decode_step_moe import (RouterSpec, moe_block_chain, moe_block_chain_reference, moe_chain,
                                                moe_layer_tail_chain, moe_layer_tail_chain_reference)

    layers = args.moe_block_chain
    keys = iter(jax.random.split(jax.random.key(3), 16))
    w = lambda *s: (jax.random.normal(next(keys), s, jnp.float32) * s[-2] ** -0.5).astype(jnp.bfloat16)
    x = jax.random.normal(next(keys), (2048,), jnp.float32).astype(jnp.bfloat16)
    norm = (1 + jax.random.uniform(next(keys), (layers, 2048)) / 4).astype(jnp.bfloat16)
    router = jax.random.normal(next(keys), (layers, 2048, 64), jnp.float32) / 2048 ** 0.5
    experts = (w(layers, 64, 2048, 1408), w(layers, 64, 2048, 1408), w(layers, 64, 1408, 2048))
    shared = (w(layers, 2048, 2816), w(layers, 2048, 2816), w(layers, 2816, 2048))
    spec = RouterSpec(1e-6)
    want, ids, weights = jax.jit(lambda *a: moe_block_chain_reference(*a[:3], spec, 6, *a[3:6], a[6:]))(
        x, norm, router, *experts, *shared)
    attn, o_proj = w(layers, 1, 2048)[:, 0], w(layers, 2048, 2048) / 4  # attention outputs, given
    want_tail = jax.jit(lambda *a: moe_layer_tail_chain_reference(*a[:5], spec, 6, *a[5:8], a[8:])[0])(
        x, attn, o_proj, norm, router, *experts, *shared)

    def with_plan(plan, router_dtype=jnp.float32, **options):
        block = _under("EXPERT_PLAN", plan, moe_block_chain)
        return lambda x, norm, router, *rest: block(x, norm, router.astype(router_dtype), spec, 6, *rest[:3],
                                                    rest[3:], **options)[0]

    def tail(plan):
        chain = _under("EXPERT_PLAN", plan, moe_layer_tail_chain)
        return lambda x, attn, o_proj, norm, router, *rest: chain(x, attn, o_proj, norm, router, spec, 6, *rest[:3],
                                                                  rest[3:])[0]

    inputs = (x, norm, router, *experts, *shared)
    tail_inputs = (x, attn, o_proj, norm, router, *experts, *shared)
    layer_mb = (6 * 3 * 2048 * 1408 + 3 * 2048 * 2816) * 2 / 1e6 + 2048 * 64 * 4 / 1e6
    o_proj_mb = 2048 * 2048 * 2 / 1e6
    rows = []
    for name, fn, args_ in (
            ("moe_block_chain, tiles whole a CTA", with_plan("tiles"), inputs),
            ("moe_block_chain, boxes dealt evenly", with_plan("dealt"), inputs),
            ("moe_block_chain, dealt, bf16 router (one box a router CTA)", with_plan("dealt", jnp.bfloat16), inputs),
            ("moe_block_chain, 44 shared tiles split in K ranges, first", with_plan("split"), inputs),
            ("moe_chain (routing given, no norm)", lambda x, i, wt, *e: moe_chain(x, wt, i, *e[:3], e[3:]),
             (x, ids, weights, *experts, *shared)),
            ("moe_layer_tail_chain (o_proj, then the MoE half), dealt", tail("dealt"), tail_inputs),
            ("moe_layer_tail_chain (o_proj, then the MoE half), split", tail("split"), tail_inputs)):
        if args.only and not any(part in name for part in args.only):
            continue
        got = jax.jit(fn)(*args_).astype(jnp.float32)
        reference = {id(inputs): want, id(tail_inputs): want_tail}.get(id(args_))  # none: moe_chain's own chain
        error = None if reference is None else _rel(got, reference)
        kernels = kernel_time_us(fn, args_, calls=args.calls)["total"]
        loop = device_time_us(fn, args_, estimate_s=layers * 45e-6)
        mb = layer_mb + (o_proj_mb if args_ is tail_inputs else 0)
        rows.append(dict(kernel=name, layers=layers, rel_error=None if error is None else round(error, 5),
                         kernel_us_per_layer=round(kernels / layers, 2), loop_us_per_layer=round(loop / layers, 2),
                         tb_s=round(mb * layers / loop, 3)))
        print(rows[-1], flush=True)
    if args.trace:
        traced(lambda d: jax.jit(with_plan("dealt", profile_dir=d))(*inputs), f"{args.trace}/moe_block_chain")
        traced(lambda d: jax.jit(with_plan("split", profile_dir=d))(*inputs), f"{args.trace}/moe_block_chain_split")
    columns = ["kernel", "layers", "rel_error", "kernel_us_per_layer", "loop_us_per_layer", "tb_s"]
    return write_probe(rows, markdown_table(rows, columns), args.out, calls=args.calls, layer_mb=round(layer_mb, 1),
                       command=f"python -m benchmarks.megakernel_probe --moe-block-chain {layers}")


def attention_inputs(layers: int, position: int, capacity: int = 512, block_size: int = 64, seed: int = 5):
    """Random V2-Lite attention halves for ``attention_chain`` (16 heads, rope columns as drawn): x, the
    position, a block table over a shuffled pool, the caches (finite everywhere), the stacked weights and the
    spec."""
    from pallas_kernels.decode_step_attention import AttentionSpec, AttentionWeights

    keys = iter(jax.random.split(jax.random.key(seed), 16))
    bf16, hidden, heads = jnp.bfloat16, 2048, 16
    w = lambda fan_in, *s: (jax.random.normal(next(keys), s, jnp.float32) * fan_in ** -0.5).astype(bf16)
    pages = capacity // block_size
    table = jax.random.permutation(next(keys), 2 * pages)[:pages].astype(jnp.int32)
    c_kv = jax.random.normal(next(keys), (layers, 2 * pages, block_size, 512), jnp.float32).astype(bf16)
    k_pe = jax.random.normal(next(keys), (layers, 2 * pages, block_size, 64), jnp.float32).astype(bf16)
    norm = lambda *s: (1 + jax.random.uniform(next(keys), s) / 4).astype(bf16)
    weights = AttentionWeights(norm(layers, hidden), w(hidden, layers, hidden, heads, 192),
                               w(hidden, layers, hidden, 576), norm(layers, 512), w(128, layers, 512, heads, 128),
                               w(512, layers, 512, heads, 128), w(heads * 128, layers, heads, 128, hidden))
    inv_freq = tuple(float(f) for f in 10000.0 ** (-np.arange(0, 64, 2) / 64))
    spec = AttentionSpec(1e-6, 1e-6, 192 ** -0.5, inv_freq, 1.0)
    x = jax.random.normal(next(keys), (hidden,), jnp.float32).astype(bf16)
    return x, jnp.int32(position), table, c_kv, k_pe, weights, spec


def layer_inputs(layers: int, position: int, seed: int = 7):
    """``attention_inputs`` and V2-Lite's MoE halves (its norm, an f32 router, top-6 of 64 routed and 2 shared
    experts) for ``moe_layer_chain``: (x, position, table, c_kv, k_pe, attention weights, attention spec, norm,
    router, routed experts (3), shared experts (3))."""
    x, pos, table, c_kv, k_pe, attention, spec = attention_inputs(layers, position)
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    w = lambda *s: (jax.random.normal(next(keys), s, jnp.float32) * s[-2] ** -0.5).astype(jnp.bfloat16)
    norm = (1 + jax.random.uniform(next(keys), (layers, 2048)) / 4).astype(jnp.bfloat16)
    router = jax.random.normal(next(keys), (layers, 2048, 64), jnp.float32) / 2048 ** 0.5
    routed = (w(layers, 64, 2048, 1408), w(layers, 64, 2048, 1408), w(layers, 64, 1408, 2048) / 4)
    shared = (w(layers, 2048, 2816), w(layers, 2048, 2816), w(layers, 2816, 2048) / 4)
    return x, pos, table, c_kv, k_pe, attention, spec, norm, router, routed, shared


def _setting(text: str) -> tuple:
    """``--setting`` NAME=VALUE -> (NAME, VALUE as a Python literal), NAME a decode_step_moe module constant or
    MODULE.NAME another pallas_kernels module's (``_constant``)."""
    name, _, value = text.partition("=")
    try:
        module, attribute = _constant(name)
    except ImportError:
        module, attribute = None, ""
    if not attribute.isupper() or not hasattr(module, attribute) or not value:
        raise SystemExit(f"--setting {text!r}: expected NAME=VALUE, NAME one of decode_step_moe's module "
                         "constants (e.g. EXPERT_PLAN='dealt') or MODULE.NAME of a pallas_kernels module "
                         "(e.g. decode_step_attention.MERGE_GROUP=4)")
    return name, ast.literal_eval(value)


def _under_all(settings: str, fn):
    """``fn`` under every NAME=VALUE of ``settings``, separated by ';' (``_setting``, ``_under``)."""
    for setting in settings.split(";"):
        fn = _under(*_setting(setting.strip()), fn)
    return fn


def _stubs(what: str) -> list:
    """(object, attribute) pairs that ``_without`` makes no-ops: ``products``, Mosaic GPU's wgmma; ``store_waits``,
    the waits for TMA stores to complete and the async-proxy fences, in every step-kernel module."""
    from pallas_kernels import decode_step_attention, decode_step_mgpu, decode_step_moe

    if what == "products":
        return [(plgpu, "wgmma")]
    if what == "store_waits":
        return [(plgpu, "wait_smem_to_gmem")] + [(m, "proxy_fence") for m in (decode_step_mgpu, decode_step_moe,
                                                                              decode_step_attention)]
    raise SystemExit(f"--without {what!r}; accepted: products, store_waits")


def _without(what: str, fn):
    """``fn`` traced with the ``_stubs(what)`` no-ops: the kernel as built but for them, its results wrong (no
    hang: every barrier still counts its arrivals). A diagnostic of how much of a kernel's time they hold up."""
    stubs = _stubs(what)

    def call(*args, **options):
        built = [getattr(obj, name) for obj, name in stubs]
        for obj, name in stubs:
            setattr(obj, name, lambda *a, **k: None)
        try:
            return fn(*args, **options)
        finally:
            for (obj, name), original in zip(stubs, built):
                setattr(obj, name, original)
    return call


def _layer_chain(args) -> dict:
    """decode_step_moe.moe_layer_chain: V2-Lite's whole layers at one token (the attention phases, o_proj, the
    MoE half), ``--layer-chain`` of them in one kernel, at positions 0 and 511, against its reference; beside it
    the two halves as their own chains (attention_chain, moe_layer_tail_chain given the attention output), and
    the whole layer under each ``--setting`` NAME=VALUE (the kernel constant NAME, ``_constant``, set to the
    Python literal VALUE while it traces; several, ';'-separated, make one variant), and under each ``--without``
    (its tensor products, or its stores' waits, left out: ``_without``). With ``--trace``: 2 layers of the whole
    layer's and of the tail's scopes."""
    from pallas_kernels.decode_step_attention import attention_chain
    from pallas_kernels.decode_step_moe import (RouterSpec, moe_layer_chain, moe_layer_chain_reference,
                                                moe_layer_tail_chain)

    layers, rows, moe_spec = args.layer_chain, [], RouterSpec(1e-6)
    x, _, table, c_kv, k_pe, attention, spec, norm, router, routed, shared = layer_inputs(layers, 0)
    cls = type(attention)
    whole = lambda x, pos, table, c_kv, k_pe, norm, router, *r: moe_layer_chain(
        x, pos, table, c_kv, k_pe, cls(*r[:7]), spec, norm, router, moe_spec, 6, *r[7:10], r[10:])[0]
    reference = jax.jit(lambda x, pos, table, c_kv, k_pe, norm, router, *r: moe_layer_chain_reference(
        x, pos, table, c_kv, k_pe, cls(*r[:7]), spec, norm, router, moe_spec, 6, *r[7:10], r[10:])[0])
    attention_only = lambda x, pos, table, c_kv, k_pe, *w: attention_chain(x, pos, table, c_kv, k_pe, cls(*w), spec)[0]
    tail = lambda x, attn, o, norm, router, *r, profile_dir=None: moe_layer_tail_chain(
        x, attn, o, norm, router, moe_spec, 6, *r[:3], r[3:], profile_dir=profile_dir)[0]
    # the layer inputs bound at the call (the trace rebinds them to 2 layers), so no weights are copied
    tail_inputs = lambda: (x, jnp.ones((norm.shape[0], 2048), jnp.bfloat16) / 8,
                           attention.o_proj.reshape(norm.shape[0], 2048, 2048), norm, router, *routed, *shared)
    for position in (0, 511):  # the same weights and caches, the token at another position
        pos = jnp.int32(position)
        inputs = (x, pos, table, c_kv, k_pe, norm, router, *attention, *routed, *shared)
        want = reference(*inputs)
        runs = [("moe_layer_chain (whole layers in one kernel)", whole, inputs),
                *((f"moe_layer_chain, {setting}", _under_all(setting, whole), inputs) for setting in args.setting),
                *((f"moe_layer_chain, without {what}", _without(what, whole), inputs) for what in args.without),
                ("attention_chain (the attention halves alone)", attention_only,
                 (x, pos, table, c_kv, k_pe, *attention))]
        if position == 0:  # the layer tail does not read the context
            runs.append(("moe_layer_tail_chain (o_proj and the MoE halves, the attention output given)", tail,
                         tail_inputs()))
        for name, call, args_ in runs:  # kernel time only: a timed loop would compile each kernel again
            kernels = kernel_time_us(call, args_, calls=args.calls)["total"]
            error = _rel(jax.jit(call)(*args_), want) if name.startswith("moe_layer_chain") else None
            rows.append(dict(kernel=name, layers=layers, position=position,
                             rel_error=None if error is None else round(error, 5),
                             kernel_us_per_layer=round(kernels / layers, 2)))
            print(rows[-1], flush=True)
    columns = ["kernel", "layers", "position", "rel_error", "kernel_us_per_layer"]
    result = write_probe(rows, markdown_table(rows, columns), args.out, calls=args.calls,
                         command=f"python -m benchmarks.megakernel_probe --layer-chain {layers}"
                         + "".join(f" --setting {setting}" for setting in args.setting))
    if args.trace:  # 2 layers: the trace's buffer is shared memory
        x, pos, table, c_kv, k_pe, attention, spec, norm, router, routed, shared = layer_inputs(2, 255)
        chain = lambda x, pos, table, c_kv, k_pe, attention, norm, router, routed, shared, *, profile_dir: (
            moe_layer_chain(x, pos, table, c_kv, k_pe, attention, spec, norm, router, moe_spec, 6, *routed, shared,
                            profile_dir=profile_dir))
        weights = (attention, norm, router, routed, shared)  # arguments: as constants they take minutes to compile
        traced(lambda d: jax.jit(functools.partial(chain, profile_dir=d))(x, pos, table, c_kv, k_pe, *weights),
               f"{args.trace}/moe_layer_chain")
        traced(lambda d: jax.jit(functools.partial(tail, profile_dir=d))(*tail_inputs()),
               f"{args.trace}/moe_layer_tail_chain")  # its scopes beside the whole layer's
    return result


def _attention_chain(args) -> dict:
    """decode_step_attention.attention_chain: V2-Lite's attention halves (norm, q / kv_a, W_UK, rope, paged
    attention over the context, W_UV, o_proj, the residual) at one token, ``--attention-chain`` layers in one
    kernel, against its jnp reference. Today's launches for the same work (round 20's profile): norm + q + kv_a
    6.7 µs, write_latents 3.6, mla_decode 5.8 + combine 1.5, W_UV 2.5, o_proj 4.5, and the sums: ~30 µs a
    layer."""
    from pallas_kernels.decode_step_attention import attention_chain, attention_chain_reference

    layers, rows = args.attention_chain, []
    x, _, table, c_kv, k_pe, weights, spec = attention_inputs(layers, 0)
    fn = lambda x, pos, table, c_kv, k_pe, *w: attention_chain(x, pos, table, c_kv, k_pe, type(weights)(*w), spec)
    reference = jax.jit(lambda x, pos, table, c_kv, k_pe, *w: attention_chain_reference(
        x, pos, table, c_kv, k_pe, type(weights)(*w), spec))
    for position in (0, 255, 511):  # the same weights and caches, the token at another position
        pos = jnp.int32(position)
        inputs = (x, pos, table, c_kv, k_pe, *weights)
        got, kv = jax.jit(fn)(*inputs)
        want, want_kv = reference(*inputs)
        kernels = kernel_time_us(fn, inputs, calls=args.calls)["total"]
        loop = device_time_us(fn, inputs, estimate_s=layers * 30e-6)
        mb = sum(int(np.prod(w.shape[1:])) for w in weights) * 2 / 1e6 + position * 1152 / 1e6
        rows.append(dict(kernel="attention_chain", layers=layers, position=position,
                         rel_error=round(_rel(got, want), 5), kv_rel_error=round(_rel(kv, want_kv), 5),
                         kernel_us_per_layer=round(kernels / layers, 2),
                         loop_us_per_layer=round(loop / layers, 2), tb_s=round(mb * layers / loop, 3)))
        print(rows[-1], flush=True)
    columns = ["kernel", "layers", "position", "rel_error", "kv_rel_error", "kernel_us_per_layer", "loop_us_per_layer",
               "tb_s"]
    result = write_probe(rows, markdown_table(rows, columns), args.out, calls=args.calls,
                         command=f"python -m benchmarks.megakernel_probe --attention-chain {layers}")
    if args.trace:  # 2 layers: the trace's buffer is shared memory, which the kernel nearly fills
        x, pos, table, c_kv, k_pe, weights, spec = attention_inputs(2, 255)
        chain = lambda d: jax.jit(lambda *a, w: attention_chain(*a, w, spec, profile_dir=d))
        traced(lambda d: chain(d)(x, pos, table, c_kv, k_pe, w=weights), f"{args.trace}/attention_chain")
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--ctas", type=int, default=132, help="CTAs (at most the SMs: all must be resident)")
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls in the profiler trace")
    parser.add_argument("--quick", action="store_true", help="lower every config on CPU, time nothing")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="time (with --quick: lower) only the configs named so (variant/ring/products[/producer], e.g. "
                             "barriers/12/halves/producer); with --moe-block-chain: the rows whose names hold one of "
                             "these")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="instead: trace the named scopes of the serial-products configs at 8 slots, two layers, "
                             "with and without the producer warpgroup (Perfetto JSON and a summary in DIR); "
                             "with --gemv-chain and the --*-chain runs: also the one kernel's scopes")
    parser.add_argument("--gemv-chain", action="store_true",
                        help="instead: decode_step_mgpu.gemv_chain (26 layers of 2048 x 2048) against a launch a "
                             "layer (the Triton stacked GEMV, XLA's dot)")
    for flag, what in (
            ("--moe-chain", "decode_step_moe.moe_chain (V2-Lite's one-token expert layers, this many) against "
                            "moe_decode_mgpu a layer"),
            ("--moe-block-chain", "decode_step_moe.moe_block_chain (V2-Lite's MoE halves, norm and router in the "
                                  "kernel, this many) against moe_chain with the routing given"),
            ("--attention-chain", "decode_step_attention.attention_chain (V2-Lite's attention halves at one token, "
                                  "this many layers) at positions 0, 255 and 511, against its reference"),
            ("--layer-chain", "decode_step_moe.moe_layer_chain (V2-Lite's whole layers at one token, this many) at "
                              "positions 0 and 511, against its reference and the two halves' chains")):
        parser.add_argument(flag, type=int, default=0, metavar="LAYERS", help=f"instead: {what}")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE[;NAME=VALUE]",
                        help="with --layer-chain: also the whole layer with the kernel constant NAME "
                             "(decode_step_moe's, or MODULE.NAME) set to VALUE; several, ';'-separated, in one "
                             "variant")
    parser.add_argument("--without", action="append", default=[], choices=("products", "store_waits"),
                        help="with --layer-chain: also the whole layer with its wgmma, or its TMA stores' waits and "
                             "fences, left out (a diagnostic; wrong results)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.layer_chain:
        return _layer_chain(args)
    if args.attention_chain:
        return _attention_chain(args)
    if args.moe_block_chain:
        return _moe_block_chain(args)
    if args.moe_chain:
        return _moe_chain(args)
    if args.gemv_chain:
        return _gemv_chain(args)
    if args.trace:
        x0, w = _inputs(2, args.ctas)
        for producer in (False, True):
            directory = f"{args.trace}/{'producer' if producer else 'one_warpgroup'}"
            traced(lambda d, producer=producer: jax.jit(functools.partial(
                layer_chain, variant="barriers", ring=8, products="serial", producer=producer,
                profile_dir=d))(x0, w), directory)
        return {"traced": args.trace}
    configs = [c for c in CONFIGS if args.only is None or _name(*c) in args.only]
    if args.only and len(configs) != len(args.only):
        raise ValueError(f"--only {args.only}: accepted names {[_name(*c) for c in CONFIGS]}")
    if args.quick:
        result = {_name(*config): lower_for_h200(lambda x, w, config=config: _call(x, w, *config),
                                                 *_inputs(2, 8, abstract=True)).count("mosaic_gpu")
                  for config in configs}
        print(result)
        return result
    x0, w = _inputs(args.layers, args.ctas)
    want = expected_rows(x0, args.layers)
    rows = []
    for variant, ring, products, producer in configs:
        fn = lambda x, w, config=(variant, ring, products, producer): _call(x, w, *config)
        got, acc = jax.jit(fn)(x0, w)
        wrong = int(jnp.sum(got != (want if variant != "stream" else x0)))
        # a product adds 64 to column 0 of each accumulator row a half: 2 halves x the boxes streamed
        acc_ok = bool(jnp.all(acc == (2 * HALF * args.layers * _starts()[-1] if products != "none" else 0)))
        us = kernel_time_us(fn, (x0, w), calls=args.calls)["total"]
        mb = 0.0 if variant == "chain" else w.size * 2 / 1e6
        rows.append(dict(variant=variant, ring=ring, products=products, producer=producer, layers=args.layers,
                         us_per_layer=round(us / args.layers, 2), tb_s=round(mb / us, 3) if mb else None,
                         wrong_rows=wrong, products_ok=acc_ok))
        print(rows[-1], flush=True)
    columns = ["variant", "ring", "products", "producer", "layers", "us_per_layer", "tb_s", "wrong_rows", "products_ok"]
    return write_probe(rows, markdown_table(rows, columns), args.out, calls=args.calls, ctas=args.ctas,
                       mb_per_layer=round(w.size * 2 / 1e6 / args.layers, 1),
                       command="python -m benchmarks.megakernel_probe")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
