"""Where does one engine decode step go? Times the compiled step alone (device) against the whole
LLMEngine.step() (host included), and records a jax.profiler trace of a few decode steps.

    python -m benchmarks.step_profile --preset deepseek-v2-lite --batch 1 --trace-dir /tmp/trace

With ``--variant``, an A/B of trace-time knobs instead: the one engine's step recompiled under each
variant (module attributes set to Python literals), its device time taken in turns over ``--rounds``
(so drift between runs falls on every variant alike):

    python -m benchmarks.step_profile --batch 1 --rounds 3 --variant built \
        --variant "absorb 8: pallas_kernels.latent_write.ONE_TOKEN_ABSORB_TILES=8" \
        --variant "moe 8 warps: dsjax.model.dispatch.MOE_DECODE_TILES.num_warps=8"

With ``--kernel-trace DIR``, the batch-1 step kernel's per-scope trace as the engine runs it instead
(``dispatch.STEP_KERNEL_TRACE``; its first ~7 layers, tracing slowing each scope ~2x), summarized by scope and
phase by phase (``benchmarks.common.barrier_phases``).
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import importlib
import json
import os
import re
import time
from collections import defaultdict

import jax
import numpy as np

from benchmarks.common import barrier_phases, environment, summarize_trace
from benchmarks.decode_probe import next_step
from dsjax import LLM, SamplingParams
from dsjax.engine.runner import sampling_features
from dsjax.model import dispatch


def _device_events(trace_file: str) -> list[dict]:
    """The complete ('X') events of a perfetto trace's GPU processes."""
    events, pid_names = _trace_events(trace_file)
    on_device = lambda pid: "gpu" in pid_names.get(pid, "").lower() or "/device" in pid_names.get(pid, "")
    return [e for e in events if e.get("ph") == "X" and "dur" in e and on_device(e.get("pid"))]


def top_ops(trace_file: str, limit: int = 25) -> list[tuple[str, float, int]]:
    """(name, total µs, count) of the device ops in a perfetto trace, largest first."""
    totals, counts = defaultdict(float), defaultdict(int)
    for e in _device_events(trace_file):
        totals[e["name"]] += e["dur"]
        counts[e["name"]] += 1
    return sorted(((n, totals[n], counts[n]) for n in totals), key=lambda x: -x[1])[:limit]


_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def hlo_lines(*hlo_texts: str) -> dict[str, str]:
    """Each instruction's name in optimized HLO texts -> the rest of its line (its shape, op, operands): what a
    device op of the profile (a fusion's or a custom call's name) computes. A name that several programs use
    (the forward's and the sampler's fusions are numbered apart) gets each program's line, ' | '-joined."""
    lines: dict[str, list[str]] = {}
    for text in hlo_texts:
        seen = set()
        for line in text.splitlines():
            if (found := _HLO_INSTRUCTION.match(line)) and found.group(1) not in seen:
                seen.add(found.group(1))
                lines.setdefault(found.group(1), []).append(found.group(2).strip())
    return {name: " | ".join(found) for name, found in lines.items()}


_COPY = re.compile(r"^(\S+)\s+(?:copy|copy-start)\((?:[^%)]*)%([\w.\-]+)")


def device_copies(hlo_text: str) -> list[dict]:
    """The copies in a program's optimized HLO (what a GPU profile shows as MemcpyD2D) and what each copies from:
    [{"name", "shape", "source", "source_line"}]. A constant's copy means an output (an empty array, a constant
    returned) or an in-place operand takes a fresh buffer every call. (A Mosaic GPU kernel's zero-initialized
    semaphores are a broadcast, which XLA does not fold into a constant: a loop fusion, not a copy.)"""
    lines, copies, fused = hlo_lines(hlo_text), [], False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):  # a computation's header
            fused = line.lstrip("%").startswith(("fused", "wrapped"))  # a fusion's body: part of one kernel
        elif not fused and (instruction := _HLO_INSTRUCTION.match(line)) and (found := _COPY.match(instruction[2])):
            copies.append({"name": instruction[1], "shape": found[1], "source": found[2],
                           "source_line": lines.get(found[2], "")[:200]})
    return copies


def _trace_events(trace_file: str) -> tuple[list[dict], dict]:
    """A perfetto trace's events and its processes' names (pid -> name)."""
    with gzip.open(trace_file) as f:
        events = json.load(f)
    events = events.get("traceEvents", events)
    return events, {e["pid"]: e["args"]["name"] for e in events
                    if e.get("ph") == "M" and e.get("name") == "process_name"}


def marker_name(ops: list[dict]) -> str | None:
    """The name of the op with the most time in ``ops`` (the step kernel at batch 1: a step's marker), or None."""
    totals: dict[str, float] = defaultdict(float)
    for e in ops:
        totals[e["name"]] += float(e["dur"])
    return max(totals, key=totals.get, default=None)


def device_timeline(trace_file: str) -> list[dict]:
    """One step on the device, op by op: the ops between the second and third starts of the op with the most
    time (the step kernel at batch 1, a step's marker), each with its start (µs after the first), the gap since
    the previous op ended (negative: they overlap, e.g. on another stream) and its duration. Empty when the
    trace holds fewer than three steps."""
    ops = sorted(_device_events(trace_file), key=lambda e: float(e["ts"]))
    marker = marker_name(ops)
    starts = [i for i, e in enumerate(ops) if e["name"] == marker]
    if len(starts) < 3:
        return []
    first, last = starts[1], starts[2]
    rows, end = [], None
    for e in ops[first:last + 1]:
        ts, dur = float(e["ts"]), float(e["dur"])
        rows.append({"name": e["name"], "start_us": ts - float(ops[first]["ts"]),
                     "gap_us": 0.0 if end is None else ts - end, "dur_us": dur, "stream": e.get("tid")})
        end = ts + dur if end is None else max(end, ts + dur)
    return rows


def host_spans(trace_file: str, root: str = "launch", min_us: float = 5.0, max_depth: int = 8) -> list[dict]:
    """Where the host's time goes in one call: the median-length span whose name holds ``root`` (the runner's
    launch) on its thread, with every span nested in it of at least ``min_us``, in time order, each with its
    depth below the root (the profiler inflates every span; read them for proportions)."""
    events, processes = _trace_events(trace_file)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "host" in processes.get(e["pid"], "").lower()]
    roots = sorted((e for e in spans if root in e["name"]), key=lambda e: float(e["dur"]))
    if not roots:
        return []
    chosen = roots[len(roots) // 2]
    start, stop = float(chosen["ts"]), float(chosen["ts"]) + float(chosen["dur"])
    inside = sorted((e for e in spans if (e["pid"], e.get("tid")) == (chosen["pid"], chosen.get("tid"))
                     and float(e["ts"]) >= start and float(e["ts"]) + float(e["dur"]) <= stop + 1e-3),
                    key=lambda e: (float(e["ts"]), -float(e["dur"])))
    rows, stack = [], []
    for e in inside:
        ts = float(e["ts"])
        while stack and ts >= stack[-1]:
            stack.pop()
        if float(e["dur"]) >= min_us and len(stack) <= max_depth:
            rows.append({"depth": len(stack), "dur_us": float(e["dur"]), "name": e["name"]})
        stack.append(ts + float(e["dur"]))
    return rows


def latest_trace(trace_dir: str) -> str | None:
    """The perfetto trace last written under trace_dir (each profiler run adds a folder of its own, so a
    reused trace_dir holds earlier runs' traces too), or None."""
    return max(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True), key=os.path.getmtime,
               default=None)


def busy_us(trace_file: str) -> list[float]:
    """Per GPU of the trace: µs in which at least one of its ops runs (the union of their intervals;
    against the wall time of the traced steps it shows how long the GPU sat idle, e.g. waiting on the
    host's launches)."""
    spans = defaultdict(list)
    for e in _device_events(trace_file):
        spans[e["pid"]].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    busy = []
    for pid in sorted(spans):
        total, end = 0.0, float("-inf")
        for start, stop in sorted(spans[pid]):
            if stop > end:
                total += stop - max(start, end)
                end = stop
        busy.append(total)
    return busy


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v2-lite")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--trace-dir", default="/tmp/dsjax_trace")
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=4, help="prompt tokens a sequence (the step's context)")
    parser.add_argument("--max-model-len", type=int, help="the engine's (default: 230 tokens past the prompt, at least "
                        "256); it sets the block tables' width")
    parser.add_argument("--top", type=int, default=25, help="device ops to list")
    parser.add_argument("--variant", action="append", default=[], type=parse_variant,
                        help="'NAME[: module.ATTR[.FIELD]=LITERAL ...]': A/B these knob settings instead of profiling")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every variant (with --variant)")
    parser.add_argument("--repeats", type=int, default=200, help="launches a timing (with --variant)")
    parser.add_argument("--out", help="JSON of the A/B under this path (with --variant)")
    parser.add_argument("--set", type=parse_settings, default={},
                        help="'module.ATTR[.FIELD]=LITERAL ...': knob settings for the whole run (before the engine "
                             "is built), e.g. dsjax.engine.runner.STEP_KERNEL_GRAPHS=True")
    parser.add_argument("--kernel-trace", metavar="DIR", help="instead: the batch-1 step kernel's per-scope trace as "
                        "the engine runs it (dispatch.STEP_KERNEL_TRACE), its summary and phases")
    args = parser.parse_args(argv)
    b = args.batch
    apply_settings(args.set)
    if args.kernel_trace:
        return kernel_trace(args)
    llm, host = _decoding_engine(args)
    engine = llm.engine
    if args.variant:
        rows = ab_compiled_steps(engine, args.variant, rounds=args.rounds, repeats=args.repeats)
        payload = {**environment(), "batch": b, "preset": args.preset, "rows": rows, "table": ab_table(rows)}
        print(payload["table"])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(payload, f, indent=1)
        return payload
    profile = profile_compiled_step(engine, args.trace_dir, limit=args.top)
    print(f"batch {b}: engine.step {np.median(host) * 1e3:.2f} ms, compiled step alone "
          f"{profile['device_ms']:.2f} ms, prepare {profile['prepare_ms']:.3f} ms")
    if profile["ops"]:
        print(f"top device ops over {profile['steps']} steps ({profile['trace']}):")
        for op in profile["ops"]:
            print(f"  {op['us_per_step']:10.1f} us/step  x{op['count_per_step']:5.0f}  {op['name'][:110]}")
            if op["hlo"]:
                print(f"{'':30}{op['hlo'][:240]}")
        print(f"the step's optimized HLO: {args.trace_dir}/step_hlo.txt")
    for copy in profile["copies"]:
        print(f"  device copy {copy['name']} {copy['shape']} <- {copy['source']}: {copy['source_line'][:160]}")
    print_timeline(profile["timeline"], profile["host"])


def _decoding_engine(args):
    """An engine of ``args.batch`` sequences in steady decode, each after a prompt of ``args.prompt`` tokens (one
    prefill step each) -> (the LLM, 10 engine.step() host times). ``args.max_model_len`` (absent or None: 230
    tokens past the prompt, at least 256) sets the block tables' width."""
    b, prompt = args.batch, args.prompt
    chunk = max(b, 16, prompt)  # a prompt prefills in one step
    max_model_len = getattr(args, "max_model_len", None) or max(256, prompt + 230)
    llm = LLM(args.preset, dtype="bfloat16", kernel_backend=args.kernel_backend, max_num_seqs=b,
              max_num_batched_tokens=chunk, max_model_len=max_model_len, block_size=64,
              buckets=(b, chunk) if b < chunk else (b,), num_kv_blocks=args.num_kv_blocks,
              enable_prefix_caching=False, progress=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(b):
        engine.add_request(str(i), None, params, prompt_token_ids=[5 + i] + [6 + t % 100 for t in range(prompt - 1)])
    for _ in range(-(-b * prompt // chunk) + 5):  # the prefill steps, then a few decodes
        engine.step()
    host = []
    for _ in range(10):
        start = time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - start)
    return llm, host


def kernel_trace(args) -> str:
    """--kernel-trace: the engine's steps with ``dispatch.STEP_KERNEL_TRACE`` set (put back after), then the newest
    trace by scope and phase by phase -> that summary."""
    built = dispatch.STEP_KERNEL_TRACE
    os.makedirs(args.kernel_trace, exist_ok=True)
    dispatch.STEP_KERNEL_TRACE = args.kernel_trace
    try:
        llm, _ = _decoding_engine(args)
    finally:
        dispatch.STEP_KERNEL_TRACE = built
    if not glob.glob(os.path.join(args.kernel_trace, "*.json")):
        why = llm.model.prepare_step_kernel() or "a step's shapes (DeepseekForCausalLM.step_kernel_blocker)"
        raise SystemExit(f"--kernel-trace: no trace in {args.kernel_trace}: the step kernel did not run ({why})")
    summary = (f"the step kernel's scopes (newest trace in {args.kernel_trace}):\n{summarize_trace(args.kernel_trace)}"
               f"\nphase by phase:\n{barrier_phases(args.kernel_trace)}")
    print(summary)
    return summary


def parse_variant(text: str) -> tuple[str, dict[str, object]]:
    """'NAME: module.ATTR=LITERAL module.ATTR.FIELD=LITERAL ...' (no settings: the code as built) ->
    (NAME, {target: value}); ATTR.FIELD sets one field of a NamedTuple (its other fields as built)."""
    name, _, rest = text.partition(":")
    settings = {}
    for item in rest.split():
        target, eq, value = item.partition("=")
        if not eq or "." not in target:
            raise argparse.ArgumentTypeError(f"variant {name!r}: {item!r} is not module.ATTR[.FIELD]=LITERAL")
        try:
            settings[target] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"variant {name!r}: {value!r} is not a Python literal") from None
    if not name.strip():
        raise argparse.ArgumentTypeError(f"variant {text!r} has no name (NAME[: module.ATTR=LITERAL ...])")
    return name.strip(), settings


def parse_settings(text: str) -> dict[str, object]:
    """'module.ATTR[.FIELD]=LITERAL ...' (a --set argument) -> {target: value}, as ``parse_variant`` reads a
    variant's settings."""
    return parse_variant(f"set: {text}")[1]


def apply_settings(settings: dict[str, object]):
    """Sets each 'module.ATTR[.FIELD]' of ``settings`` (from ``parse_variant``) to its value."""
    for target, value in settings.items():
        module, attr, field = _knob(target)
        setattr(module, attr, getattr(module, attr)._replace(**{field: value}) if field else value)


def _knob(target: str) -> tuple[object, str, str | None]:
    """'module.ATTR' or 'module.ATTR.FIELD' -> (the module, ATTR, FIELD or None): the longest importable
    prefix is the module."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        rest = parts[cut:]
        if len(rest) <= 2 and hasattr(module, rest[0]):
            return module, rest[0], rest[1] if len(rest) == 2 else None
        break
    raise ValueError(f"knob {target!r}: expected module.ATTR or module.ATTR.FIELD of an importable module")


def time_compiled_step(engine, t: int, inputs, repeats: int) -> tuple[float, float]:
    """Device ms a launch of the prepared step (mean of ``repeats`` back to back, after 3 warm-up
    launches) and host ms each launch call holds."""
    runner = engine.runner
    for _ in range(3):
        res = runner.launch(t, inputs)
    jax.block_until_ready(res)
    start, launch_s = time.perf_counter(), 0.0
    for _ in range(repeats):
        call = time.perf_counter()
        res = runner.launch(t, inputs)
        launch_s += time.perf_counter() - call
    jax.block_until_ready((runner.cache, res))
    return (time.perf_counter() - start) / repeats * 1e3, launch_s / repeats * 1e3


def ab_compiled_steps(engine, variants, *, rounds: int, repeats: int) -> list[dict]:
    """The engine's next step, prepared once, recompiled under each variant ((name, {target: value})
    from parse_variant) and timed, the variants taken in turns for ``rounds``: one row a variant and
    round. Only the timed bucket compiles under a variant, and of it only the program the step launches
    (``compile_all``'s greedy_only for a greedy step). A first variant that sets nothing times the engine's own
    programs, compiled as built at its start (its row's compile_s is 0). Every knob a variant sets is put back
    before the next and at the end (the step as built compiles again at the engine's next launch)."""
    knobs = {target: _knob(target) for _, settings in variants for target in settings}
    original = {(module, attr): getattr(module, attr) for module, attr, _ in knobs.values()}
    runner = engine.runner
    t, inputs = next_step(engine)
    _, logprobs, greedy = sampling_features(inputs.sampling)

    def restore(settings):
        for (module, attr), value in original.items():
            setattr(module, attr, value)
        apply_settings(settings)
        jax.clear_caches()  # the knobs are read while tracing: every kernel and the step trace again
        runner.clear_compiled()

    def apply(settings):
        restore(settings)
        start = time.perf_counter()
        # the timed bucket's program only: the others would cost the A/B minutes for nothing
        runner.compile_all([t], greedy_only=greedy and not logprobs)
        return time.perf_counter() - start

    rows = []
    try:
        for turn in range(rounds):
            for index, (name, settings) in enumerate(variants):
                compile_s = 0.0 if turn == index == 0 and not settings else apply(settings)
                device_ms, launch_ms = time_compiled_step(engine, t, inputs, repeats)
                rows.append({"variant": name, "round": turn, "device_ms": device_ms, "launch_call_ms": launch_ms,
                             "compile_s": compile_s, "settings": {k: repr(v) for k, v in settings.items()}})
                print(f"round {turn} {name:<16} compiled step {device_ms:.4f} ms (compiled in {compile_s:.0f} s)", flush=True)
    finally:
        restore({})  # the step as built compiles again at the next launch
    return rows


def ab_table(rows: list[dict]) -> str:
    """Markdown: each variant's device ms by round, their median, the median host ms a launch call held (a
    launch queued behind another returns once that one nearly ends: decode_profile.md round 31) and the
    settings."""
    names = list(dict.fromkeys(r["variant"] for r in rows))
    rounds = sorted({r["round"] for r in rows})
    lines = ["| variant | " + " | ".join(f"round {i} ms" for i in rounds) + " | median ms | launch call ms | settings |",
             "|---|" + "---|" * (len(rounds) + 3)]
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        times = [f"{r['device_ms']:.4f}" for r in sorted(mine, key=lambda r: r["round"])]
        settings = " ".join(f"{k}={v}" for k, v in mine[0]["settings"].items()) or "as built"
        lines.append(f"| {name} | " + " | ".join(times) + f" | {np.median([r['device_ms'] for r in mine]):.4f} | "
                     f"{np.median([r['launch_call_ms'] for r in mine]):.4f} | {settings} |")
    return "\n".join(lines)


def profile_compiled_step(engine, trace_dir: str, *, steps: int = 3, repeats: int = 20, limit: int = 25) -> dict:
    """The engine's next step (a steady decode, once the batch is decoding), prepared once and launched
    by hand: its device time alone (mean of ``repeats``), how long each launch call holds the host, and
    from a profiler trace of ``steps`` launches the top device ops (summed over every device of the
    mesh), each with its line of the step's optimized HLO (written whole to ``trace_dir``/step_hlo.txt), and
    each GPU's busy time a step. The step is discarded afterwards."""
    runner = engine.runner
    out = engine.scheduler.schedule()
    rows = [engine._row(item.seq) for item in out.scheduled]
    start = time.perf_counter()
    t, inputs, _ = runner.prepare(out, rows, engine._pending_rows)
    prepare_s = time.perf_counter() - start
    device_ms, launch_ms = time_compiled_step(engine, t, inputs, repeats)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            res = runner.launch(t, inputs)
        jax.block_until_ready((runner.cache, res))
    trace = latest_trace(trace_dir)
    # the step's programs as XLA optimized them, for the ops' names: the forward with the greedy sampler inside first
    # where the bucket has one (what a greedy step launches: its names win), then the forward and the samplers
    greedy = [runner._greedy_forwards[t].as_text()] if t in runner._greedy_forwards else []
    texts = [*greedy, runner._compiled[t].as_text(), *(sampler.as_text() for sampler in runner._samplers.values())]
    with open(os.path.join(trace_dir, "step_hlo.txt"), "w") as f:
        f.write("\n\n".join(texts))
    described = hlo_lines(*texts)
    copies = device_copies(texts[0])  # the program a step launches first: the greedy forward where there is one
    ops = [{"name": name, "us_per_step": us / steps, "count_per_step": count / steps,
            "hlo": described.get(name, "")[:400]}
           for name, us, count in (top_ops(trace, limit) if trace else [])]
    return {"device_ms": device_ms, "prepare_ms": prepare_s * 1e3, "steps": steps,
            # host time inside each launch() of the back-to-back loop (its share of device_ms)
            "launch_call_ms": launch_ms,
            "busy_ms_per_gpu": [us / steps / 1e3 for us in busy_us(trace)] if trace else None,
            "trace": trace, "ops": ops, "copies": copies, "timeline": device_timeline(trace) if trace else [],
            "host": host_spans(trace, min_us=20.0, max_depth=6) if trace else []}


def print_timeline(timeline: list[dict], host: list[dict], gaps: int = 6):
    """A summary of ``device_timeline`` (the step's ops, their time and the gaps between them, the largest
    listed) and of ``host_spans``."""
    if timeline:
        ops, cycle = timeline[:-1], timeline[-1]["start_us"]
        idle = sum(max(r["gap_us"], 0.0) for r in timeline)
        print(f"one step on the device: {len(ops)} ops, {sum(r['dur_us'] for r in ops):.1f} us of them in a "
              f"{cycle:.1f} us cycle, {idle:.1f} us of gaps; the largest before:")
        for r in sorted(timeline, key=lambda r: -r["gap_us"])[:gaps]:
            print(f"  {r['gap_us']:8.1f} us  {r['name'][:60]} (at {r['start_us']:.1f} us, stream {r['stream']})")
    if host:
        print("one launch on the host (profiled spans: read for proportions):")
        for r in host:
            print(f"  {'  ' * r['depth']}{r['dur_us']:9.1f} us  {r['name'][:90]}")


if __name__ == "__main__":
    main()
