"""Offline engine throughput on a mixed workload, pow2 vs quantile shape buckets.

The design notes' mix, scaled by --scale (1.0 = their token counts): 50% short prompts (64-256),
20% long (4096), the rest 257-2048; every request generates --max-tokens tokens.

    python -m benchmarks.engine_throughput --preset tiny --scale 0.125 --requests 48   # CPU, minutes
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks.common import environment, markdown_table, write_result
from dsjax import LLM, SamplingParams


def mixed_prompt_lengths(num: int, scale: float, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = []
    for _ in range(num):
        u = rng.random()
        if u < 0.5:
            n = rng.integers(64, 257)
        elif u < 0.7:
            n = 4096
        else:
            n = rng.integers(257, 2049)
        lengths.append(max(1, int(n * scale)))
    return lengths


def run_once(preset: str, buckets: str, lengths: list[int], max_tokens: int, engine_args: dict, seed: int) -> dict:
    start = time.perf_counter()
    llm = LLM(preset, buckets=buckets, progress=False, **engine_args)
    init_seconds = time.perf_counter() - start
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, min(vocab, 259), size=n).tolist() for n in lengths]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {
        "buckets": buckets, "bucket_sizes": stats["buckets"], "seconds": seconds,
        "output_tok_per_s": generated / seconds, "total_tok_per_s": (generated + sum(lengths)) / seconds,
        "padding_ratio": stats["padding_ratio"], "num_compiled_shapes": stats["num_compiled_shapes"],
        "warmup_seconds": stats["warmup_seconds"], "compile_seconds": stats["compile_seconds"],
        "init_seconds": init_seconds, "num_steps": stats["num_steps"], "num_preemptions": stats["num_preemptions"],
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--scale", type=float, default=0.125)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default=None, help="results/<out>.json (default: engine_<preset>_<platform>)")
    args = parser.parse_args(argv)
    lengths = mixed_prompt_lengths(args.requests, args.scale)
    engine_args = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, block_size=args.block_size,
                       quantile_warmup_steps=16)
    rows = [run_once(args.preset, mode, lengths, args.max_tokens, engine_args, seed=0) for mode in ("pow2", "quantile")]
    table = markdown_table(rows, ["buckets", "bucket_sizes", "output_tok_per_s", "total_tok_per_s", "padding_ratio",
                                  "num_compiled_shapes", "warmup_seconds", "num_steps", "ttft_p50_s"])
    print(table)
    name = args.out or f"engine_{args.preset}_{jax.default_backend()}"
    path = write_result(name, {**environment(), "preset": args.preset, "requests": args.requests,
                               "prompt_lengths": lengths, "max_tokens": args.max_tokens, "engine": engine_args,
                               "rows": rows, "table": table})
    print("wrote", path)


if __name__ == "__main__":
    main()
