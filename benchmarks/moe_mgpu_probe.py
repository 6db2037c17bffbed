"""The one-token expert launch by TMA (``pallas_kernels/moe_decode_mgpu.py``) against the Triton one
(``pallas_kernels/moe_decode.py``) at V2-Lite's layer, in one call: both results against the f32
reference (relative error), then each kernel's time from a profiler trace (µs, and TB/s over the
layer's 139 MB), in turns over ``--rounds``.

    python -m benchmarks.moe_mgpu_probe --out benchmarks/results/moe_mgpu_h200.json
    python -m benchmarks.moe_mgpu_probe --quick     # lower the Mosaic kernel for an abstract H200 (CPU)
    python -m benchmarks.moe_mgpu_probe --trace DIR  # and the Mosaic kernel's per-CTA trace of its scopes
    python -m benchmarks.moe_mgpu_probe --variant RING=5 --variant RING=3  # also under other constants
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import kernel_time_us, markdown_table, traced, write_probe
from benchmarks.kernels_gemv import moe_layer
from pallas_kernels.common import lower_for_h200
from pallas_kernels import moe_decode_mgpu as mgpu
from pallas_kernels.moe_decode import DecodeTiles, moe_decode, moe_decode_reference
from pallas_kernels.moe_decode_mgpu import moe_decode_mgpu

def _inputs(seed: int = 0):
    """V2-Lite's one-token layer (kernels_gemv.moe_layer: stacks of 2 layers, read at layer 1), the
    token's rows, weights and top-k ids."""
    (experts, hidden, _, _, top_k), routed, shared, normal, x_key = moe_layer(seed, quick=False)
    x = normal(x_key, 1, hidden) * 50
    weights = jnp.asarray(np.random.default_rng(seed).random((1, top_k)), jnp.float32)
    ids = jnp.asarray(np.random.default_rng(seed).permutation(experts)[:top_k][None], jnp.int32)
    return x, weights, ids, routed, shared


KERNELS = {
    "triton": lambda x, w, i, routed, shared: moe_decode(x, w, i, *routed, jnp.int32(1), shared, tiles=DecodeTiles()),
    "mosaic tma": lambda x, w, i, routed, shared: moe_decode_mgpu(x, w, i, *routed, jnp.int32(1), shared),
}


def _variant(variant: str):
    """The Mosaic kernel under ``variant`` ("ATTR=VALUE[,ATTR=VALUE]": moe_decode_mgpu's module constants,
    the values Python literals; "built": as built)."""
    settings = {} if variant == "built" else dict(item.split("=", 1) for item in variant.split(","))
    return _with({name: ast.literal_eval(value) for name, value in settings.items()}, KERNELS["mosaic tma"])


def _with(settings: dict, fn):
    """``fn`` traced with moe_decode_mgpu's module constants set as ``settings`` says."""
    def call(*args):
        built = {name: getattr(mgpu, name) for name in settings}  # AttributeError names a wrong constant
        for name, value in settings.items():
            setattr(mgpu, name, value)
        try:
            return fn(*args)
        finally:
            for name, value in built.items():
                setattr(mgpu, name, value)
    return call


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="lower the Mosaic kernel on CPU, time nothing")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="also trace the Mosaic kernel's named scopes (Perfetto JSON and a summary in DIR)")
    parser.add_argument("--variant", action="append", default=[], metavar="ATTR=VALUE[,ATTR=VALUE]",
                        help="also time the Mosaic kernel with these module constants of moe_decode_mgpu "
                             "(e.g. RING=5 or RING=3,BLOCK_I=64)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:  # shapes only: no 2 GB of weights on the CPU; the built kernel and each variant
        shapes = jax.eval_shape(_inputs)
        calls = {}
        for variant in ["built", *args.variant]:
            calls[variant] = lower_for_h200(_variant(variant), *shapes).count("custom_call @mosaic_gpu")
        print(calls)
        return calls
    inputs = _inputs()
    x, weights, ids, routed, shared = inputs
    up = lambda ws: tuple(w.astype(jnp.float32) for w in ws)
    want = np.asarray(moe_decode_reference(x.astype(jnp.float32), weights, ids, *up(routed), 1, up(shared)))
    layer_bytes = (ids.shape[1] * 3 * routed[0].shape[2] * routed[0].shape[3] + sum(w[0].size for w in shared)) * 2
    errors = {}
    for name, fn in KERNELS.items():
        got = np.asarray(jax.jit(fn)(*inputs), np.float32)
        errors[name] = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"{name}: relative error {errors[name]:.2e}", flush=True)
    if args.trace:
        traced(lambda d: jax.jit(functools.partial(moe_decode_mgpu, profile_dir=d))(
            x, weights, ids, *routed, jnp.int32(1), shared), args.trace)
    kernels = dict(KERNELS)
    for variant in args.variant:  # the kernel under other constants: its error checked, then timed in turns
        name = f"mosaic tma, {variant}"
        kernels[name] = fn = _variant(variant)
        got = np.asarray(jax.jit(fn)(*inputs), np.float32)
        errors[name] = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"{name}: relative error {errors[name]:.2e}", flush=True)
    rows = []
    for r in range(args.rounds):
        for name, fn in kernels.items():
            times = kernel_time_us(fn, inputs, calls=args.calls)  # the launch alone: XLA's fusions (the
            us = sum(t for k, t in times.items() if k != "total" and "fusion" not in k)  # partials' sum) left out
            rows.append(dict(round=r, kernel=name, us=round(us, 2), tb_s=round(layer_bytes / us / 1e6, 3),
                             rel_error=errors[name], kernels=sorted(k for k in times if k != "total")))
            print(rows[-1], flush=True)
    return write_probe(rows, markdown_table(rows, ["round", "kernel", "us", "tb_s", "rel_error"]), args.out,
                       layer_mb=round(layer_bytes / 1e6, 1), command="python -m benchmarks.moe_mgpu_probe")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
