"""The engine's host work per decode step, with the device taken out: the runner's launch returns a
ready sample at once, so what is timed is what LLMEngine.step() does in Python around the device
(scheduling, packing the step's arrays, reading the samples, detokenizing, building the outputs).

    python -m benchmarks.host_overhead                      # tiny preset, batches 256 and 1024
    python -m benchmarks.host_overhead --batches 64 512 --profile 20

At large batch this work, not the device step, sets the engine's pace (docs/parallelism.md: 1024
sequences on one or two H200s): with async scheduling a step takes max(host, device), without it the
sum. The model's size does not enter (only its vocabulary, through the samples), so the tiny preset
measures what V2-Lite's engine pays. Wall time (perf_counter) and the main thread's CPU time
(thread_time) are both reported: on a shared machine the first moves with the neighbours.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np

from benchmarks.common import environment, markdown_table, write_result
from benchmarks.decode_probe import decode_len, start_decode_batch
from dsjax import LLM
from dsjax.engine.sampler import SampleResult

NAME = "host_overhead"


def instant_device(runner, seed: int = 0):
    """A stand-in for runner.launch: a SampleResult of random tokens, as numpy, for the step's rows."""
    rng = np.random.default_rng(seed)
    vocab, k = runner.model_config.vocab_size, runner.config.max_logprobs

    def launch(t, inputs):
        rows = runner.num_shards * runner.num_rows(t)
        return SampleResult(rng.integers(3, vocab, rows).astype(np.int32), np.full(rows, -1.0, np.float32),
                            np.zeros((rows, k), np.int32), np.zeros((rows, k), np.float32))

    return launch


def measure(preset: str, batch: int, prompt: int, steps: int, profile_steps: int = 0) -> dict:
    budget = max(batch, 2048)
    llm = LLM(preset, max_num_seqs=batch, max_num_batched_tokens=budget, block_size=16, buckets=(batch, budget),
              max_model_len=decode_len(batch, prompt, budget, steps + profile_steps + 8),
              enable_prefix_caching=False, progress=False)
    engine = llm.engine
    start_decode_batch(engine, batch, prompt, f"host-b{batch}")  # real prefill steps, then the stand-in
    engine.runner.launch = instant_device(engine.runner)
    for _ in range(3):
        engine.step()
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.thread_time() - c)
    row = {"batch": batch, "steps": steps, "wall_ms": statistics.median(wall) * 1e3, "wall_min_ms": min(wall) * 1e3,
           "cpu_ms": statistics.median(cpu) * 1e3, "us_per_sequence": statistics.median(cpu) / batch * 1e6}
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
    parser.add_argument("--out", default=NAME, help="results file name under benchmarks/results/ (or a path)")
    args = parser.parse_args(argv)
    rows = [measure(args.preset, b, args.prompt, args.steps, args.profile) for b in args.batches]
    table = markdown_table(rows, ["batch", "wall_ms", "wall_min_ms", "cpu_ms", "us_per_sequence", "python_calls_per_step"])
    print(table)
    for row in rows:
        for entry in row.get("top", [])[:6]:
            print(f"  b{row['batch']}: {entry['own_ms_per_step']:7.2f} ms  x{entry['calls_per_step']:7.0f}  {entry['function']}")
    payload = {**environment(), "preset": args.preset, "prompt": args.prompt, "rows": rows, "table": table}
    print("wrote", write_result(args.out, payload))
    return payload


if __name__ == "__main__":
    main()
