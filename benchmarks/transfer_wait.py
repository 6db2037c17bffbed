"""Does queuing a program wait for the device when its inputs come from host memory?

Round 31 (decode_profile.md) found that each batch-1 step's launch call, queued right behind the step before,
holds the host for about that whole step, against ~1 ms with the device idle, and that two compiled copies of
the step launched in turns do not change this (round 32). This probe separates the transfer of the step's
small host inputs from the launch itself:

    python -m benchmarks.transfer_wait                         # synthetic: a ~1.5 ms program, then each case
    python -m benchmarks.transfer_wait --engine --preset deepseek-v2-lite --hlo /tmp/forward.txt

Synthetic cases, each timed with a busy program (a chain of matmuls) queued just before and again with the
device idle: a tiny program on a device array (no transfer), the same on a numpy array (jit's implicit
transfer), ``jax.device_put`` of a numpy array, and ``device_put`` into pinned host memory; and the busy
program queued on its own pending output, as is and donating it. With ``--engine``: the engine's batch-1 step
launched back to back (as ``runner.launch`` does, inputs from host) against the same step on its packed inputs
placed on the device once, and its forward alone (no sampler): each launch call's host ms and the loop's ms a
step. Run it again under ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` to see the CUDA graphs' part.

``anatomy`` rows: two launches from an idle device, when each call returns and when the second is ready. On
the H200 (round 32) the second forward's call returned ~0.5 ms after the first's start, long before the first
ended: a launch does not wait for the step before it. The loop's long calls are its queue filling up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import markdown_table, write_probe

NAME = "transfer_wait"


def _busy_program(size: int, chain: int):
    """-> (a jitted chain of ``chain`` [size, size] bf16 matmuls, its input): a program of a few ms."""
    w = jnp.eye(size, dtype=jnp.bfloat16)

    @jax.jit
    def busy(x):
        for _ in range(chain):
            x = x @ w
        return x

    return busy, jnp.ones((size, size), jnp.bfloat16)


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def synthetic(reps: int, size: int, chain: int) -> list[dict]:
    """One row a case: the host µs of its call with the busy program queued just before, and idle."""
    busy, x = _busy_program(size, chain)
    tiny = jax.jit(lambda v: v + 1)
    host = np.arange(8, dtype=np.int32)
    on_device = jax.device_put(host)
    dev = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    cases = {
        "tiny(device array)": lambda: tiny(on_device),
        "tiny(numpy array)": lambda: tiny(host),
        "device_put(numpy)": lambda: jax.device_put(host, dev),
        "device_put(numpy, pinned_host)": lambda: jax.device_put(host, pinned),
    }
    jax.block_until_ready(busy(x))
    start = time.perf_counter()
    for _ in range(5):
        y = busy(x)
    jax.block_until_ready(y)
    busy_us = (time.perf_counter() - start) / 5 * 1e6
    rows = chained(busy, x, reps, busy_us) + anatomy("busy program", lambda: busy(x), reps)
    for name, case in cases.items():
        try:
            jax.block_until_ready(case())
        except Exception as e:  # noqa: BLE001 - a memory kind the backend lacks: reported, not fatal
            rows.append({"case": name, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        behind, idle, dispatch = [], [], []
        for _ in range(reps):
            call = time.perf_counter()
            y = busy(x)
            dispatch.append(time.perf_counter() - call)
            call = time.perf_counter()
            out = case()
            behind.append(time.perf_counter() - call)
            jax.block_until_ready((y, out))
            call = time.perf_counter()
            out = case()
            idle.append(time.perf_counter() - call)
            jax.block_until_ready(out)
        rows.append({"case": name, "behind_busy_us": _median_us(behind), "idle_us": _median_us(idle),
                     "busy_dispatch_us": _median_us(dispatch), "busy_program_us": busy_us})
    return rows


def chained(busy, x, reps: int, busy_us: float) -> list[dict]:
    """The busy program queued on the output of its own pending run, as is and with that input donated (as
    the engine's step donates its cache): the second call's host µs."""
    donating = jax.jit(busy.__wrapped__, donate_argnums=0)
    rows = []
    for name, program in (("busy(output of a pending busy)", busy),
                          ("busy donating the output of a pending busy", donating)):
        y = program(jnp.array(x))
        jax.block_until_ready(program(y))
        behind = []
        for _ in range(reps):
            y = program(jnp.array(x))
            call = time.perf_counter()
            y = program(y)
            behind.append(time.perf_counter() - call)
            jax.block_until_ready(y)
        rows.append({"case": name, "behind_busy_us": _median_us(behind), "busy_program_us": busy_us})
    return rows


def engine_step(args) -> list[dict]:
    """The engine's next batch-1 step launched back to back, its inputs from host (runner.launch) and placed
    once on the device: each launch call's host ms and the loop's ms a step."""
    from benchmarks.decode_probe import next_step
    from benchmarks.step_profile import _decoding_engine  # builds a model: only with --engine

    llm, _ = _decoding_engine(args)
    engine = llm.engine
    runner = engine.runner
    t, inputs = next_step(engine)
    compiled = runner._compiled[t]
    sampler = runner._sampler(t, False, False, True)
    placed_forward = placed_sampling = jax.device_put(runner.layout.pack(inputs))  # no mesh: the packed vector

    def from_host():
        return runner.launch(t, inputs)

    def placed():
        runner.cache, logits = compiled(runner._state_leaves, runner.cache, placed_forward, runner.last_tokens)
        result = sampler(logits, placed_sampling)
        runner.last_tokens = result.token_ids
        return result

    def forward_only():
        runner.cache, logits = compiled(runner._state_leaves, runner.cache, placed_forward, runner.last_tokens)
        return logits

    cases = (("inputs from host (runner.launch)", from_host), ("inputs placed once", placed),
             ("the forward alone, inputs placed once", forward_only))
    rows = []
    for turn in range(args.rounds):
        for name, launch in cases:
            for _ in range(3):
                res = launch()
            jax.block_until_ready((runner.cache, res))
            calls = []
            start = time.perf_counter()
            for _ in range(args.repeats):
                call = time.perf_counter()
                res = launch()
                calls.append(time.perf_counter() - call)
            jax.block_until_ready((runner.cache, res))
            step_ms = (time.perf_counter() - start) / args.repeats * 1e3
            rows.append({"case": name, "round": turn, "step_ms": step_ms,
                         "launch_call_ms": statistics.median(calls) * 1e3,
                         "launch_call_mean_ms": statistics.mean(calls) * 1e3})
    rows += anatomy("engine forward, inputs placed once", forward_only, args.repeats // 10)
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(compiled.as_text())
        text = compiled.as_text()
        print(f"the forward's HLO ({args.hlo}): {text.count(' while(')} while, {text.count(' conditional(')} "
              f"conditional, {text.count('custom-call(')} custom-call")
    return rows


def anatomy(name: str, launch, reps: int) -> list[dict]:
    """Two launches back to back from an idle device: when each call returns and when the second's result is
    ready, µs from the first call (medians): a call that returns only as its own program ends is synchronous,
    one that returns only as the program before it ends waits for a slot."""
    marks = []
    for _ in range(reps):
        jax.block_until_ready(launch())
        t0 = time.perf_counter()
        launch()
        t1 = time.perf_counter()
        out = launch()
        t2 = time.perf_counter()
        jax.block_until_ready(out)
        marks.append((t1 - t0, t2 - t0, time.perf_counter() - t0))
    first, second, ready = (statistics.median(m) * 1e6 for m in zip(*marks))
    return [{"case": f"anatomy: {name}", "first_returns_us": first, "second_returns_us": second,
             "second_ready_us": ready}]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50, help="timings a synthetic case")
    parser.add_argument("--size", type=int, default=4096, help="the busy program's matmul size")
    parser.add_argument("--chain", type=int, default=8, help="the busy program's matmuls")
    parser.add_argument("--engine", action="store_true", help="also the engine's step (builds --preset)")
    parser.add_argument("--preset", default="deepseek-v2-lite")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=4, help="prompt tokens of the engine's sequence")
    parser.add_argument("--rounds", type=int, default=3, help="turns of the engine's two cases")
    parser.add_argument("--repeats", type=int, default=200, help="launches an engine timing")
    parser.add_argument("--out", help="JSON of the results under this path")
    parser.add_argument("--hlo", help="with --engine: write the forward's optimized HLO to this path")
    args = parser.parse_args(argv)
    rows = synthetic(args.reps, args.size, args.chain)
    table = markdown_table(rows, ["case", "behind_busy_us", "idle_us", "busy_dispatch_us", "busy_program_us",
                                  "first_returns_us", "second_returns_us", "second_ready_us", "error"])
    engine_rows, engine_table = [], ""
    if args.engine:
        engine_rows = engine_step(args)
        engine_table = markdown_table(engine_rows, ["case", "round", "step_ms", "launch_call_ms",
                                                    "launch_call_mean_ms", "first_returns_us", "second_returns_us",
                                                    "second_ready_us"])
    return write_probe(rows + engine_rows, table + ("\n\n" + engine_table if engine_table else ""), args.out,
                       probe=NAME, preset=args.preset if args.engine else None, batch=args.batch)


if __name__ == "__main__":
    main()
