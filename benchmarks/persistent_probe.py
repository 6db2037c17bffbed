"""A chain of dependent weight-streaming phases: one launch each, or one persistent Mosaic GPU kernel.

Batch-1 decode is ~19 launches a layer, each a weight stream that needs the previous launch's few
activations; inside XLA's CUDA graphs each costs ~2 µs beyond its bytes, and programmatic dependent
launch does not overlap them there (``benchmarks/pdl_probe.py``, decode_profile.md round 10). The
way left is one kernel per run of phases, resident on every SM, whose CTAs meet at a grid-wide
barrier between phases and stream the next phases' weights before they wait on it (a weight's
address does not depend on the activations). This probe measures what that buys before any decode
kernel is rewritten.

Each phase: every CTA (``--ctas``, by default one an SM) has a weight slab of its own (``--slab-kb`` KiB of bf16) land in
shared memory, reads its right neighbour's row of the previous phase's output ([8, 128] f32) and
writes its own row as that plus one. A CTA reading a row before its writer finished, or a stale row,
leaves a count short; the result is checked exactly (x0 shifted by the phases, plus the phases).
The weights are waited for, not multiplied: the probe times synchronization and streaming, not a
GEMV's arithmetic. Variants:

- ``launches``: one kernel a phase (today's decode: XLA orders them, inside its CUDA graph);
- ``barrier``: one kernel for the whole chain, a grid-wide barrier (a global semaphore counting the
  CTAs' arrivals, ``red.release.gpu`` / ``ld.relaxed.gpu`` + ``fence.acquire.gpu``) between
  phases, no weights: the barrier's own cost;
- ``persistent``: the same with each phase's slab loaded after the barrier;
- ``prefetch``: a ring of ``--stages`` slabs, each phase's load issued ``stages`` phases ahead,
  before the barriers it does not depend on.

The persistent variants move the rows by TMA (``--rows tma``: on the SM's copy engine, behind the
weight slabs it has queued) or by the threads' own loads and stores (``ld``).

The table gives µs a phase and the weights' rate (the H200 copies at 4.27 TB/s). ``--quick`` lowers
every variant for an abstract H200 on CPU (no GPU).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import best_seconds, write_probe
from benchmarks.pdl_probe import ROWS, stream_step
from pallas_kernels.common import lower_for_h200
from pallas_kernels.decode_step_mgpu import proxy_fence

VARIANTS = ("launches", "barrier", "persistent", "prefetch")
ROW_PATHS = ("tma", "ld")


def _slab(slab_kb: int) -> tuple[int, int, int]:
    """A CTA's weight slab of ``slab_kb`` KiB of bf16 as a TMA box [n, 64, 128]."""
    if slab_kb % 16 or not 16 <= slab_kb <= 256:
        raise ValueError(f"slab_kb={slab_kb}: accepted multiples of 16 from 16 to 256")
    return (slab_kb // 16, 64, 128)


def launch_step(x, w):
    """One phase as its own kernel: x f32[C, 8, 128] (the previous phase's rows), w bf16[C, *slab] ->
    rows x[c + 1] + 1 once CTA c's slab has landed (the PDL probe's serial kernel)."""
    return stream_step(x, w, variant="serial", shift=1, update=lambda rows: rows + 1.0)


def persistent_chain(x, weights, *, variant: str, stages: int = 1, rows: str = "tma"):
    """Every phase of ``weights`` [P, C, *slab] in one kernel of C CTAs (all resident at once, or the
    barrier never opens: C at most what the SMs hold together): x f32[C, 8, 128] -> the last phase's rows. Between phases a grid-wide barrier on
    one global semaphore counting arrivals (phase k waits for C * (k + 1) of them). ``rows``: the
    phases' rows move by TMA ("tma", queued on the SM's copy engine behind its weight slabs) or by the
    threads' own loads and stores ("ld")."""
    if rows not in ROW_PATHS:
        raise ValueError(f"rows={rows!r}; accepted: {', '.join(ROW_PATHS)}")
    if variant not in ("barrier", "persistent", "prefetch"):
        raise ValueError(f"variant={variant!r}; accepted: barrier, persistent, prefetch")
    num_phases, num_ctas = weights.shape[:2]
    slab = weights.shape[2:]
    stages = stages if variant == "prefetch" else 1
    loads = variant != "barrier"

    def body(x_ref, w_ref, o_ref, w_smem, rows_smem, bars):
        c = lax.axis_index("c")
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        neighbour = lax.rem(c + 1, num_ctas)

        def load_weights(phase, slot):
            plgpu.copy_gmem_to_smem(w_ref.at[phase, c], w_smem.at[slot], bars.at[slot])

        def arrive():  # this CTA's row is in global memory: count it
            plgpu.wait_smem_to_gmem(0)
            proxy_fence()
            plgpu.semaphore_signal(sem, 1, memory_scope="gpu")

        if variant == "prefetch":
            for s in range(min(stages, num_phases)):
                load_weights(s, s)
        # Phase -1: every CTA publishes its input row in o_ref[1], which phase 0 reads.
        plgpu.copy_gmem_to_smem(x_ref.at[c], rows_smem.at[0], bars.at[stages])
        plgpu.barrier_wait(bars.at[stages])
        plgpu.copy_smem_to_gmem(rows_smem.at[0], o_ref.at[1, c])
        arrive()

        def phase(k, _):
            slot = lax.rem(k, jnp.int32(stages))
            plgpu.semaphore_wait(sem, num_ctas * (k + 1), decrement=False, memory_scope="gpu")
            if variant == "persistent":
                load_weights(k, 0)
            source = o_ref.at[lax.rem(k + 1, 2), neighbour]
            if rows == "tma":
                proxy_fence()
                plgpu.copy_gmem_to_smem(source, rows_smem.at[0], bars.at[stages])
                plgpu.barrier_wait(bars.at[stages])
                new_rows = rows_smem.at[0][...] + 1.0
            else:
                new_rows = source[...] + 1.0
            if loads:
                plgpu.barrier_wait(bars.at[slot])
            if variant == "prefetch":
                @pl.when(k + stages < num_phases)
                def _():
                    load_weights(k + stages, slot)
            if rows == "tma":
                rows_smem.at[1][...] = new_rows
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(rows_smem.at[1], o_ref.at[lax.rem(k, 2), c])
                arrive()
            else:
                o_ref.at[lax.rem(k, 2), c][...] = new_rows
                plgpu.semaphore_signal(sem, 1, memory_scope="gpu")
            return ()

        lax.fori_loop(0, num_phases, phase, ())

        @pl.when(c == 0)
        def _():  # every CTA has passed its last wait once all have arrived: the semaphore back to zero
            plgpu.semaphore_wait(sem, num_ctas * (num_phases + 1), decrement=True, memory_scope="gpu")

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((2, *x.shape), jnp.float32),
        scratch_types=[plgpu.SMEM((stages, *slab), jnp.bfloat16), plgpu.SMEM((2, *ROWS), jnp.float32),
                       plgpu.Barrier(num_barriers=stages + 1)],
        grid=(num_ctas,),
        grid_names=("c",),
    )(x, weights)
    return out[(num_phases - 1) % 2]


def chain_fn(variant: str, reps: int, stages: int, rows: str = "tma"):
    """(x, weights [P, C, *slab]) -> x after reps x P phases, one jitted loop."""
    def run(x, weights):
        def one_pass(_, x):
            if variant == "launches":
                for i in range(weights.shape[0]):
                    x = launch_step(x, weights[i])
                return x
            return persistent_chain(x, weights, variant=variant, stages=stages, rows=rows)
        return lax.fori_loop(0, reps, one_pass, x)
    return jax.jit(run)


def expected(x0, steps: int):
    """Row c after ``steps`` phases: x0's row c + steps (each phase reads the right neighbour), + steps."""
    return jnp.roll(x0, -steps, axis=0) + steps


def measure(variant: str, ctas: int, slab_kb: int, phases: int, reps: int, stages: int, rows: str) -> dict:
    slab = _slab(slab_kb)
    x0 = jnp.floor(jax.random.uniform(jax.random.key(ctas), (ctas, *ROWS), jnp.float32, 0.0, 1000.0))
    weights = jnp.ones((phases, ctas, *slab), jnp.bfloat16)
    fn = chain_fn(variant, reps, stages, rows)
    got = fn(x0, weights).block_until_ready()  # compiles
    wrong = int(jnp.sum(got != expected(x0, phases * reps)))
    us = best_seconds(fn, x0, weights) / (phases * reps) * 1e6
    weight_bytes = 0 if variant == "barrier" else ctas * int(np.prod(slab)) * 2
    return dict(variant=variant, rows="tma" if variant == "launches" else rows, ctas=ctas, slab_kb=slab_kb,
                phases=phases, stages=stages if variant == "prefetch" else None, weight_mb=weight_bytes / 1e6,
                us_per_phase=us, tb_per_s=weight_bytes / us / 1e6, wrong_values=wrong)


def lower_only(variant: str, ctas: int, slab_kb: int, phases: int, stages: int, rows: str) -> str:
    """The variant's StableHLO for an abstract H200 (no GPU needed)."""
    args = (jax.ShapeDtypeStruct((ctas, *ROWS), jnp.float32),
            jax.ShapeDtypeStruct((phases, ctas, *_slab(slab_kb)), jnp.bfloat16))
    return lower_for_h200(chain_fn(variant, 2, stages, rows), *args)


def table(rows: list[dict]) -> str:
    lines = ["| variant | rows | CTAs | phases | weights a phase | stages | µs a phase | TB/s | wrong values |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['rows']} | {r['ctas']} | {r['phases']} | {r['weight_mb']:.1f} MB | "
              f"{r['stages'] or '-'} | "
              f"{r['us_per_phase']:.2f} | {r['tb_per_s']:.2f} | {r['wrong_values']} |" for r in rows]
    return "\n".join(lines)


def _grid(args):
    """(variant, stages, rows) of each measured row: stages only for prefetch, row paths only for the
    persistent variants."""
    return [(v, st, r) for v in args.variants for st in (args.stages if v == "prefetch" else [1])
            for r in (["tma"] if v == "launches" else args.rows)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ctas", type=int, default=132, help="CTAs (at most the SMs: all must be resident)")
    parser.add_argument("--slab-kb", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--bytes-per-pass", type=float, default=200e6,
                        help="weights of one pass over the chain (phases follow): beyond the 50 MB L2")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rows", nargs="+", default=list(ROW_PATHS), choices=ROW_PATHS,
                        help="how the persistent variants move the phases' rows")
    parser.add_argument("--quick", action="store_true", help="lower each variant on CPU, time nothing")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    if args.quick:
        result = {}
        for variant, stages, rows in _grid(args):
            text = lower_only(variant, args.ctas, args.slab_kb[0], 4, stages, rows)
            result[f"{variant}/{stages}/{rows}"] = dict(mosaic_calls=text.count("mosaic_gpu"))
        print(json.dumps(result))
        return result
    rows = []
    for slab_kb in args.slab_kb:
        phases = max(8, int(args.bytes_per_pass // (args.ctas * slab_kb * 1024)))
        for variant, stages, row_path in _grid(args):
            rows.append(measure(variant, args.ctas, slab_kb, phases, args.reps, stages, row_path))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    return write_probe(rows, table(rows), args.out, reps=args.reps)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
