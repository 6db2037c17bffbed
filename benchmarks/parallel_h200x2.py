"""Tensor vs expert parallelism on two GPUs: decode throughput and per-GPU memory of the
deepseek-v2-lite preset (random bf16 weights), TP=2 and EP=2 against one GPU.

    python -m benchmarks.parallel_h200x2                        # every run, ~6 min on 2x H200
    python -m benchmarks.parallel_h200x2 --runs 1gpu tp2 ep2 --batches 256 512 1024
    python -m benchmarks.parallel_h200x2 --runs 1gpu ep2 --batches 256 --profile-batch 256  # + op profile

Each run is its own subprocess (a clean device, its own peak-memory counter, a timeout); results are
merged into benchmarks/results/parallel_h200x2.json, so runs can also be done one at a time. Per
batch B: steady-state decode steps of B sequences timed around LLMEngine.step() (host included, as
benchmarks/decode_probe.py does) and the compiled step alone (device). Each run also checks its
last-position logits on a fixed batch against the one-GPU run's (top-1 agreement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# ParallelConfig fields of each run. ep2 takes the default token exchange (auto: the all-gather at
# EP=2, V2-Lite's top-6); the -padded / -ragged runs the two all-to-all transports (docs/parallelism.md).
RUNS = {"1gpu": {}, "tp2": {"tensor_parallel_size": 2}, "ep2": {"expert_parallel_size": 2},
        "ep2-padded": {"expert_parallel_size": 2, "expert_all_to_all": "padded"},
        "ep2-ragged": {"expert_parallel_size": 2, "expert_all_to_all": "ragged"}}
NAME = "parallel_h200x2"


def child(run: str, args) -> dict:
    """One configuration, in this (child) process."""
    import jax
    import numpy as np

    from benchmarks.decode_probe import decode_len, measure, start_decode_batch
    from benchmarks.step_profile import profile_compiled_step
    from dsjax import LLM, ParallelConfig

    top = max(args.batches)
    budget = max(top, args.prefill_chunk)
    max_len = decode_len(top, args.prompt, budget, args.steps + 2)
    # Under EP each rank runs its own sequences: steps are sized by a rank's share of the batch.
    shards = RUNS[run].get("expert_parallel_size", 1)
    buckets = {size // shards for size in (*args.batches, budget)} | {budget}
    start = time.perf_counter()
    llm = LLM(args.preset, dtype=args.dtype, kernel_backend=args.kernel_backend, max_num_seqs=top,
              max_num_batched_tokens=budget, max_model_len=max_len, block_size=64, buckets=tuple(sorted(buckets)),
              enable_prefix_caching=False, progress=False, kv_cache_memory=int(args.kv_cache_gib * 2**30),
              async_scheduling=args.async_scheduling, parallel=ParallelConfig(**RUNS[run]))
    setup_s = time.perf_counter() - start
    devices = jax.local_devices()[:max(1, llm.model.mesh.size if llm.model.mesh is not None else 1)]
    weights = {str(d): 0 for d in devices}
    for leaf in jax.tree.leaves(jax.tree.map(lambda v: v[...], llm.engine.runner.state)):
        for shard in leaf.addressable_shards:
            weights[str(shard.device)] += shard.data.nbytes
    probe = np.random.default_rng(0).integers(3, llm.model.config.vocab_size, (4, 32)).astype(np.int32)
    logits = np.asarray(jax.device_get(llm.model.logits(probe)))[:, -1].astype(np.float32)
    rows = [measure(llm, b, args.prompt, args.steps, device_repeats=20) for b in args.batches]
    profile = None
    if args.profile_batch:  # where a decode step of this run goes, op by op (summed over its GPUs)
        engine = llm.engine
        ids = start_decode_batch(engine, args.profile_batch, args.prompt, f"profile-{run}")
        try:
            for _ in range(3):
                engine.step()
            profile = {"batch": args.profile_batch, **profile_compiled_step(engine, f"/tmp/dsjax_trace_{run}")}
        finally:
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
    memory = [{"device": str(d), "weights_gib": weights[str(d)] / 2**30,
               **{k + "_gib": d.memory_stats()[k] / 2**30 for k in ("bytes_in_use", "peak_bytes_in_use")
                  if k in (d.memory_stats() or {})}} for d in devices]
    return {"run": run, "parallel": RUNS[run], "setup_s": setup_s, "rows": rows, "memory": memory,
            "kv_blocks": llm.engine.num_blocks, "kernel_backend": llm.model.kernel_backend, "profile": profile,
            "probe_argmax": logits.argmax(-1).tolist(), "probe_logits": logits[:, :64].tolist()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--preset", default="deepseek-v2-lite")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512, 1024])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=8.0, help="KV pool per GPU")
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="overlap the host's work with the device step, as dsjax.bench does")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per run")
    parser.add_argument("--profile-batch", type=int, default=None,
                        help="also profile one decode step at this batch (top device ops, all GPUs summed)")
    parser.add_argument("--xla-flags", default="", help="XLA_FLAGS for the runs (e.g. command-buffer types)")
    parser.add_argument("--tag", default="", help="suffix of the run names in the results (e.g. a flag variant)")
    parser.add_argument("--out", default=NAME, help="results file name under benchmarks/results/")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)), flush=True)
        return

    from benchmarks.common import RESULTS, environment, markdown_table, write_result

    path = RESULTS / f"{args.out}.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    runs = {r["run"]: r for r in previous.get("runs", [])}
    forwarded = list(argv if argv is not None else sys.argv[1:])
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    if args.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    for base in args.runs:
        run = base + args.tag
        start = time.perf_counter()
        print(f"--- {run}: {RUNS[base] or 'one GPU'} (timeout {args.timeout:.0f}s)", flush=True)
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.parallel_h200x2", *forwarded, "--child", base],
                                  capture_output=True, text=True, timeout=args.timeout, env=env)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                runs[run] = {"run": run, "error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
            else:
                runs[run] = json.loads(lines[-1][len("RESULT "):]) | {"run": run, "xla_flags": args.xla_flags}
        except subprocess.TimeoutExpired as e:
            runs[run] = {"run": run, "error": f"timed out after {args.timeout:.0f}s: {(e.stderr or b'')[-2000:]!r}"}
        error = f"  ERROR {runs[run]['error'][-1500:]}" if "error" in runs[run] else ""
        print(f"    {time.perf_counter() - start:.0f}s{error}", flush=True)
    table, summary = tabulate(runs)
    print(markdown_table(table, ["run", "batch", "tok_per_s", "speedup", "device_tok_per_s", "device_speedup",
                                 "step_ms", "device_step_ms"]))
    memory = [{"run": r, **m} for r, result in runs.items() for m in result.get("memory", [])]
    if memory:
        print(markdown_table(memory, ["run", "device", "weights_gib", "bytes_in_use_gib", "peak_bytes_in_use_gib"]))
    for line in summary:
        print(line)
    print("wrote", write_result(args.out, {**environment(), "preset": args.preset, "runs": list(runs.values()),
                                       "table": table, "summary": summary}))


def tabulate(runs: dict) -> tuple[list[dict], list[str]]:
    """Rows with speedups over the one-GPU run at the same batch, and one line per parallel run."""
    base = {row["batch"]: row for row in runs.get("1gpu", {}).get("rows", [])}
    table, summary = [], []
    for run, result in runs.items():
        for row in result.get("rows", []):
            ref = base.get(row["batch"])
            table.append({"run": run, **row,
                          "speedup": row["tok_per_s"] / ref["tok_per_s"] if ref else None,
                          "device_speedup": row["device_tok_per_s"] / ref["device_tok_per_s"] if ref else None})
        if run != "1gpu" and "1gpu" in runs and "probe_argmax" in result and "probe_argmax" in runs["1gpu"]:
            agree = sum(a == b for a, b in zip(result["probe_argmax"], runs["1gpu"]["probe_argmax"]))
            summary.append(f"{run}: probe top-1 agrees with one GPU on {agree}/{len(result['probe_argmax'])} rows")
    best = max((r for r in table if r["run"] != "1gpu" and r["speedup"]), key=lambda r: r["speedup"], default=None)
    if best:
        summary.append(f"best: {best['run']} at batch {best['batch']}: {best['speedup']:.2f}x one GPU "
                       f"(device step alone {best['device_speedup']:.2f}x); target >= 1.8x")
    return table, summary


if __name__ == "__main__":
    main()
