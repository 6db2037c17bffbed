"""MoE kernels on one GPU: grouped SwiGLU, the routed-expert layer, routing, dense SwiGLU.

Shapes (bf16, random data): DeepSeek-V2-Lite experts (E=64, D=2048, I=1408, k=6) at T=8192 (prefill,
MMA bound: TFLOP/s with gate+up counted, 2·2·T·k·D·I) and T=256 (decode, weight-bandwidth bound: TB/s
of expert weights read, experts touched x 2·D·I·2 bytes); V3 routing (T=8192, E=256, 8 groups, top-4
groups, k=8); the dense fused SwiGLU at M=4096, K=2048, N=10944.

Each Pallas kernel runs over a small sweep of tiles / num_warps / num_stages (the table default
first) so one GPU run finds the best config; the MoE layer then runs with the best tiles found.
Anchors: the jitted XLA references, ``moe_experts_xla`` (sort + per-expert capacity rounds) for the
layer, and ``jax.lax.ragged_dot`` for the grouped GEMM. Targets (H200) are checked in the summary.

Each time is the median over repeats of one jitted fori_loop of many calls (per-call dispatch never
enters), each call's inputs tied to the previous output by an optimization barrier.

    python benchmarks/kernels_moe.py                 # GPU: table + benchmarks/results/moe_h200.json
    python benchmarks/kernels_moe.py --only grouped  # one section: grouped, layer, route or swiglu
    python benchmarks/kernels_moe.py --no-sweep      # table defaults only
    python benchmarks/kernels_moe.py --focus         # the issue's targets only (about a minute on an H200)
    python benchmarks/kernels_moe.py --quick         # tiny shapes, interpret mode on CPU (smoke test)

``--focus``: V2-Lite T=256 and T=8192 only, table-default tiles: the grouped SwiGLU and down
projection (sorted rows, and the layer's in-kernel gather / scatter variants) and the whole layer
against both XLA paths; results in moe_h200_focus.json. Combines with ``--quick`` for a CPU check.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_time_us, environment, write_result  # noqa: E402
from dsjax.model.dispatch import compiler_options  # noqa: E402
from pallas_kernels.grouped_swiglu import (DOWN_TILES, SWIGLU_TILES, TileConfig,  # noqa: E402
                                           grouped_matmul, grouped_swiglu, pick_config)
from pallas_kernels.moe_experts import moe_experts, moe_experts_reference, moe_experts_xla  # noqa: E402
from pallas_kernels.moe_routing import RoutingSpec, route, route_reference  # noqa: E402
from pallas_kernels.moe_sort import sort_by_expert, sort_by_expert_reference  # noqa: E402
from pallas_kernels.swiglu import swiglu, swiglu_reference  # noqa: E402

PEAK_TFLOPS, PEAK_TBS = 660.0, 4.8  # measured bf16 matmul ceiling and HBM spec, for the estimates
TARGETS = dict(grouped_swiglu_prefill_tflops=450.0, grouped_swiglu_decode_tbs=3.4,
               layer_speedup_vs_xla=3.0, dense_swiglu_tflops=437.0)


class MoeShape(NamedTuple):
    name: str
    num_tokens: int
    num_experts: int = 64
    hidden: int = 2048
    inter: int = 1408
    top_k: int = 6


class RouteShape(NamedTuple):
    name: str
    num_tokens: int
    num_experts: int
    spec: RoutingSpec


class DenseShape(NamedTuple):
    name: str
    rows: int
    depth: int
    width: int


V2_LITE_SPEC = RoutingSpec(6)  # softmax, greedy, no renormalization
V3_SPEC = RoutingSpec(8, "sigmoid", "noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                      routed_scaling_factor=2.5)
MOE_SHAPES = [MoeShape("V2-Lite T8192", 8192), MoeShape("V2-Lite T256", 256)]
ROUTE_SHAPES = [RouteShape("V3 T8192", 8192, 256, V3_SPEC),
                RouteShape("V2-Lite T8192", 8192, 64, V2_LITE_SPEC)]
DENSE_SHAPES = [DenseShape("M4096 K2048 N10944", 4096, 2048, 10944)]
QUICK_MOE = [MoeShape("quick", 320, 8, 64, 48, 2)]
QUICK_ROUTE = [RouteShape("quick V3", 16, 32, V3_SPEC._replace(n_group=4, topk_group=2, top_k=4))]
QUICK_DENSE = [DenseShape("quick", 32, 64, 96)]

# Tile sweeps (block_m, block_n, block_k, num_warps, num_stages), the table default added first.
# Two 128x128 f32 accumulators need 8 warps (128 registers a thread for them alone).
SWIGLU_SWEEP = {
    "prefill": [(128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (128, 128, 32, 8, 5),
                (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4)],
    "decode": [(16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (16, 64, 256, 4, 3), (16, 32, 256, 4, 4),
               (32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (64, 128, 64, 4, 3), (16, 64, 128, 8, 4)],
}
MATMUL_SWEEP = {  # K = I = 1408 = 11 x 128: block_k 64 or 128 avoid a partial K tile
    "prefill": [(128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                (128, 128, 32, 8, 5), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)],
    "decode": [(16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (16, 128, 128, 4, 3), (32, 64, 128, 4, 4),
               (64, 128, 64, 4, 4), (16, 256, 64, 4, 3)],
}
ROUTE_SWEEP = [(8, 4), (16, 4), (16, 8), (32, 4), (32, 8), (64, 8)]  # (block_tokens, num_warps)
DENSE_SWEEP = [(128, 128, 64, 8, 4, 8), (128, 128, 32, 8, 4, 8), (128, 128, 64, 8, 3, 16),
               (128, 64, 64, 4, 4, 8), (64, 128, 64, 4, 4, 8), (256, 64, 64, 8, 3, 8)]


class Bench:
    """Runs and records one benchmark row at a time; failures (shared memory, ...) become rows too."""

    def __init__(self, *, quick: bool):
        self.interpret = quick
        self.timing = dict(repeats=1, iters=2, xla_options=compiler_options("interpret")) if quick else {}
        self.rows: list[dict] = []

    def run(self, section, shape, kernel, config, fn, args, *, estimate_s, flops=None,
            bytes_read=None, slow=False) -> dict:
        row = dict(section=section, shape=shape.name, kernel=kernel, config=config)
        timing = dict(self.timing)
        if slow and not self.interpret:
            timing.update(repeats=3, iters=3)
        try:
            row["us"] = device_time_us(fn, args, estimate_s=estimate_s, **timing)
        except Exception as e:  # noqa: BLE001 - a config past shared memory, an anchor that fails
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        metric = ""
        if "us" in row and flops is not None:
            row["TFLOP/s"] = flops / row["us"] / 1e6
            metric += f" {row['TFLOP/s']:7.1f} TFLOP/s"
        if "us" in row and bytes_read is not None:
            row["TB/s"] = bytes_read / row["us"] / 1e6
            metric += f" {row['TB/s']:6.2f} TB/s"
        result = f"{row['us']:10.1f} us{metric}" if "us" in row else f"FAILED {row['error']}"
        print(f"  {kernel:<24} {json.dumps(config):<58} {result}", flush=True)
        self.rows.append(row)
        return row

    def best(self, section, shape_name, kernel) -> dict | None:
        rows = [r for r in self.rows if (r["section"], r["shape"], r["kernel"]) ==
                (section, shape_name, kernel) and "us" in r]
        return min(rows, key=lambda r: r["us"]) if rows else None


def _normals(seed: int, *shapes):
    """f32 standard normals of each shape from one RNG call (each call is a ~1 s CPU compile)."""
    sizes = [int(np.prod(shape)) for shape in shapes]
    flat = jax.random.normal(jax.random.PRNGKey(seed), (sum(sizes),), jnp.float32)
    pieces = jnp.split(flat, np.cumsum(sizes)[:-1])
    return [piece.reshape(shape) for piece, shape in zip(pieces, shapes)]


def _bf16(values, fan_in=1):
    return (values / np.sqrt(fan_in)).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("shape", "seed"))
def _moe_inputs(shape: MoeShape, seed: int = 0):
    """bf16 activations and expert weights, router logits, their (uniform-ish) routing and its
    expert-sorted rows, built in one jit."""
    t, e, d, i, k = shape.num_tokens, shape.num_experts, shape.hidden, shape.inter, shape.top_k
    x, logits, w_gate, w_up, w_down, h_sorted = _normals(
        seed, (t, d), (t, e), (e, d, i), (e, d, i), (e, i, d), (t * k, i))
    x = _bf16(x)
    weights, ids = route_reference(logits, None, V2_LITE_SPEC._replace(top_k=k))
    order, group_sizes = sort_by_expert_reference(ids, e)
    return dict(x=x, logits=logits, weights=weights, ids=ids, w_gate=_bf16(w_gate, d),
                w_up=_bf16(w_up, d), w_down=_bf16(w_down, i), order=order,
                group_sizes=group_sizes, x_sorted=x[order // k], h_sorted=_bf16(h_sorted),
                row_scale=weights.reshape(-1)[order])


def _regime(shape: MoeShape) -> str:
    """decode: at most 64 rows per expert on average (weight-bandwidth bound); prefill otherwise."""
    return "decode" if shape.num_tokens * shape.top_k <= 64 * shape.num_experts else "prefill"


def _configs(table, sweep, shape: MoeShape, width, depth, enabled: bool) -> list[TileConfig]:
    rows = shape.num_tokens * shape.top_k
    default = pick_config(table, rows, shape.num_experts, width, depth)
    configs = [default] + ([TileConfig(*c) for c in sweep[_regime(shape)]] if enabled else [])
    return list(dict.fromkeys(configs))


def bench_grouped(bench: Bench, shape: MoeShape, *, sweep: bool, anchors: bool = True) -> dict:
    """Grouped SwiGLU and grouped down projection on pre-sorted rows, then the layer's variants
    (token gather, scatter back to assignment order) at the best tiles; returns the best tiles.
    ``anchors``: also time ragged_dot."""
    t, e, d, i, k = shape.num_tokens, shape.num_experts, shape.hidden, shape.inter, shape.top_k
    print(f"grouped {shape.name}: T={t} E={e} D={d} I={i} k={k}", flush=True)
    data = _moe_inputs(shape)
    order, group_sizes, x_sorted = data["order"], data["group_sizes"], data["x_sorted"]
    h_sorted, row_scale = data["h_sorted"], data["row_scale"]
    touched = int(np.count_nonzero(np.asarray(group_sizes)))
    gate_up_flops, down_flops = 4 * t * k * d * i, 2 * t * k * d * i
    gate_up_bytes, down_bytes = touched * 2 * d * i * 2, touched * d * i * 2
    estimate = lambda flops, nbytes: max(flops / (PEAK_TFLOPS * 1e12), nbytes / (PEAK_TBS * 1e12))
    section = "grouped"

    for config in _configs(SWIGLU_TILES, SWIGLU_SWEEP, shape, i, d, sweep):
        fn = lambda x, g, wg, wu, c=config: grouped_swiglu(x, g, wg, wu, **c._asdict(),
                                                           interpret=bench.interpret)
        bench.run(section, shape, "grouped_swiglu", config._asdict(), fn,
                  (x_sorted, group_sizes, data["w_gate"], data["w_up"]),
                  estimate_s=estimate(gate_up_flops, gate_up_bytes), flops=gate_up_flops,
                  bytes_read=gate_up_bytes)
    best_swiglu = bench.best(section, shape.name, "grouped_swiglu")
    if best_swiglu is not None:  # the layer's variant: token rows gathered inside the kernel
        config = best_swiglu["config"]
        fn = lambda x, o, g, wg, wu: grouped_swiglu(x, g, wg, wu, order=o, top_k=k, **config,
                                                    interpret=bench.interpret)
        bench.run(section, shape, "grouped_swiglu_gather", config, fn,
                  (data["x"], order, group_sizes, data["w_gate"], data["w_up"]),
                  estimate_s=estimate(gate_up_flops, gate_up_bytes), flops=gate_up_flops,
                  bytes_read=gate_up_bytes)

    for config in _configs(DOWN_TILES, MATMUL_SWEEP, shape, d, i, sweep):
        fn = lambda h, g, w, s, c=config: grouped_matmul(h, g, w, row_scale=s, **c._asdict(),
                                                         interpret=bench.interpret)
        bench.run(section, shape, "grouped_matmul", config._asdict(), fn,
                  (h_sorted, group_sizes, data["w_down"], row_scale),
                  estimate_s=estimate(down_flops, down_bytes), flops=down_flops, bytes_read=down_bytes)
    best_matmul = bench.best(section, shape.name, "grouped_matmul")
    if best_matmul is not None:  # the layer's variant: rows stored back in (token, slot) order
        config = best_matmul["config"]
        fn = lambda h, g, w, o, s: grouped_matmul(h, g, w, order=o, row_scale=s, **config,
                                                  interpret=bench.interpret)
        bench.run(section, shape, "grouped_matmul_scatter", config, fn,
                  (h_sorted, group_sizes, data["w_down"], order, data["weights"].reshape(-1)),
                  estimate_s=estimate(down_flops, down_bytes), flops=down_flops, bytes_read=down_bytes)

    def xla_swiglu(x, g, wg, wu):  # one XLA dot per expert would be T*E work: use ragged_dot
        gate = jax.lax.ragged_dot(x, wg, g, preferred_element_type=jnp.float32)
        up = jax.lax.ragged_dot(x, wu, g, preferred_element_type=jnp.float32)
        return (jax.nn.silu(gate) * up).astype(x.dtype)

    if anchors and not bench.interpret:  # ragged_dot's CPU path is fine but pointless to time here
        bench.run(section, shape, "ragged_dot_swiglu", {}, xla_swiglu,
                  (x_sorted, group_sizes, data["w_gate"], data["w_up"]),
                  estimate_s=estimate(gate_up_flops, gate_up_bytes) * 20, flops=gate_up_flops,
                  bytes_read=gate_up_bytes, slow=True)
    return dict(swiglu=TileConfig(**best_swiglu["config"]) if best_swiglu else None,
                down=TileConfig(**best_matmul["config"]) if best_matmul else None)


def bench_layer(bench: Bench, shape: MoeShape, tiles: dict | None, *, sweep: bool) -> None:
    """route -> sort -> grouped SwiGLU -> grouped down -> combine, against the XLA paths."""
    t, e, d, i, k = shape.num_tokens, shape.num_experts, shape.hidden, shape.inter, shape.top_k
    print(f"layer {shape.name}: T={t} E={e} D={d} I={i} k={k}", flush=True)
    data = _moe_inputs(shape, seed=1)
    args = (data["x"], data["logits"], data["w_gate"], data["w_up"], data["w_down"])
    spec = V2_LITE_SPEC._replace(top_k=k)
    flops = 6 * t * k * d * i
    estimate = max(flops / (PEAK_TFLOPS * 1e12), 3 * e * d * i * 2 / (PEAK_TBS * 1e12))
    section = "layer"

    def pallas_layer(x, logits, w_gate, w_up, w_down, swiglu_config=None, down_config=None):
        weights, ids = route(logits, None, spec, interpret=bench.interpret)
        return moe_experts(x, weights, ids, w_gate, w_up, w_down, swiglu_config=swiglu_config,
                           down_config=down_config, interpret=bench.interpret)

    bench.run(section, shape, "pallas", {"tiles": "table defaults"}, pallas_layer, args,
              estimate_s=estimate, flops=flops)
    rows = t * k
    defaults = (pick_config(SWIGLU_TILES, rows, e, i, d), pick_config(DOWN_TILES, rows, e, d, i))
    if tiles and tiles.get("swiglu") and tiles.get("down") and (tiles["swiglu"], tiles["down"]) != defaults:
        config = {"swiglu": tiles["swiglu"]._asdict(), "down": tiles["down"]._asdict()}
        fn = lambda *a: pallas_layer(*a, swiglu_config=tiles["swiglu"], down_config=tiles["down"])
        bench.run(section, shape, "pallas", config, fn, args, estimate_s=estimate, flops=flops)

    default_capacity = max(8, int(2 ** np.ceil(np.log2(max(1, -(-t * k // e))))))
    for capacity in (default_capacity, 2 * default_capacity) if sweep else (default_capacity,):
        fn = lambda x, logits, wg, wu, wd, c=capacity: moe_experts_xla(
            x, *route_reference(logits, None, spec), wg, wu, wd, capacity=c)
        bench.run(section, shape, "xla_sorted", {"capacity": capacity}, fn, args,
                  estimate_s=estimate * 2, flops=flops)
    dense = lambda x, logits, wg, wu, wd: moe_experts_reference(
        x, *route_reference(logits, None, spec), wg, wu, wd)
    bench.run(section, shape, "xla_dense_reference", {}, dense, args,
              estimate_s=estimate * e / k, flops=flops, slow=t > 1024)


@functools.partial(jax.jit, static_argnames=("shape",))
def _route_inputs(shape: RouteShape):
    logits, bias = _normals(2, (shape.num_tokens, shape.num_experts), (shape.num_experts,))
    return logits, bias * 0.1, route_reference(logits, bias * 0.1, shape.spec)[1]


def bench_route(bench: Bench, shape: RouteShape, *, sweep: bool) -> None:
    t, e, spec = shape.num_tokens, shape.num_experts, shape.spec
    print(f"route {shape.name}: T={t} E={e} {spec}", flush=True)
    logits, bias, ids = _route_inputs(shape)
    estimate = max(t * e * 4 / (PEAK_TBS * 1e12), 5e-6)
    configs = [(None, None)] + (ROUTE_SWEEP if sweep else [])
    for block_tokens, num_warps in configs:
        fn = lambda l, b, bt=block_tokens, nw=num_warps: route(
            l, b, spec, block_tokens=bt, num_warps=nw, interpret=bench.interpret)
        config = {"block_tokens": block_tokens or "default", "num_warps": num_warps or "default"}
        bench.run("route", shape, "route", config, fn, (logits, bias), estimate_s=estimate)
    bench.run("route", shape, "xla_route_reference", {},
              lambda l, b: route_reference(l, b, spec), (logits, bias), estimate_s=estimate * 3)
    # The expert sort that follows routing: the sort kernel against XLA's stable argsort.
    bench.run("route", shape, "sort_by_expert", {},
              lambda i: sort_by_expert(i, e, interpret=bench.interpret), (ids,), estimate_s=estimate)
    bench.run("route", shape, "xla_argsort", {}, lambda i: sort_by_expert_reference(i, e), (ids,),
              estimate_s=estimate)


@functools.partial(jax.jit, static_argnames=("shape",))
def _dense_inputs(shape: DenseShape):
    m, k, n = shape.rows, shape.depth, shape.width
    x, w_gate, w_up = _normals(3, (m, k), (k, n), (k, n))
    return _bf16(x), _bf16(w_gate, k), _bf16(w_up, k)


def bench_dense(bench: Bench, shape: DenseShape, *, sweep: bool) -> None:
    m, k, n = shape.rows, shape.depth, shape.width
    print(f"dense swiglu {shape.name}", flush=True)
    args = _dense_inputs(shape)
    flops = 4 * m * k * n
    estimate = flops / (PEAK_TFLOPS * 1e12)
    configs = [None] + (DENSE_SWEEP if sweep else [])
    for config in configs:
        kwargs = {} if config is None else dict(zip(
            ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m"), config))
        fn = lambda x, wg, wu, kw=kwargs: swiglu(x, wg, wu, **kw, interpret=bench.interpret)
        bench.run("swiglu", shape, "swiglu", kwargs or {"tiles": "table default"}, fn, args,
                  estimate_s=estimate, flops=flops)
    bench.run("swiglu", shape, "xla_swiglu_reference", {}, swiglu_reference, args,
              estimate_s=estimate, flops=flops)


def summarize(bench: Bench, shapes: dict) -> dict:
    """Best row per (section, shape, kernel), speedups against the anchors, and the H200 targets."""
    best = {}
    for row in bench.rows:
        key = f"{row['section']} | {row['shape']} | {row['kernel']}"
        top = bench.best(row["section"], row["shape"], row["kernel"])
        if top is not None:
            best[key] = {k: top[k] for k in ("us", "TFLOP/s", "TB/s", "config") if k in top}
    us = lambda section, shape, kernel: best.get(f"{section} | {shape} | {kernel}", {}).get("us")
    rate = lambda section, shape, kernel, unit: best.get(
        f"{section} | {shape} | {kernel}", {}).get(unit)
    speedups, targets = {}, {}
    for shape in shapes["moe"]:
        ours = us("layer", shape.name, "pallas")
        for anchor in ("xla_sorted", "xla_dense_reference"):
            if ours and us("layer", shape.name, anchor):
                speedups[f"layer {shape.name} vs {anchor}"] = us("layer", shape.name, anchor) / ours
        tflops = rate("grouped", shape.name, "grouped_swiglu", "TFLOP/s")
        tbs = rate("grouped", shape.name, "grouped_swiglu", "TB/s")
        if _regime(shape) == "prefill" and tflops:
            goal = TARGETS["grouped_swiglu_prefill_tflops"]
            targets[f"grouped_swiglu {shape.name} TFLOP/s >= {goal:g}"] = (tflops, tflops >= goal)
        if _regime(shape) == "decode" and tbs:
            goal = TARGETS["grouped_swiglu_decode_tbs"]
            targets[f"grouped_swiglu {shape.name} TB/s >= {goal:g}"] = (tbs, tbs >= goal)
        # The "XLA reference path" is the jnp reference (dense one-hot experts) run by XLA; the
        # sort-based XLA path is a stronger anchor of our own, reported beside it.
        ratio = speedups.get(f"layer {shape.name} vs xla_dense_reference")
        if ratio:
            goal = TARGETS["layer_speedup_vs_xla"]
            targets[f"layer {shape.name} >= {goal:g}x xla_dense_reference"] = (ratio, ratio >= goal)
    for shape in shapes["route"]:
        ours, xla = us("route", shape.name, "route"), us("route", shape.name, "xla_route_reference")
        if ours and xla:
            speedups[f"route {shape.name} vs XLA"] = xla / ours
            targets[f"route {shape.name} faster than XLA"] = (xla / ours, xla > ours)
        ours, xla = us("route", shape.name, "sort_by_expert"), us("route", shape.name, "xla_argsort")
        if ours and xla:
            speedups[f"sort {shape.name} vs argsort"] = xla / ours
    for shape in shapes["dense"]:
        tflops = rate("swiglu", shape.name, "swiglu", "TFLOP/s")
        if tflops:
            goal = TARGETS["dense_swiglu_tflops"]
            targets[f"dense swiglu {shape.name} TFLOP/s >= {goal:g}"] = (tflops, tflops >= goal)
    return dict(best=best, speedups=speedups, targets=targets)


def print_summary(summary: dict, env: dict) -> None:
    print(f"\n{env['device']}, jax {env['jax']}: best of each kernel")
    print(f"{'section | shape | kernel':<58} {'us':>10} {'TFLOP/s':>8} {'TB/s':>6}  config")
    for key, row in summary["best"].items():
        tflops = f"{row['TFLOP/s']:8.1f}" if "TFLOP/s" in row else " " * 8
        tbs = f"{row['TB/s']:6.2f}" if "TB/s" in row else " " * 6
        print(f"{key:<58} {row['us']:10.1f} {tflops} {tbs}  {json.dumps(row['config'])}")
    print("\nspeedups")
    for key, value in summary["speedups"].items():
        print(f"  {key:<56} {value:6.2f}x")
    print("\ntargets")
    for key, (value, ok) in summary["targets"].items():
        print(f"  {key:<56} {value:8.2f}  {'PASS' if ok else 'MISS'}")


def run(*, quick: bool = False, sweep: bool = True, only: str | None = None, focus: bool = False,
        out_name: str | None = "moe_h200") -> dict:
    """Benchmarks the chosen sections, printing rows as they come; the results file is rewritten
    after every shape, so a run cut short keeps what it measured. ``focus``: the grouped and layer
    rows of the MoE shapes only, table tiles, no ragged_dot anchor (see the module docstring)."""
    if focus and only is not None:
        raise ValueError(f"focus picks its own sections; got only={only!r} too")
    bench = Bench(quick=quick)
    sweep = sweep and not quick and not focus
    shapes = dict(moe=QUICK_MOE if quick else MOE_SHAPES, route=QUICK_ROUTE if quick else ROUTE_SHAPES,
                  dense=QUICK_DENSE if quick else DENSE_SHAPES)
    if focus:
        shapes.update(route=[], dense=[])
    env = environment()

    def save() -> dict:
        payload = dict(**env, gpu=env["device"], quick=quick, focus=focus, targets_h200=TARGETS,
                       shapes={k: [s._asdict() | ({"spec": s.spec._asdict()} if hasattr(s, "spec") else {})
                                   for s in v] for k, v in shapes.items()},
                       rows=bench.rows, **summarize(bench, shapes))
        if out_name is not None:
            payload["path"] = str(write_result(out_name, payload))
        return payload

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
        for shape in shapes["moe"] if only in (None, "grouped", "layer") else []:
            tiles = (bench_grouped(bench, shape, sweep=sweep, anchors=not focus) if only != "layer"
                     else None)
            if only != "grouped":
                bench_layer(bench, shape, tiles, sweep=sweep)
            save()
        for shape in shapes["route"] if only in (None, "route") else []:
            bench_route(bench, shape, sweep=sweep)
            save()
        for shape in shapes["dense"] if only in (None, "swiglu") else []:
            bench_dense(bench, shape, sweep=sweep)
            save()
    payload = save()
    print_summary(payload, env)
    if out_name is not None:
        print(f"\nwrote {payload['path']}")
    return payload


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU)")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="table defaults only")
    sections = parser.add_mutually_exclusive_group()
    sections.add_argument("--only", choices=("grouped", "layer", "route", "swiglu"),
                          help="one section (the layer then uses table-default tiles)")
    sections.add_argument("--focus", action="store_true",
                          help="the issue's targets only: grouped kernels and the layer at V2-Lite "
                               "T=256 and T=8192, table tiles (about a minute on an H200)")
    parser.add_argument("--out", default=None,
                        help="results file stem in benchmarks/results (default moe_h200, "
                             "moe_h200_<section> with --only, moe_h200_focus with --focus; none "
                             "with --quick)")
    args = parser.parse_args(argv)
    if not args.quick and jax.default_backend() != "gpu":
        parser.error(f"the kernels need a GPU (JAX backend here: {jax.default_backend()}); --quick "
                     "runs tiny shapes in interpret mode on CPU")
    default_name = "moe_h200" + (f"_{args.only}" if args.only else "_focus" if args.focus else "")
    out_name = args.out if args.out is not None else (None if args.quick else default_name)
    return run(quick=args.quick, sweep=args.sweep, only=args.only, focus=args.focus,
               out_name=out_name)


if __name__ == "__main__":
    main()
