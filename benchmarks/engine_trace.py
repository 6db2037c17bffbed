"""Where the engine's decode steps wait: the engine of ``python -m dsjax.bench decode-curve`` (async scheduling,
the same buckets and pool) decodes a batch, first untraced (tokens over elapsed time, as the benchmark counts
them), then under a ``jax.profiler`` trace, and its next step is launched back to back and traced too, all in
one process. Each trace is read as the device's cycles, one start of the step's largest op
(the step kernel at batch 1) to the next: the cycle, that op's own time, the device's idle time in the cycle and
its largest gap. In the engine's trace each cycle is matched to the host call that queued it, so a gap can be
told apart: the host late (the step queued after the device ran dry) or the device waiting on something else.

    python -m benchmarks.engine_trace --batch 1 --prompt 128 --steps 48 --out /tmp/engine_trace

The profiler's Python tracer is off (it would slow the host several times over); the host's spans are the
engine's calls, annotated here: ``step``, ``schedule``, ``dispatch``, ``fetch`` and ``complete``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import e2e
from benchmarks.common import environment, markdown_table
from benchmarks.decode_probe import measure, next_step, start_decode_batch
from benchmarks.step_profile import (_device_events, _trace_events, apply_settings, latest_trace, marker_name,
                                     parse_settings)
from dsjax.engine import runner as runner_module

HOST_SPANS = ("step", "schedule", "dispatch", "fetch", "complete")
_IDLE_US = 2.0  # a gap shorter than this between device ops is the launch latency of back-to-back ops


def profile_options():
    """The profiler with the host's TraceMe spans and no Python tracer."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 2
    return options


@contextlib.contextmanager
def annotated(engine):
    """The engine's step and its parts each inside a profiler span of its name (instance attributes, put back
    after)."""
    targets = {"step": (engine, "step"), "schedule": (engine.scheduler, "schedule"),
               "dispatch": (engine.runner, "dispatch"), "fetch": (engine.runner, "fetch"),
               "complete": (engine, "_complete")}

    def wrap(name, fn):
        def call(*args, **kwargs):
            with jax.profiler.TraceAnnotation(name):
                return fn(*args, **kwargs)
        return call

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, wrap(name, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr in targets.values():
            delattr(owner, attr)  # the class's method again


def device_cycles(ops: list[dict]) -> list[dict]:
    """The device's cycles in one GPU's ops ('X' events: name, ts, dur in µs), one start of the op with the most
    time to the next: each with its start (µs after the first), length, that op's duration, the µs no op ran
    (gaps of at least _IDLE_US), the largest gap, and the op that ended it."""
    ops = sorted(ops, key=lambda e: float(e["ts"]))
    marker = marker_name(ops)
    starts = [i for i, e in enumerate(ops) if e["name"] == marker]
    origin = float(ops[starts[0]]["ts"]) if starts else 0.0
    cycles = []
    for first, last in zip(starts, starts[1:]):
        begin, stop = float(ops[first]["ts"]), float(ops[last]["ts"])
        idle, largest, after, end = 0.0, 0.0, "", begin
        for e in ops[first:last + 1]:
            ts = float(e["ts"])
            gap = ts - end
            if gap >= _IDLE_US:
                idle += gap
                if gap > largest:
                    largest, after = gap, e["name"]
            end = max(end, ts + float(e["dur"]))
        cycles.append({"start_us": begin - origin, "cycle_us": stop - begin, "marker_us": float(ops[first]["dur"]),
                       "idle_us": idle, "largest_gap_us": largest, "gap_before": after[:60]})
    return cycles


def host_spans(events: list[dict], processes: dict) -> dict[str, list[tuple[float, float]]]:
    """The annotated spans (HOST_SPANS) of the host's processes: name -> [(start µs, end µs)] in time order."""
    spans = {name: [] for name in HOST_SPANS}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in spans and "host" in processes.get(e["pid"], "").lower():
            spans[e["name"]].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return {name: sorted(v) for name, v in spans.items()}


def match_dispatches(ops: list[dict], dispatches: list[tuple[float, float]]) -> list[dict]:
    """Each cycle's start (the marker op) matched, in order, to the dispatch call that queued it: the first
    marker starting after the dispatch began, one each. With it, how long the step sat queued (marker start -
    the dispatch's end: negative, the device started it while the host was still in the call) and how long the
    device had been idle before it."""
    ops = sorted(ops, key=lambda e: float(e["ts"]))
    marker = marker_name(ops)
    starts, end, idle_before = [], None, []
    for e in ops:
        ts = float(e["ts"])
        if e["name"] == marker:
            starts.append(ts)
            idle_before.append(0.0 if end is None else max(ts - end, 0.0))
        end = ts + float(e["dur"]) if end is None else max(end, ts + float(e["dur"]))
    rows, i = [], 0
    for begin, finish in dispatches:
        while i < len(starts) and starts[i] < begin:
            i += 1
        if i == len(starts):
            break
        rows.append({"dispatch_us": finish - begin, "queued_us": starts[i] - finish,
                     "device_idle_before_us": idle_before[i]})
        i += 1
    return rows


def host_copies(ops: list[dict], name: str = "MemcpyD2H") -> list[dict]:
    """Each device-to-host copy (ops named ``name``) after the marker op that ended last before it began (the
    step whose samples it reads, at batch 1): how long after that step's end it began, and whether another
    marker (the next step) began in between, the copy waiting behind it."""
    ops = sorted(ops, key=lambda e: float(e["ts"]))
    marker = marker_name(ops)
    markers = [e for e in ops if e["name"] == marker]
    rows = []
    for e in ops:
        if name not in e["name"]:
            continue
        ts = float(e["ts"])
        before = [m for m in markers if float(m["ts"]) + float(m["dur"]) <= ts]
        if not before:
            continue
        end = float(before[-1]["ts"]) + float(before[-1]["dur"])
        behind = any(end <= float(m["ts"]) < ts for m in markers)
        rows.append({"after_step_us": ts - end, "behind_next_step": behind})
    return rows


def spread(values: list[float]) -> dict:
    if not values:
        return {}
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p10": float(np.percentile(values, 10)), "p90": float(np.percentile(values, 90))}


def summarize(trace_file: str | None, *, engine: bool) -> dict:
    """A trace's cycles (GPU 0) and, for the engine's, its host spans and the cycles' matches to their dispatch."""
    if trace_file is None:
        return {"trace": None}
    events, processes = _trace_events(trace_file)
    device = _device_events(trace_file)
    first_gpu = min((e["pid"] for e in device), default=None)
    ops = [e for e in device if e["pid"] == first_gpu]
    cycles = device_cycles(ops)
    out = {"trace": trace_file, "cycles": cycles}
    for key in ("cycle_us", "marker_us", "idle_us"):
        out[key] = spread([c[key] for c in cycles])
    copies = host_copies(ops)
    out["d2h_copies"] = len(copies)
    out["d2h_after_step_us"] = spread([c["after_step_us"] for c in copies])
    out["d2h_behind_next_step"] = sum(c["behind_next_step"] for c in copies)
    if engine:
        spans = host_spans(events, processes)
        out["host_us"] = {name: spread([b - a for a, b in v]) for name, v in spans.items()}
        out["dispatches"] = match_dispatches(ops, spans["dispatch"])
        for key in ("queued_us", "device_idle_before_us"):
            out[key] = spread([r[key] for r in out["dispatches"]])
    return out


def traced(trace_dir: str, run) -> str | None:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=profile_options()):
        run()
    return latest_trace(trace_dir)


def compiled_loop(engine, launches: int):
    """The engine's next step, prepared once and launched back to back ``launches`` times (the step is never
    committed: abort the batch after)."""
    t, inputs = next_step(engine)
    jax.block_until_ready(engine.runner.launch(t, inputs))

    def run():
        for _ in range(launches):
            result = engine.runner.launch(t, inputs)
        jax.block_until_ready((engine.runner.cache, result))
    return run


def run(args) -> dict:
    cli = e2e.parser().parse_args(["decode-curve", "--batches", str(args.batch), "--prompts", str(args.prompt),
                                   "--steps", str(args.steps)] + (["--preset", args.preset] if args.preset else []))
    settings = e2e.settings_from_args(cli, jax.default_backend())
    llm, info = e2e.build_llm(settings)
    engine = llm.engine
    untraced = measure(llm, args.batch, args.prompt, args.steps, warmup_steps=settings.warmup_steps)
    copy_ab = []
    for turn in range(args.copy_ab):  # runner.COPY_AT_DISPATCH is read at each dispatch: off and on in turns
        for value in (False, True):
            built, runner_module.COPY_AT_DISPATCH = runner_module.COPY_AT_DISPATCH, value
            try:
                row = measure(llm, args.batch, args.prompt, args.steps, warmup_steps=settings.warmup_steps)
            finally:
                runner_module.COPY_AT_DISPATCH = built
            copy_ab.append({"turn": turn, "copy_at_dispatch": value, **row})
            print(f"turn {turn} COPY_AT_DISPATCH={value}: {row['step_ms']:.3f} ms a step elapsed, median "
                  f"{row['step_median_ms']:.3f}", flush=True)
    ids = start_decode_batch(engine, args.batch, args.prompt, "trace")
    try:
        for _ in range(settings.warmup_steps):
            engine.step()
        times = []

        def engine_steps():
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)

        with annotated(engine):
            engine_trace = traced(os.path.join(args.out, "engine"), engine_steps)
        loop_trace = traced(os.path.join(args.out, "loop"), compiled_loop(engine, args.steps))
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    traced_row = {"steps": len(times), "step_ms": sum(times) / len(times) * 1e3,
                  "step_median_ms": statistics.median(times) * 1e3}
    engine_summary, loop_summary = summarize(engine_trace, engine=True), summarize(loop_trace, engine=False)
    rows = []
    for name, s in (("engine, traced", engine_summary), ("compiled step back to back, traced", loop_summary)):
        if s.get("cycles"):
            rows.append({"what": name, "cycles": len(s["cycles"]), **{f"{k}_{q}": s[k][q] for k in
                        ("cycle_us", "marker_us", "idle_us") for q in ("median", "p10", "p90")}})
    table = markdown_table(rows, ["what", "cycles", "cycle_us_median", "cycle_us_p10", "cycle_us_p90",
                                  "marker_us_median", "idle_us_median", "idle_us_p90"])
    payload = {**environment(), "preset": settings.preset, "batch": args.batch, "prompt": args.prompt,
               "settings": {k: repr(v) for k, v in args.set.items()},
               "engine": info,
               "untraced": untraced, "copy_ab": copy_ab, "traced_steps": traced_row, "engine_trace": engine_summary,
               "loop_trace": loop_summary, "table": table}
    return payload


def report(payload: dict) -> str:
    u, t = payload["untraced"], payload["traced_steps"]
    lines = [f"untraced: {u['step_ms']:.3f} ms a step elapsed, median {u['step_median_ms']:.3f} "
             f"(p10 {u['step_p10_ms']:.3f}, p90 {u['step_p90_ms']:.3f}), {u['tok_per_s']:.0f} tok/s",
             f"traced: {t['step_ms']:.3f} ms a step (host clock), median {t['step_median_ms']:.3f}",
             payload["table"]]
    engine = payload["engine_trace"]
    if engine.get("dispatches"):
        lines.append("engine host spans, median us: " + ", ".join(
            f"{name} {s['median']:.0f}" for name, s in engine["host_us"].items() if s))
        queued, idle = engine["queued_us"], engine["device_idle_before_us"]
        lines.append(f"queued (device start - dispatch end) us: median {queued['median']:.0f}, "
                     f"p10 {queued['p10']:.0f}; device idle before a step: median {idle['median']:.1f}, "
                     f"p90 {idle['p90']:.1f}")
        if engine["d2h_copies"]:
            after = engine["d2h_after_step_us"]
            lines.append(f"{engine['d2h_copies']} copies to the host: median {after['median']:.1f} us after their "
                         f"step's end (p90 {after['p90']:.1f}), "
                         f"{engine['d2h_behind_next_step']} behind the next step's start")
        lines.append("the first cycles (cycle / marker / idle / largest gap us, before which op):")
        for c in engine["cycles"][:16]:
            lines.append(f"  {c['cycle_us']:8.1f} {c['marker_us']:8.1f} {c['idle_us']:7.1f} {c['largest_gap_us']:7.1f}"
                         f"  {c['gap_before']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", help="default: decode-curve's (deepseek-v2-lite on a GPU, tiny on CPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=48,
                        help="decode steps timed, then traced, then launched in a loop")
    parser.add_argument("--out", default="/tmp/engine_trace", help="folder for the traces and engine_trace.json")
    parser.add_argument("--copy-ab", type=int, default=0, metavar="TURNS",
                        help="also time the untraced steps with runner.COPY_AT_DISPATCH off and on, in turns")
    parser.add_argument("--set", type=parse_settings, default={},
                        help="'module.ATTR[.FIELD]=LITERAL ...': knob settings for the whole run (before the engine "
                             "is built), e.g. dsjax.engine.runner.COPY_AT_DISPATCH=True")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.steps < 3:
        parser.error(f"--batch {args.batch} --steps {args.steps}: accepted a batch >= 1 and at least 3 steps")
    apply_settings(args.set)
    payload = run(args)
    print(report(payload))
    path = Path(args.out) / "engine_trace.json"
    path.write_text(json.dumps(payload, indent=1))
    print("wrote", path)
    return payload


if __name__ == "__main__":
    main()
