"""First look at engine decode throughput on a large preset (random weights): steady-state decode
steps of B sequences after a short prefill, timed around LLMEngine.step() (host work included).

    python -m benchmarks.decode_probe --preset deepseek-v2-lite --batches 1 64 --prompt 128
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import environment, markdown_table, write_result
from dsjax import LLM, SamplingParams


def measure(llm: LLM, batch: int, prompt_len: int, decode_steps: int) -> dict:
    engine = llm.engine
    rng = np.random.default_rng(batch)
    # Long enough that the first sequence still decodes once the last one has finished its prefill.
    prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=decode_steps + prefill_steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", None, params, prompt_token_ids=rng.integers(3, 1000, prompt_len).tolist())
    times = []
    while engine.has_unfinished_requests():
        out = engine.scheduler  # decode-only steps are those where every running sequence decodes
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if engine.scheduler.num_waiting == 0 and all(s.is_decoding for s in out.running) and \
                len(out.running) == batch:
            times.append(elapsed)
    steady = times[2:] or times
    step = float(np.median(steady))
    return {"batch": batch, "prompt": prompt_len, "steps_timed": len(steady), "step_ms": step * 1e3,
            "tok_per_s": batch / step}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v2-lite")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool size (default: 0.9 of free)")
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--out", default="decode_probe")
    args = parser.parse_args(argv)
    top = max(args.batches)
    budget = max(top, args.prefill_chunk)
    buckets = tuple(sorted({*args.batches, budget}))
    max_len = args.prompt + args.steps + -(-top * args.prompt // budget) + 16
    start = time.perf_counter()
    llm = LLM(args.preset, dtype="bfloat16", kernel_backend=args.kernel_backend, max_num_seqs=top,
              max_num_batched_tokens=budget, max_model_len=max_len, block_size=64,
              buckets=buckets, enable_prefix_caching=False,
              kv_cache_memory=None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30))
    setup = time.perf_counter() - start
    rows = [measure(llm, b, args.prompt, args.steps) for b in args.batches]
    table = markdown_table(rows, ["batch", "prompt", "step_ms", "tok_per_s", "steps_timed"])
    print(table)
    print(f"setup (weights + {llm.stats()['num_compiled_shapes']} compiles): {setup:.1f}s")
    print("wrote", write_result(args.out, {**environment(), "preset": args.preset,
                                           "kernel_backend": llm.model.kernel_backend, "setup_s": setup,
                                           "rows": rows, "table": table}))


if __name__ == "__main__":
    main()
