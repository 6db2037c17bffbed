"""First look at engine decode throughput on a large preset (random weights): steady-state decode
steps of B sequences after their prefill, timed around LLMEngine.step() (host work included) and,
optionally, the compiled step alone (device).

    python -m benchmarks.decode_probe --preset deepseek-v2-lite --batches 1 64 --prompt 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks.common import environment, markdown_table, write_result
from dsjax import LLM, SamplingParams


def start_decode_batch(engine, batch: int, prompt_len: int, tag: str) -> list[str]:
    """Adds ``batch`` requests with random prompts and steps until every one of them decodes.

    They may generate up to max_model_len (the caller aborts them), so none finishes while timed."""
    config = engine.config
    if batch > config.max_num_seqs:
        raise ValueError(f"batch={batch}: accepted at most max_num_seqs={config.max_num_seqs}")
    if not 1 <= prompt_len < config.max_model_len:
        raise ValueError(f"prompt_len={prompt_len}: accepted 1 to max_model_len - 1 = {config.max_model_len - 1}")
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still holds requests: a decode batch must run alone to be timed")
    vocab = engine.runner.model_config.vocab_size
    rng = np.random.default_rng([batch, prompt_len])
    params = SamplingParams(max_tokens=config.max_model_len - prompt_len, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, None, params, prompt_token_ids=rng.integers(3, vocab, prompt_len).tolist())
    while not all_decoding(engine.scheduler, batch):
        if engine.scheduler.num_running + engine.scheduler.num_waiting < batch:
            raise RuntimeError(f"batch={batch}, prompt={prompt_len}: a sequence reached max_model_len="
                               f"{config.max_model_len} before the last prefill ended; accepted max_model_len >= "
                               f"decode_len(batch, prompt, ...) = {decode_len(batch, prompt_len, config.max_num_batched_tokens, 0)}")
        engine.step()
    return ids


def decode_len(batch: int, prompt_len: int, max_num_batched_tokens: int, num_steps: int) -> int:
    """Tokens the first sequence of a measured batch may hold: its prompt, one token per step while
    the others prefill (each step leaves at least max_num_batched_tokens - batch + 1 tokens to
    prefills), ``num_steps`` more, and the compiled-step timing's scheduled slot."""
    if max_num_batched_tokens < batch:
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens}: accepted at least batch={batch}")
    prefill_steps = -(-batch * prompt_len // (max_num_batched_tokens - batch + 1))
    return prompt_len + prefill_steps + num_steps + 2


def all_decoding(scheduler, batch: int) -> bool:
    return scheduler.num_waiting == 0 and len(scheduler.running) == batch and \
        all(seq.is_decoding for seq in scheduler.running)


def next_step(engine) -> tuple[int, object]:
    """The engine's next step scheduled and packed, never committed -> (its bucket, its StepInputs), for timing the
    compiled step alone: call it only right before aborting the running requests."""
    out = engine.scheduler.schedule()
    t, inputs, _ = engine.runner.prepare(out, [engine._row(item.seq) for item in out.scheduled], engine._pending_rows)
    return t, inputs


def compiled_step_ms(engine, repeats: int = 20) -> float:
    """The compiled step alone on the inputs of the next step (as benchmarks/step_profile.py times
    it): no scheduling, packing or device-to-host copy. The step is scheduled but never committed,
    so call it only right before aborting the running requests."""
    runner = engine.runner
    t, inputs = next_step(engine)
    for _ in range(3):
        result = runner.launch(t, inputs)
    jax.block_until_ready(result)
    start = time.perf_counter()
    for _ in range(repeats):
        result = runner.launch(t, inputs)
    jax.block_until_ready((runner.cache, result))
    return (time.perf_counter() - start) / repeats * 1e3


def measure(llm: LLM, batch: int, prompt_len: int, decode_steps: int, *, warmup_steps: int = 2,
            device_repeats: int = 0) -> dict:
    """Steady-state decode of ``batch`` sequences of ``prompt_len``-token prompts over ``decode_steps`` engine
    steps (host included) after ``warmup_steps``, and with ``device_repeats`` the compiled step alone.
    ``step_ms`` is the elapsed time from the first timed step's start to the last one's end, a step (the
    probe's checks between steps included), so ``tok_per_s`` is tokens over elapsed time (what vLLM's
    benchmarks call output throughput); ``step_median_ms``, ``step_p10_ms`` and ``step_p90_ms`` are
    the spread of single steps, which with an async engine alternate short and long (a step's host time
    overlaps the device's previous step). ``context`` is the mean number of tokens a sequence attends to. With
    multi-step chunks (``num_scheduler_steps`` k) an engine step decodes k tokens a sequence: the steps (and
    the host's CPU) are a k-th of an engine step's, a decode step's share."""
    if decode_steps < 1 or warmup_steps < 0 or device_repeats < 0:
        raise ValueError(f"decode_steps={decode_steps}, warmup_steps={warmup_steps}, device_repeats="
                         f"{device_repeats}: accepted decode_steps >= 1, the others >= 0")
    engine = llm.engine
    scheduler = engine.scheduler
    preemptions = scheduler.num_preemptions
    ids = start_decode_batch(engine, batch, prompt_len, f"b{batch}-p{prompt_len}")
    try:
        for _ in range(warmup_steps):
            engine.step()
        times, cpu, context, first = [], [], 0, None
        for _ in range(decode_steps):
            if not all_decoding(scheduler, batch):
                raise RuntimeError(f"batch={batch}, prompt={prompt_len}: a sequence stopped decoding while timed "
                                   f"({scheduler.num_preemptions - preemptions} preemptions): the KV pool of "
                                   f"{engine.num_blocks} blocks is too small for this point")
            context += sum(seq.num_tokens for seq in scheduler.running)
            start, start_cpu = time.perf_counter(), time.thread_time()
            first = start if first is None else first
            engine.step()
            end = time.perf_counter()
            times.append(end - start)
            cpu.append(time.thread_time() - start_cpu)
        device_ms = compiled_step_ms(engine, device_repeats) if device_repeats else None
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():  # an async engine's last step is still in flight
            engine.step()
    k = engine.config.num_scheduler_steps  # decode steps an engine step (every one a full chunk here)
    step = (end - first) / len(times) / k
    row = {"batch": batch, "prompt": prompt_len, "context": context / decode_steps / batch,
           "steps_timed": len(times), "step_ms": step * 1e3, "tok_per_s": batch / step, "num_scheduler_steps": k,
           # the steps' spread, and the host thread's CPU a step (what it spends between the device's waits)
           "step_median_ms": statistics.median(times) / k * 1e3,
           "step_p10_ms": float(np.percentile(times, 10)) / k * 1e3,
           "step_p90_ms": float(np.percentile(times, 90)) / k * 1e3, "host_cpu_ms": statistics.median(cpu) / k * 1e3,
           "preemptions": scheduler.num_preemptions - preemptions}
    if device_ms is not None:
        row |= {"device_step_ms": device_ms, "device_tok_per_s": batch / device_ms * 1e3}
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v2-lite")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--device-repeats", type=int, default=0, help="also time the compiled step alone")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool size (default: 0.9 of free)")
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--out", default="decode_probe")
    args = parser.parse_args(argv)
    top = max(args.batches)
    budget = max(top, args.prefill_chunk)
    buckets = tuple(sorted({*args.batches, budget}))
    max_len = decode_len(top, args.prompt, budget, args.steps + 2)
    start = time.perf_counter()
    llm = LLM(args.preset, dtype="bfloat16", kernel_backend=args.kernel_backend, max_num_seqs=top,
              max_num_batched_tokens=budget, max_model_len=max_len, block_size=64,
              buckets=buckets, enable_prefix_caching=False,
              kv_cache_memory=None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30))
    setup = time.perf_counter() - start
    rows = [measure(llm, b, args.prompt, args.steps, device_repeats=args.device_repeats) for b in args.batches]
    table = markdown_table(rows, ["batch", "prompt", "step_ms", "step_median_ms", "tok_per_s", "device_step_ms",
                                  "steps_timed"])
    print(table)
    print(f"setup (weights + {llm.stats()['num_compiled_shapes']} compiles): {setup:.1f}s")
    print("wrote", write_result(args.out, {**environment(), "preset": args.preset,
                                           "kernel_backend": llm.model.kernel_backend, "setup_s": setup,
                                           "rows": rows, "table": table}))


if __name__ == "__main__":
    main()
