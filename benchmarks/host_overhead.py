"""The engine's host work per decode step, with the device taken out: the runner's launch returns a
ready sample at once, so what is timed is what LLMEngine.step() does in Python around the device
(scheduling, packing the step's arrays, reading the samples, detokenizing, building the outputs).

    python -m benchmarks.host_overhead                      # tiny preset, batches 256 and 1024
    python -m benchmarks.host_overhead --batches 64 512 --profile 20
    python -m benchmarks.host_overhead --device --preset deepseek-v2-lite --dtype bfloat16 --block-size 64 \
        --batches 1 --prompt 128 --steps 300 --profile 0 --async-scheduling   # the host's share of a real step

At large batch this work, not the device step, sets the engine's pace (docs/parallelism.md: 1024
sequences on one or two H200s): with async scheduling a step takes max(host, device), without it the
sum. The model's size does not enter (only its vocabulary, through the samples), so the tiny preset
measures what V2-Lite's engine pays. Wall time (perf_counter) and the main thread's CPU time
(thread_time) are both reported: on a shared machine the first moves with the neighbours.

With ``--device`` the device stays in, and each step's launch call (the host queuing the forward and the
sampler) and fetch (mostly waiting for the device) are timed too: with async scheduling the engine keeps
the device busy while schedule + pack + launch + the fetch's own work stay under a device step. Then the
next step is launched alone, again and again, each waited for: ``launch_alone_ms``, the host's cost of
queuing a step when nothing holds the launch back.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import jax
import numpy as np

from benchmarks.common import environment, markdown_table, write_result
from benchmarks.decode_probe import decode_len, next_step, start_decode_batch
from benchmarks.step_profile import apply_settings, parse_settings
from dsjax import LLM
from dsjax.engine.sampler import SampleResult

NAME = "host_overhead"


def instant_device(runner, seed: int = 0):
    """A stand-in for runner.launch: a SampleResult of random tokens, as numpy, for the step's rows (a multi-step
    chunk's with a steps axis; no top log-probabilities, as the sampler returns them when no row asks)."""
    rng = np.random.default_rng(seed)
    vocab = runner.model_config.vocab_size

    def launch(t, inputs, row_steps=None):
        rows = runner.num_shards * runner.layout.num_rows(t)
        shape = (rows,) if row_steps is None else (rows, runner.config.num_scheduler_steps)  # a chunk's steps axis
        # no top log-probabilities, as the runner's programs return none when no row asks for them
        return SampleResult(rng.integers(3, vocab, shape).astype(np.int32), np.full(shape, -1.0, np.float32),
                            None, None)

    return launch


def timed(fn, spent: list, cpu: list | None = None):
    """fn, appending each call's wall time to ``spent`` and, given ``cpu``, the calling thread's CPU time
    in it (fn itself as ``__wrapped__``)."""
    def wrapper(*args):
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            spent.append(time.perf_counter() - start)
            if cpu is not None:
                cpu.append(time.thread_time() - start_cpu)
    wrapper.__wrapped__ = fn
    return wrapper


def launch_alone_ms(engine, launches: int) -> float:
    """Median host ms of queuing the engine's next step with the device idle (each launch waited for before
    the next): what a launch costs the host when nothing holds it back."""
    runner = engine.runner
    launch = getattr(runner.launch, "__wrapped__", runner.launch)
    t, inputs = next_step(engine)
    spent = []
    for _ in range(launches + 10):
        start = time.perf_counter()
        result = launch(t, inputs)
        spent.append(time.perf_counter() - start)
        jax.block_until_ready((runner.cache, result))
    return statistics.median(spent[10:]) * 1e3


def measure(preset: str, batch: int, prompt: int, steps: int, profile_steps: int = 0, device: bool = False,
            dtype: str = "float32", block_size: int = 16, async_scheduling: bool = False) -> dict:
    budget = max(batch, 2048)
    llm = LLM(preset, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=budget, block_size=block_size,
              buckets=(batch, budget), max_model_len=decode_len(batch, prompt, budget, steps + profile_steps + 8),
              enable_prefix_caching=False, async_scheduling=async_scheduling, progress=False)
    engine, runner = llm.engine, llm.engine.runner
    start_decode_batch(engine, batch, prompt, f"host-b{batch}")  # real prefill steps, then the stand-in
    launches, fetches, launch_cpu, fetch_cpu = [], [], [], []
    if device:  # the real device: the host's share is the launch call (queuing the step) and the fetch's wait
        runner.launch = timed(runner.launch, launches, launch_cpu)
        runner.fetch = timed(runner.fetch, fetches, fetch_cpu)
    else:
        runner.launch = instant_device(runner)
    for _ in range(3):
        engine.step()
    for spent in (launches, fetches, launch_cpu, fetch_cpu):
        del spent[:]
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.thread_time() - c)
    row = {"batch": batch, "steps": steps, "wall_ms": statistics.median(wall) * 1e3, "wall_min_ms": min(wall) * 1e3,
           "cpu_ms": statistics.median(cpu) * 1e3, "us_per_sequence": statistics.median(cpu) / batch * 1e6}
    if device:
        ms = lambda values: statistics.median(values) * 1e3  # noqa: E731
        # a step's wall time outside its launch and fetch calls: scheduling, packing, the outputs
        other = [w - l - f for w, l, f in zip(wall, launches, fetches)]
        row.update(wall_mean_ms=statistics.mean(wall) * 1e3, wall_max_ms=max(wall) * 1e3,
                   launch_ms=ms(launches), launch_max_ms=max(launches) * 1e3, launch_cpu_ms=ms(launch_cpu),
                   fetch_ms=ms(fetches), fetch_cpu_ms=ms(fetch_cpu), other_ms=ms(other),
                   wall_p10_ms=float(np.percentile(wall, 10)) * 1e3, wall_p90_ms=float(np.percentile(wall, 90)) * 1e3,
                   launch_alone_ms=launch_alone_ms(engine, steps))
    if profile_steps:  # where the host's time goes: functions by own time, and the call count
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(profile_steps):
            engine.step()
        profiler.disable()
        stats = pstats.Stats(profiler)
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]  # (file, line, name) -> (cc, nc, tt, ct, _)
        row["python_calls_per_step"] = stats.total_calls / profile_steps
        row["top"] = [{"function": f"{name} ({file.rsplit('/', 1)[-1]}:{line})", "calls_per_step": nc / profile_steps,
                       "own_ms_per_step": tt / profile_steps * 1e3} for (file, line, name), (_, nc, tt, _, _) in top]
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", type=int, default=10, help="steps under cProfile for the function table (0: none)")
    parser.add_argument("--device", action="store_true",
                        help="keep the real device: time each step's launch call (the host queuing it) and fetch "
                             "(mostly the wait for the device) as well")
    parser.add_argument("--async-scheduling", action="store_true", help="the engine queues a step before reading "
                        "the last one's samples (with --device: a step takes max(host, device))")
    parser.add_argument("--set", type=parse_settings, default={},
                        help="'module.ATTR[.FIELD]=LITERAL ...': knob settings for the run, before the engine is built "
                             "(e.g. dsjax.engine.runner.STEP_KERNEL_GRAPHS=True)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default=NAME, help="results file name under benchmarks/results/ (or a path)")
    args = parser.parse_args(argv)
    apply_settings(args.set)
    rows = [measure(args.preset, b, args.prompt, args.steps, args.profile, args.device, args.dtype, args.block_size,
                    args.async_scheduling)
            for b in args.batches]
    columns = ["batch", "wall_ms", "wall_min_ms", "cpu_ms", "us_per_sequence", "python_calls_per_step"]
    if args.device:
        columns[3:3] = ["wall_p10_ms", "wall_p90_ms", "wall_max_ms", "launch_ms", "launch_cpu_ms", "launch_max_ms",
                        "fetch_ms", "fetch_cpu_ms", "other_ms", "launch_alone_ms"]
    table = markdown_table(rows, columns)
    print(table)
    for row in rows:
        for entry in row.get("top", [])[:6]:
            print(f"  b{row['batch']}: {entry['own_ms_per_step']:7.2f} ms  x{entry['calls_per_step']:7.0f}  {entry['function']}")
    # what else the host ran, for comparing runs across processes and machines
    host = {"cpus_usable": len(os.sched_getaffinity(0)), "loadavg": list(os.getloadavg())}
    payload = {**environment(), "host": host, "preset": args.preset, "prompt": args.prompt, "device": args.device,
               "settings": {k: repr(v) for k, v in args.set.items()},
               "async_scheduling": args.async_scheduling, "dtype": args.dtype, "rows": rows, "table": table}
    print("wrote", write_result(args.out, payload))
    return payload


if __name__ == "__main__":
    main()
