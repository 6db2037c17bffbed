"""Programmatic dependent launch (PDL) between Mosaic GPU kernels on one GPU, in isolation.

Batch-1 decode is a chain of small launches, each a weight stream that needs only a few activations
from the launch before it (benchmarks/results/decode_profile.md, rounds 6-10). With PDL a kernel's
CTAs start while its predecessor drains: each streams its weights first and waits
(``griddepcontrol.wait``) only before it reads the predecessor's output. Pallas' Triton lowering has
no such wait; Mosaic GPU has (``plgpu.griddepcontrol_wait``, and the kernel is launched with
programmatic stream serialization). This probe measures what it buys before any decode kernel moves:
a chain of ``--chain`` kernels, each TMA-loading its own weight slab (64 KiB a CTA, ``--tiles`` CTAs,
not L2-resident across the chain) and then turning the predecessor's [tiles, 8, 128] f32 rows into
x * 0.5 + 1 (a real dependence: a kernel that read its input early would compute from stale rows, and
the chain's result is checked). Variants:

- ``serial``: no grid-dependency control (the launch waits for its predecessor, as today);
- ``pdl``: ``griddepcontrol.wait`` after the weights' copy is issued, before the input's;
- ``pdl_trigger``: that, and ``griddepcontrol.launch_dependents`` at the start, so the successor's CTAs
  may become resident while this kernel still streams.

Each variant runs the chain ``--reps`` times inside one jitted loop; the table gives µs a kernel and
the weights' rate (the H200 copies at 4.27 TB/s). ``--quick`` lowers every variant for an abstract
H200 on CPU (no GPU) and checks that the PDL variants carry the launch attribute.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import best_seconds, write_probe
from pallas_kernels.common import lower_for_h200

SLAB = (4, 64, 128)  # a CTA's weights: 64 KiB of bf16
ROWS = (8, 128)  # a CTA's share of the carried activations (f32)
VARIANTS = ("serial", "pdl", "pdl_trigger")


def stream_step(x, w, *, variant: str, shift: int = 0, update=lambda rows: rows * 0.5 + 1.0):
    """x f32[C, 8, 128] (the predecessor's output), w bf16[C, *slab] -> row c is update(x[(c + shift) % C]),
    after CTA c's weight slab has landed in shared memory (``benchmarks/persistent_probe.py`` reads a
    neighbour's row and adds one)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; accepted: {', '.join(VARIANTS)}")
    num_tiles = x.shape[0]

    def body(x_ref, w_ref, o_ref, w_smem, x_smem, bars):
        c = lax.axis_index("c")
        if variant == "pdl_trigger":
            plgpu.griddepcontrol_launch_dependents()
        plgpu.copy_gmem_to_smem(w_ref.at[c], w_smem, bars.at[0])  # independent of the predecessor
        if variant != "serial":
            plgpu.griddepcontrol_wait()  # the predecessor's writes are visible after this
        plgpu.copy_gmem_to_smem(x_ref.at[lax.rem(c + shift, num_tiles)], x_smem, bars.at[1])
        plgpu.barrier_wait(bars.at[1])
        rows = x_smem[...]
        plgpu.barrier_wait(bars.at[0])
        x_smem[...] = update(rows)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem, o_ref.at[c])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, jnp.float32),
        scratch_types=[plgpu.SMEM(w.shape[1:], jnp.bfloat16), plgpu.SMEM(ROWS, jnp.float32),
                       plgpu.Barrier(num_barriers=2)],
        grid=(num_tiles,),
        grid_names=("c",),
    )(x, w)


def chain_fn(variant: str, chain: int, reps: int):
    """(x, weights [chain, C, 4, 64, 128]) -> x after reps x chain kernels, one jitted loop."""
    step = functools.partial(stream_step, variant=variant)

    def run(x, weights):
        def one_pass(_, x):
            for i in range(chain):
                x = step(x, weights[i])
            return x
        return lax.fori_loop(0, reps, one_pass, x)

    return jax.jit(run)


def expected(x0, steps: int):
    """x -> x * 0.5 + 1 applied ``steps`` times, in closed form: 2 + (x0 - 2) / 2^steps."""
    return 2.0 + (x0 - 2.0) * 0.5 ** steps


def measure(variant: str, tiles: int, chain: int, reps: int) -> dict:
    key = jax.random.key(tiles)
    x0 = jax.random.uniform(key, (tiles, *ROWS), jnp.float32, 0.0, 4.0)
    weights = jnp.ones((chain, tiles, *SLAB), jnp.bfloat16)
    fn = chain_fn(variant, chain, reps)
    got = fn(x0, weights).block_until_ready()  # compiles
    error = float(jnp.abs(got - expected(x0, chain * reps)).max())
    us = best_seconds(fn, x0, weights) / (chain * reps) * 1e6
    weight_bytes = tiles * np.prod(SLAB) * 2
    return dict(variant=variant, tiles=tiles, weight_mb=weight_bytes / 1e6, us_per_kernel=us,
                tb_per_s=weight_bytes / us / 1e6, max_error=error, xla_flags=os.environ.get("XLA_FLAGS", ""))


def lower_only(variant: str, tiles: int) -> str:
    """The variant's StableHLO for an abstract H200 (no GPU needed)."""
    args = (jax.ShapeDtypeStruct((tiles, *ROWS), jnp.float32), jax.ShapeDtypeStruct((tiles, *SLAB), jnp.bfloat16))
    return lower_for_h200(functools.partial(stream_step, variant=variant), *args)


def table(rows: list[dict]) -> str:
    lines = ["| variant | tiles (CTAs) | weights a kernel | µs a kernel | TB/s | max error | XLA_FLAGS |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['tiles']} | {r['weight_mb']:.1f} MB | {r['us_per_kernel']:.2f} | "
              f"{r['tb_per_s']:.2f} | {r['max_error']:.1e} | {r['xla_flags'] or '(default)'} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--chain", type=int, default=24)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="lower each variant on CPU, time nothing")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    if args.quick:
        lowered = {v: lower_only(v, args.tiles[0]) for v in VARIANTS}
        result = {v: dict(mosaic_calls=text.count("mosaic_gpu"), uses_pdl="uses_pdl" in text)
                  for v, text in lowered.items()}
        print(json.dumps(result))
        return result
    rows = [measure(v, tiles, args.chain, args.reps) for tiles in args.tiles for v in VARIANTS]
    return write_probe(rows, table(rows), args.out, chain=args.chain, reps=args.reps)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
