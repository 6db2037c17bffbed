"""The stacked decode GEMV on one GPU: a tile sweep at V2-Lite's decode projections, the shared-expert
MLP at one token through the stacked GEMVs against the grouped kernels (what ``dispatch.stacked_mlp``
picks), the kernel against XLA's GEMM on the layer's slice at 1-64 token rows (where
``dispatch.STACKED_GEMV_MAX_TOKENS`` should sit), and MLA's absorbed per-head products (w_uk, w_uv)
through ``stacked_head_gemv`` against XLA's einsum on the layer's slice; the fused launches the
engine makes at one token (norm + q + kv_a; norm + f32 router + shared gate and up) over their splits
and column tiles; and a MoE layer at one and
two tokens (V2-Lite: top-6 of 64 routed experts plus the shared ones) through the grouped path against
``moe_decode``'s one launch, over its tiles (where ``dispatch.MOE_DECODE_MAX_TOKENS`` should sit); and
that launch at one token over program counts (``moe_waves``: bound by HBM or by 176 programs on 132 SMs?).

Shapes (bf16, random, one token, a stack of 26 layers read at layer 3): q_proj 2048 -> 3072, o_proj
2048 -> 2048, kv_a_proj 2048 -> 576, a shared-expert gate 2048 -> 2816 and its down 2816 -> 2048.
Each config runs at its default K splits, half and twice them. Times are the kernels' own device time
per call from a profiler trace (``benchmarks.common.kernel_time_us``: the GEMV plus XLA's sum of its
K-split partials); TB/s counts the layer's weight bytes.

    python benchmarks/kernels_gemv.py           # GPU: table + benchmarks/results/gemv_h200.json
    python benchmarks/kernels_gemv.py --quick   # tiny shapes in interpret mode (CPU smoke test)
    python benchmarks/kernels_gemv.py --only fused_launches moe_one_launch --out gemv_decode_h200
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, kernel_time_us, markdown_table, run_interpret, write_result  # noqa: E402
from dsjax.model import dispatch  # noqa: E402
from pallas_kernels.common import rms_norm  # noqa: E402
from pallas_kernels.moe_decode import DecodeTiles, moe_decode  # noqa: E402
from pallas_kernels.moe_experts import moe_experts  # noqa: E402
from pallas_kernels.stacked_gemv import default_splits, stacked_gemv, stacked_gemvs, stacked_head_gemv  # noqa: E402

SHAPES = {"q_proj": (2048, 3072), "o_proj": (2048, 2048), "kv_a": (2048, 576), "shared_gate": (2048, 2816),
          "shared_down": (2816, 2048)}
QUICK_SHAPES = {"quick": (64, 96)}
# (block_n, block_k, num_warps, num_stages); the kernel's default first
CONFIGS = [(64, 128, 4, 3), (128, 128, 4, 3), (32, 128, 4, 3), (64, 256, 4, 2), (64, 64, 4, 4), (128, 64, 4, 4),
           (64, 128, 8, 3), (128, 256, 8, 2), (32, 256, 4, 3),
           # one stage: a program of the default splits makes one or two K steps, and unstaged tiles
           # take a third of the shared memory, so more programs share an SM's loads
           (64, 128, 4, 1), (128, 128, 4, 1)]
QUICK_CONFIGS = [(32, 32, 4, 2)]
LAYERS, LAYER = 26, 3


def _time(fn, args, *, quick: bool) -> tuple[float, dict]:
    if quick:  # interpret mode on CPU: no device trace, just that it runs
        run_interpret(fn, *args)
        return float("nan"), {}
    kernels = kernel_time_us(fn, args)
    return kernels.pop("total"), kernels


def sweep(shapes: dict, configs: list, *, quick: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for name, (depth, width) in shapes.items():
        w = jnp.asarray(rng.standard_normal((2 if quick else LAYERS, depth, width)) * 0.02, jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((1, depth)), jnp.bfloat16)
        for block_n, block_k, num_warps, num_stages in configs:
            auto = default_splits(depth, width, block_n, block_k)
            for splits in sorted({auto, max(1, auto // 2), min(auto * 2, max(1, depth // block_k))}):
                fn = lambda x, w, layer, s=splits, c=(block_n, block_k, num_warps, num_stages): stacked_gemv(
                    x, w, layer, num_splits=s, block_n=c[0], block_k=c[1], num_warps=c[2], num_stages=c[3],
                    interpret=quick)
                us, kernels = _time(fn, (x, w, jnp.int32(1 if quick else LAYER)), quick=quick)
                rows.append(dict(shape=name, K=depth, N=width, block_n=block_n, block_k=block_k, num_warps=num_warps,
                                 num_stages=num_stages, num_splits=splits, default_splits=splits == auto, us=us,
                                 tb_per_s=depth * width * 2 / us / 1e6, kernels_us=kernels))
                print(f"  {name:<12} {block_n:>4} x {block_k:<4} w{num_warps} s{num_stages} splits {splits:>3}"
                      f"{'*' if splits == auto else ' '} {us:8.2f} us {rows[-1]['tb_per_s']:6.2f} TB/s", flush=True)
    return rows


def shared_mlp(*, quick: bool) -> list[dict]:
    """One token through one layer's shared experts (V2-Lite: 2 x 1408 = 2816 wide) both ways."""
    rng = np.random.default_rng(1)
    hidden, inter, layers = (64, 96, 2) if quick else (2048, 2816, LAYERS)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.02, jnp.bfloat16)
    args = (w(1, hidden), w(layers, hidden, inter), w(layers, hidden, inter), w(layers, inter, hidden),
            jnp.int32(1 if quick else LAYER))
    backend = "interpret" if quick else "pallas"

    def grouped(x, wg, wu, wd, layer):  # the kernels dispatch.stacked_mlp runs above 16 tokens
        ones, zeros = jnp.ones((1, 1), jnp.float32), jnp.zeros((1, 1), jnp.int32)
        return moe_experts(x, ones, zeros, wg[:, None], wu[:, None], wd[:, None], layer=layer, interpret=quick)

    rows = []
    for impl, fn in (("grouped kernels", grouped),
                     ("stacked GEMVs", lambda *a: dispatch.stacked_mlp(*a, backend=backend))):
        us, kernels = _time(fn, args, quick=quick)
        rows.append(dict(impl=impl, us=us, tb_per_s=3 * hidden * inter * 2 / us / 1e6, kernels_us=kernels))
        print(f"  shared MLP, one token, {impl:<16} {us:8.2f} us", flush=True)
    return rows


ROW_COUNTS, QUICK_ROW_COUNTS = (1, 16, 32, 64), (1, 20)


def rows_vs_xla(shapes: dict, row_counts, *, quick: bool) -> list[dict]:
    """The kernel (default tiles) against ``jnp.dot(x, w[layer])`` with a traced layer index (XLA
    slices the stack, as inside the engine's layer scan) at several row counts."""
    rng = np.random.default_rng(2)
    rows = []
    for name, (depth, width) in shapes.items():
        w = jnp.asarray(rng.standard_normal((2 if quick else LAYERS, depth, width)) * 0.02, jnp.bfloat16)
        for num_rows in row_counts:
            x = jnp.asarray(rng.standard_normal((num_rows, depth)), jnp.bfloat16)
            row = dict(shape=name, rows=num_rows)
            for impl, fn in (("stacked_gemv", lambda x, w, layer: stacked_gemv(x, w, layer, interpret=quick)),
                             ("xla_slice_dot", lambda x, w, layer: jnp.dot(x, w[layer],
                                                                           preferred_element_type=jnp.float32))):
                row[f"{impl}_us"], _ = _time(fn, (x, w, jnp.int32(1 if quick else LAYER)), quick=quick)
            rows.append(row)
            print(f"  {name:<12} {num_rows:>3} rows: stacked_gemv {row['stacked_gemv_us']:8.2f} us, "
                  f"XLA slice + dot {row['xla_slice_dot_us']:8.2f} us", flush=True)
    return rows


# (name, [(K, N, dtype) of each weight]): the launches MLAttention / MoE.decode make at one token
FUSED_LAUNCHES = {"norm+q+kv_a": [(2048, 3072, jnp.bfloat16), (2048, 576, jnp.bfloat16)],
                  "norm+router+gate+up": [(2048, 64, jnp.float32), (2048, 2816, jnp.bfloat16),
                                          (2048, 2816, jnp.bfloat16)],
                  "norm+router": [(2048, 64, jnp.float32)]}
QUICK_FUSED_LAUNCHES = {"quick": [(64, 8, jnp.float32), (64, 96, jnp.bfloat16)]}


def fused_launches(launches: dict, *, quick: bool) -> list[dict]:
    """Each fused launch at one row with the RMSNorm folded in: default splits, half and twice them,
    64- or 128-column tiles, the default pipeline stages or one (see CONFIGS); TB/s counts the weights'
    bytes."""
    rng = np.random.default_rng(5)
    rows = []
    for name, shapes in launches.items():
        depth = shapes[0][0]
        ws = tuple(jnp.asarray(rng.standard_normal((2 if quick else LAYERS, k, n)) * 0.02, dtype)
                   for k, n, dtype in shapes)
        x = jnp.asarray(rng.standard_normal((1, depth)), jnp.bfloat16)
        norm = jnp.ones((ws[0].shape[0], depth), jnp.bfloat16)
        weight_bytes = sum(w.size // w.shape[0] * w.dtype.itemsize for w in ws)
        stage_options = (2,) if quick else (3, 1)  # the kernel's default first
        for block_n, stages in itertools.product((32,) if quick else (64, 128), stage_options):
            block_k = 32 if quick else 128
            auto = default_splits(depth, sum(n for _, n, _ in shapes), block_n, block_k)
            for splits in sorted({auto, max(1, auto // 2), min(2 * auto, max(1, depth // block_k))}):
                fn = lambda x, ws, layer, norm, c=(splits, block_n, block_k, stages): stacked_gemvs(
                    x, ws, layer, norm, eps=1e-6, num_splits=c[0], block_n=c[1], block_k=c[2], num_stages=c[3],
                    interpret=quick)
                us, _ = _time(fn, (x, ws, jnp.int32(1 if quick else LAYER), norm), quick=quick)
                rows.append(dict(launch=name, block_n=block_n, num_stages=stages, num_splits=splits,
                                 default=splits == auto and stages == stage_options[0], us=us,
                                 tb_per_s=weight_bytes / us / 1e6))
                print(f"  {name:<20} {block_n:>4} cols, s{stages}, {splits:>3} splits{'*' if splits == auto else ' '}"
                      f" {us:8.2f} us {rows[-1]['tb_per_s']:6.2f} TB/s", flush=True)
    return rows


HEAD_CONFIGS, QUICK_HEAD_CONFIGS = [(64, 64), (32, 64), (64, 128), (128, 64), (32, 128)], [(16, 16)]


def head_products(row_counts, configs, *, quick: bool) -> list[dict]:
    """MLA's absorbed products at V2-Lite shapes (16 heads, latent 512, head dims 128): w_uk takes each
    head's nope query into the latent space (contracting the weight's head columns), w_uv the attended
    latent to the head's values (contracting its rows). ``stacked_head_gemv`` (a tile sweep at one row,
    default tiles above) against ``jnp.einsum`` on ``w[layer]`` (XLA transposes the stack for it)."""
    rng = np.random.default_rng(3)
    heads, latent, head_dim = (4, 40, 24) if quick else (16, 512, 128)
    w = jnp.asarray(rng.standard_normal((2 if quick else LAYERS, latent, heads, head_dim)) * 0.05, jnp.bfloat16)
    layer = jnp.int32(1 if quick else LAYER)
    rows = []
    for name, contract_rows, spec in (("w_uk", False, "mhn,chn->mhc"), ("w_uv", True, "mhc,chv->mhv")):
        for num_rows in row_counts:
            x = jnp.asarray(rng.standard_normal((num_rows, heads, latent if contract_rows else head_dim)), jnp.bfloat16)
            for block_n, block_k in configs if num_rows == 1 else configs[:1]:
                fn = lambda x, w, layer, c=(block_n, block_k), r=contract_rows: stacked_head_gemv(
                    x, w, layer, contract_rows=r, block_n=c[0], block_k=c[1], interpret=quick)
                row = dict(weight=name, rows=num_rows, block_n=block_n, block_k=block_k)
                row["kernel_us"], _ = _time(fn, (x, w, layer), quick=quick)
                if (block_n, block_k) == configs[0]:
                    xla = lambda x, w, layer, spec=spec: jnp.einsum(spec, x, w[layer],
                                                                    preferred_element_type=jnp.float32)
                    row["xla_einsum_us"], _ = _time(xla, (x, w, layer), quick=quick)
                rows.append(row)
                print(f"  {name} {num_rows:>3} rows {block_n:>3} x {block_k:<3}: {row['kernel_us']:8.2f} us"
                      f" (XLA einsum {row.get('xla_einsum_us', float('nan')):8.2f} us)", flush=True)
    return rows


DECODE_TILES = [DecodeTiles(), DecodeTiles(block_i=32), DecodeTiles(block_i=128), DecodeTiles(block_k=64),
                DecodeTiles(block_d=256), DecodeTiles(block_i=32, block_k=256, num_stages=2),
                DecodeTiles(num_warps=8)]
QUICK_DECODE_TILES = [DecodeTiles(block_i=16, block_k=16, block_d=32, num_stages=2)]


def moe_layer(seed: int, *, quick: bool):
    """One MoE layer's random bf16 weights, stacks of 2 layers (read at layer 1): (dims, stacks, shared,
    normal, key) with dims = (experts, hidden, inter, shared_inter, top_k) and ``normal(key, *shape)``
    for the caller's own rows from ``key``."""
    dims = (8, 64, 48, 96, 2) if quick else (64, 2048, 1408, 2816, 6)
    experts, hidden, inter, shared_inter, _ = dims
    keys = jax.random.split(jax.random.key(seed), 7)
    normal = lambda key, *shape: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
    stacks = (normal(keys[0], 2, experts, hidden, inter), normal(keys[1], 2, experts, hidden, inter),
              normal(keys[2], 2, experts, inter, hidden))
    shared = (normal(keys[3], 2, hidden, shared_inter), normal(keys[4], 2, hidden, shared_inter),
              normal(keys[5], 2, shared_inter, hidden))
    return dims, stacks, shared, normal, keys[6]


def moe_one_launch(token_counts, configs, *, quick: bool) -> list[dict]:
    """One MoE layer's experts at decode sizes, stacks of 2 layers read at layer 1: the grouped path
    (sort, grouped SwiGLU, grouped down, combine; shared experts through ``dispatch.stacked_mlp``)
    against ``moe_decode`` (routed and shared experts in one launch) at each tile config."""
    (experts, hidden, inter, shared_inter, top_k), stacks, shared, normal, x_key = moe_layer(4, quick=quick)
    backend = "interpret" if quick else "pallas"
    layer = jnp.int32(1)
    rows = []
    for num_tokens in token_counts:
        x = normal(x_key, num_tokens, hidden) * 50
        ids = jnp.asarray(np.stack([np.random.default_rng(t).permutation(experts)[:top_k] for t in range(num_tokens)]),
                          jnp.int32)
        weights = jnp.full((num_tokens, top_k), 1.0 / top_k, jnp.float32)

        def grouped(x, weights, ids, stacks, shared, layer):
            routed = moe_experts(x, weights, ids, *stacks, layer=layer, interpret=quick)
            return routed + dispatch.stacked_mlp(x, *shared, layer, backend)

        args = (x, weights, ids, stacks, shared, layer)
        distinct = len(set(np.asarray(ids).reshape(-1).tolist()))
        weight_bytes = (distinct * 3 * hidden * inter + 3 * hidden * shared_inter) * 2
        for name, fn in [("grouped", grouped)] + [
                (f"moe_decode {c.block_i}x{c.block_k}x{c.block_d} w{c.num_warps} s{c.num_stages}",
                 lambda x, w, i, st, sh, l, c=c: moe_decode(x, w, i, *st, l, sh, tiles=c, interpret=quick))
                for c in configs]:
            us, _ = _time(fn, args, quick=quick)
            rows.append(dict(tokens=num_tokens, impl=name, us=us, tb_per_s=weight_bytes / us / 1e6))
            print(f"  MoE layer, {num_tokens} token(s), {name:<32} {us:8.2f} us {rows[-1]['tb_per_s']:6.2f} TB/s",
                  flush=True)
    return rows


PARTS = ("sweep", "shared_mlp", "rows_vs_xla", "fused_launches", "head_products", "moe_one_launch", "moe_waves",
         "dense_mlp")
# (block_n, num_splits or None for the default, num_stages) of the dense MLP's two launches; the kernel's own first
DENSE_CONFIGS = [(None, None, 3), (128, 4, 3), (128, 8, 3), (256, 2, 3), (256, 4, 3), (128, 2, 3), (64, 4, 3),
                 (128, 4, 1), (256, 2, 2)]
QUICK_DENSE_CONFIGS = [(None, None, 2), (32, 2, 2)]


def dense_mlp(configs, *, quick: bool) -> list[dict]:
    """The dense layer 0's SwiGLU MLP at one token (V2-Lite: 2048 -> 2 x 10944 -> 2048, 134 MB, a stack of
    one layer as the engine holds it): the normed gate / up launch and the down launch at each tile config,
    against XLA's GEMMs on the slice (the norm and silu as jnp), and the same with gate and up concatenated
    into one [D, 2I] weight. TB/s counts each part's weight bytes."""
    rng = np.random.default_rng(6)
    hidden, inter = (64, 96) if quick else (2048, 10944)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.02, jnp.bfloat16)
    x, wg, wu, wd = w(1, hidden) * 50, w(1, hidden, inter), w(1, hidden, inter), w(1, inter, hidden)
    g, layer, eps = jnp.ones((1, hidden), jnp.bfloat16), jnp.int32(0), 1e-6
    h = w(1, inter)
    up_bytes, down_bytes = 2 * hidden * inter * 2, hidden * inter * 2
    rows = []

    def record(impl, part, fn, args, weight_bytes):
        us, kernels = _time(fn, args, quick=quick)
        rows.append(dict(impl=impl, part=part, us=us, tb_per_s=weight_bytes / us / 1e6, kernels_us=kernels))
        print(f"  dense MLP {part:<8} {impl:<36} {us:8.2f} us {rows[-1]['tb_per_s']:6.2f} TB/s", flush=True)

    for block_n, splits, stages in configs:
        name = f"stacked_gemvs {block_n or 'auto'} cols, {splits or 'auto'} splits, s{stages}"
        options = dict(block_n=block_n, num_splits=splits, num_stages=stages, interpret=quick)
        record(name, "gate_up", lambda x, wg, wu, g, l, o=options: stacked_gemvs(x, (wg, wu), l, g, eps=eps, **o),
               (x, wg, wu, g, layer), up_bytes)
        record(name, "down", lambda h, wd, l, o=options: stacked_gemvs(h, (wd,), l, **o), (h, wd, layer), down_bytes)
    f32 = jnp.float32
    normed = lambda x, g, l: rms_norm(x, g[l], eps)  # the model's RMSNorm
    record("XLA dot on the slices", "gate_up",
           lambda x, wg, wu, g, l: (jnp.dot(normed(x, g, l), wg[l], preferred_element_type=f32),
                                    jnp.dot(normed(x, g, l), wu[l], preferred_element_type=f32)),
           (x, wg, wu, g, layer), up_bytes)
    wgu = jnp.concatenate([wg, wu], axis=-1)
    record("XLA dot, gate and up as one weight", "gate_up",
           lambda x, wgu, g, l: jnp.dot(normed(x, g, l), wgu[l], preferred_element_type=f32),
           (x, wgu, g, layer), up_bytes)
    record("stacked_gemvs, gate and up as one weight", "gate_up",
           lambda x, wgu, g, l: stacked_gemvs(x, (wgu,), l, g, eps=eps, interpret=quick), (x, wgu, g, layer), up_bytes)
    record("XLA dot on the slice", "down", lambda h, wd, l: jnp.dot(h, wd[l], preferred_element_type=f32),
           (h, wd, layer), down_bytes)
    backend = "interpret" if quick else "pallas"
    record("dispatch.stacked_mlp (as the engine)", "whole",
           lambda x, wg, wu, wd, g, l: dispatch.stacked_swiglu_down(
               *dispatch.stacked_matmuls(x, (wg, wu), l, backend, norm=(g, eps))[:2], wd, l, backend, x.dtype),
           (x, wg, wu, wd, g, layer), up_bytes + down_bytes)
    record("XLA dots", "whole",
           lambda x, wgu, wd, g, l: jnp.dot(
               (jax.nn.silu(p := jnp.dot(normed(x, g, l), wgu[l], preferred_element_type=f32))[:, :inter]
                * p[:, inter:]).astype(x.dtype), wd[l], preferred_element_type=f32),
           (x, wgu, wd, g, layer), up_bytes + down_bytes)
    return rows


def moe_waves(*, quick: bool) -> list[dict]:
    """Whether ``moe_decode`` at one token is bound by HBM or by its programs' spread over the SMs: the
    default tiles (64 intermediate columns a program) over routed experts alone or with the shared
    ones, at top-k 2-6, so program counts (and the SMs holding two programs) vary at equal bytes:
    V2-Lite's layer is 6 x 22 routed + 44 shared programs on 132 SMs, 44 of them holding two."""
    (experts, hidden, inter, shared_inter, _), stacks, shared, normal, x_key = moe_layer(5, quick=quick)
    x = normal(x_key, 1, hidden) * 50
    tiles = DecodeTiles(16, 16, 32, 4, 2) if quick else DecodeTiles()
    per_expert = -(-inter // tiles.block_i)
    rows = []
    for top_k, with_shared in itertools.product((2, 4, 6), (False, True)):
        ids = jnp.asarray(np.random.default_rng(top_k).permutation(experts)[None, :top_k], jnp.int32)
        weights = jnp.full((1, top_k), 1.0 / top_k, jnp.float32)
        sh = shared if with_shared else None
        fn = lambda x, w, i, st, sh, c=tiles: moe_decode(x, w, i, *st, jnp.int32(1), sh, tiles=c, interpret=quick)
        us, _ = _time(fn, (x, weights, ids, stacks, sh), quick=quick)
        programs = top_k * per_expert + (-(-shared_inter // tiles.block_i) if with_shared else 0)
        weight_bytes = (top_k * 3 * hidden * inter + (3 * hidden * shared_inter if with_shared else 0)) * 2
        rows.append(dict(top_k=top_k, shared=with_shared, programs=programs, mb=weight_bytes / 1e6, us=us,
                         tb_per_s=weight_bytes / us / 1e6))
        print(f"  moe_decode top-{top_k} {'+ shared' if with_shared else 'alone   '} {programs:4d} programs "
              f"{weight_bytes / 1e6:7.1f} MB {us:8.2f} us {rows[-1]['tb_per_s']:6.2f} TB/s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU, CI)")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=PARTS, help="run these parts (default: all)")
    parser.add_argument("--out", default="gemv_h200", help="results name under benchmarks/results (not with --quick)")
    args = parser.parse_args(argv)
    quick, only = args.quick, set(args.only)
    row_counts = QUICK_ROW_COUNTS if quick else ROW_COUNTS
    runs = {
        "sweep": lambda: sweep(QUICK_SHAPES if quick else SHAPES, QUICK_CONFIGS if quick else CONFIGS, quick=quick),
        "shared_mlp": lambda: shared_mlp(quick=quick),
        "rows_vs_xla": lambda: rows_vs_xla(QUICK_SHAPES if quick else {k: SHAPES[k] for k in ("q_proj", "shared_down")},
                                           row_counts, quick=quick),
        "fused_launches": lambda: fused_launches(QUICK_FUSED_LAUNCHES if quick else FUSED_LAUNCHES, quick=quick),
        "head_products": lambda: head_products(row_counts, QUICK_HEAD_CONFIGS if quick else HEAD_CONFIGS, quick=quick),
        "moe_one_launch": lambda: moe_one_launch((1, 2), QUICK_DECODE_TILES if quick else DECODE_TILES, quick=quick),
        "moe_waves": lambda: moe_waves(quick=quick),
        "dense_mlp": lambda: dense_mlp(QUICK_DENSE_CONFIGS if quick else DENSE_CONFIGS, quick=quick),
    }
    results = {part: runs[part]() for part in PARTS if part in only}
    tables = []
    if rows := results.get("sweep"):
        best = {}
        for row in rows:
            if row["shape"] not in best or row["us"] < best[row["shape"]]["us"]:
                best[row["shape"]] = row
        default = {r["shape"]: r for r in rows if r["default_splits"] and (r["block_n"], r["block_k"], r["num_warps"],
                                                                           r["num_stages"]) == CONFIGS[0]}
        table_rows = [dict(shape=s, K=b["K"], N=b["N"], default_us=default[s]["us"] if s in default else None,
                           best_us=b["us"], best_tb_per_s=b["tb_per_s"],
                           best_config=f"{b['block_n']}x{b['block_k']} w{b['num_warps']} s{b['num_stages']} "
                                       f"splits {b['num_splits']}") for s, b in best.items()]
        tables.append(markdown_table(table_rows, list(table_rows[0])))
    columns = {"shared_mlp": ["impl", "us", "tb_per_s"], "rows_vs_xla": None,
               "fused_launches": ["launch", "block_n", "num_stages", "num_splits", "default", "us", "tb_per_s"],
               "head_products": ["weight", "rows", "block_n", "block_k", "kernel_us", "xla_einsum_us"],
               "moe_one_launch": ["tokens", "impl", "us", "tb_per_s"],
               "moe_waves": ["top_k", "shared", "programs", "mb", "us", "tb_per_s"],
               "dense_mlp": ["part", "impl", "us", "tb_per_s"]}
    for part, cols in columns.items():
        if part in results:
            tables.append(markdown_table(results[part], cols or list(results[part][0])))
    table = "\n\n".join(tables)
    print(table)
    payload = {**environment(), **results, "table": table}
    if not quick:
        print("wrote", write_result(args.out, payload))
    return payload


if __name__ == "__main__":
    main()
