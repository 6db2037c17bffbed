"""Shared pieces of the benchmark scripts: environment header and result files."""

from __future__ import annotations

import collections
import datetime
import glob
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.model.dispatch import compiler_options

RESULTS = Path(__file__).resolve().parent / "results"
LOOP_SECONDS = 5e-3  # device time one timed loop aims for


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.device_kind,
        "platform": device.platform,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_result(name: str, payload: dict, directory: Path = RESULTS) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def write_probe(rows: list[dict], table: str, out: str | None, **header) -> dict:
    """A probe's payload (date, device, jax, ``header``, its rows and their markdown ``table``): printed,
    and written as JSON to ``out`` when given."""
    payload = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, jax=jax.__version__,
                   **header, rows=rows, table=table)
    print(table)
    if out:
        Path(out).write_text(json.dumps(payload, indent=1))
    return payload


def best_seconds(fn, *args, repeats: int = 5) -> float:
    """The fastest of ``repeats`` timed calls of an already-compiled fn(*args), each waited for: for a jitted
    program that runs a long chain of kernels itself (the dispatch is amortized over the chain)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def run_interpret(fn, *args):
    """fn(*args) once, compiled as dsjax compiles interpret-mode programs (-O1: the kernels unroll into
    large CPU programs): the quick runs' check that the kernels run, with no timing."""
    return jax.block_until_ready(jax.jit(fn, compiler_options=compiler_options("interpret"))(*args))


def device_time_us(fn, args, *, estimate_s: float, repeats: int = 5, iters: int | None = None,
                   xla_options: dict | None = None) -> float:
    """Median µs per call of fn(*args) over ``repeats`` runs of a jitted fori_loop of ``iters`` calls, compiled
    with ``xla_options`` (e.g. ``dispatch.compiler_options("interpret")`` for a quick CPU run).

    The optimization barrier ties each call's inputs to the previous call's outputs, so XLA can
    neither hoist the call out of the loop nor skip iterations, and adds no kernel of its own; the
    per-call dispatch of a host loop never enters the number.
    """
    iters = iters or int(np.clip(LOOP_SECONDS / max(estimate_s, 1e-7), 10, 300))
    out_shape = jax.eval_shape(fn, *args)

    def loop(*args):
        def body(_, previous):
            return fn(*jax.lax.optimization_barrier((args, previous))[0])
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
        return jax.lax.fori_loop(0, iters, body, init)

    compiled = jax.jit(loop).lower(*args).compile(xla_options)
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / iters * 1e6


def copy_bytes_per_s(size_bytes: int = 2**30, repeats: int = 5) -> float:
    """This device's copy bandwidth: bytes read plus bytes written per second of an elementwise pass over a
    ``size_bytes`` array (uint32 + 1, so nothing folds away). On an accelerator the pass's kernel time from
    a profiler trace: a timed loop (``device_time_us``) adds its own per-iteration cost, 3.75 against 4.28
    TB/s at 1 GiB on an H200, where the kernel time matches issue #8's anchor. On CPU the timed loop."""
    if size_bytes < 4:
        raise ValueError(f"size_bytes={size_bytes}: accepted at least one 4-byte element")
    x = jnp.zeros(size_bytes // 4, jnp.uint32)
    add_one = lambda a: a + jnp.uint32(1)
    if jax.default_backend() == "cpu":
        us = device_time_us(add_one, (x,), estimate_s=2 * x.nbytes / 1e10, repeats=repeats)
    else:
        us = kernel_time_us(add_one, (x,), calls=4 * repeats)["total"]
    return 2 * x.nbytes / (us * 1e-6)


def kernel_time_us(fn, args, *, calls: int = 50) -> dict[str, float]:
    """µs per call that each kernel of fn(*args) runs on the device, from a profiler trace of ``calls``
    back-to-back calls: kernel time alone, without the launch gaps between kernels (the loop in
    ``device_time_us`` includes those). Keys are the kernel names; "total" sums them."""
    import tempfile

    from benchmarks.step_profile import top_ops

    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        outs = [jitted(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        jax.profiler.stop_trace()
        (trace,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
        ops = top_ops(trace, limit=1000)
    per_call = {name: total / calls for name, total, _ in ops}
    return {**per_call, "total": sum(per_call.values())}


def summarize_trace(trace_dir: str) -> str:
    """Mean time (trace units: us) and count a block of each named scope, by warpgroup, over the blocks of
    the newest Perfetto JSON that Mosaic GPU wrote into ``trace_dir``: a markdown table."""
    by_scope = collections.defaultdict(list)  # (warpgroup, scope) -> (mean, count) per block
    for (_, wg), spans in _trace_spans(trace_dir).items():
        durations = collections.defaultdict(list)
        for begin, end, name in spans:
            durations[name].append(end - begin)
        for name, d in durations.items():
            by_scope[wg, name].append((sum(d) / len(d), len(d)))
    rows = [{"warpgroup": wg, "scope": name, "mean_us": round(sum(m for m, _ in v) / len(v), 3),
             "per_block": round(sum(n for _, n in v) / len(v), 1)} for (wg, name), v in sorted(by_scope.items())]
    return markdown_table(rows, ["warpgroup", "scope", "mean_us", "per_block"])


def _trace_spans(trace_dir: str) -> dict:
    """The newest Perfetto JSON that Mosaic GPU wrote into ``trace_dir`` as {(block, warpgroup): [(begin, end,
    scope), ...] in begin order}, warpgroup w being the block's w-th lowest thread id."""
    path = max(glob.glob(os.path.join(trace_dir, "*.json")), key=os.path.getmtime)
    with open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    tids = collections.defaultdict(set)
    for e in events:
        tids[e["pid"]].add(e["tid"])
    began, spans = {}, collections.defaultdict(list)
    for e in events:
        key = (e["pid"], sorted(tids[e["pid"]]).index(e["tid"]), e["name"])
        if e["ph"] == "B":
            began[key] = e["ts"]
        elif e["ph"] == "E" and key in began:
            spans[key[:2]].append((began.pop(key), e["ts"], e["name"]))
    return {k: sorted(v) for k, v in spans.items()}


def barrier_phases(trace_dir: str, barrier: str = "barrier") -> str | None:
    """The critical path of a persistent kernel's trace, phase by phase: between the releases of consecutive
    grid barriers (the computing warpgroup's ``barrier`` scopes, the same count in every block), how long the
    phase took (first release to the next), and the scopes that the block arriving last ran in it (µs summed
    by scope): a markdown table, or None for a trace without barriers."""
    spans = {block: s for (block, wg), s in _trace_spans(trace_dir).items() if wg == 0}
    bars = {block: [(b, e) for b, e, name in s if name == barrier] for block, s in spans.items()}
    bars = {block: v for block, v in bars.items() if v}
    if not bars:
        return None
    rows, count = [], min(len(v) for v in bars.values())
    for i in range(1, count):
        start = min(v[i - 1][1] for v in bars.values())
        last = max(bars, key=lambda block: bars[block][i][0])
        lo, hi = bars[last][i - 1][1], bars[last][i][0]
        did = collections.defaultdict(float)
        for b, e, name in spans[last]:
            if lo <= b and e <= hi and name != barrier:
                did[name] += e - b
        rows.append({"phase": i, "us": round(min(v[i][1] for v in bars.values()) - start, 2), "last_block": last,
                     "its_scopes": ", ".join(f"{name} {us:.2f}" for name, us in did.items())})
    return markdown_table(rows, ["phase", "us", "last_block", "its_scopes"])


def traced(call, trace_dir: str):
    """Runs ``call(profile_dir)`` once with Mosaic GPU tracing into ``trace_dir`` and prints the summary."""
    os.makedirs(trace_dir, exist_ok=True)
    jax.block_until_ready(call(trace_dir))
    print(f"{os.path.basename(trace_dir)}\n{summarize_trace(trace_dir)}")
    phases = barrier_phases(trace_dir)
    if phases is not None:
        print(f"{os.path.basename(trace_dir)}, phase by phase\n{phases}")
