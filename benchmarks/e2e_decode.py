"""Scenario decode-curve: decode tokens/s and step latency against batch size, one curve per prompt
length, each point beside its memory roofline (benchmarks/roofline.py). Run by benchmarks/e2e.py."""

from __future__ import annotations

import time
from pathlib import Path

import jax.numpy as jnp

from benchmarks.common import markdown_table
from benchmarks.decode_probe import decode_len, measure
from benchmarks.roofline import all_weight_bytes, batch_touching_fraction, decode_step_bytes, kv_bytes_per_token

COLUMNS = ["batch", "prompt", "context", "step_ms", "step_median_ms", "step_p90_ms", "host_cpu_ms", "tok_per_s",
           "device_step_ms", "device_tok_per_s",
           "roofline_tok_per_s", "roofline_fraction", "device_roofline_fraction", "gb_per_step", "experts_touched"]


def skip_reason(llm, batch: int, prompt: int, num_steps: int) -> str | None:
    """Why the point (batch, prompt) cannot run on this engine, or None."""
    config, pool = llm.engine.config, llm.engine.block_manager
    if batch > config.max_num_seqs:
        return f"batch {batch} > max_num_seqs={config.max_num_seqs}"
    length = decode_len(batch, prompt, config.max_num_batched_tokens, num_steps)
    if length > config.max_model_len:
        return f"needs {length} tokens a sequence > max_model_len={config.max_model_len}"
    blocks = batch * -(-length // config.block_size)
    if blocks > pool.num_blocks_total:
        return f"KV does not fit: needs {blocks} blocks of {config.block_size} tokens, the pool has {pool.num_blocks_total}"
    return None


def with_roofline(row: dict, model_config, dtype_bytes: int, bytes_per_s: float) -> dict:
    """The measured row plus its roofline: the bytes its step must read at its mean context."""
    b = row["batch"]
    step = decode_step_bytes(model_config, b, max(b, round(row["context"] * b)), dtype_bytes)
    roof = step.tok_per_s(bytes_per_s)
    out = {**row, "bytes_per_step": step.total, "gb_per_step": step.total / 1e9,
           "weight_gb": step.weight_bytes / 1e9, "expert_gb": step.expert_bytes / 1e9, "kv_gb": step.kv_bytes / 1e9,
           "experts_touched": step.experts_touched, "roofline_step_ms": step.seconds(bytes_per_s) * 1e3,
           "roofline_tok_per_s": roof, "roofline_fraction": row["tok_per_s"] / roof,
           "host_ms": row["step_ms"] - row["device_step_ms"] if "device_step_ms" in row else None}
    if "device_tok_per_s" in row:
        out["device_roofline_fraction"] = row["device_tok_per_s"] / roof
        out["device_tb_per_s"] = step.total / (row["device_step_ms"] * 1e-3) / 1e12  # bytes it must read
    return out


def run_decode_curve(llm, settings) -> dict:
    """Every (prompt, batch) point of the grid on one engine: each point prefills its batch, then times
    decode steps; points that cannot fit (or come after settings.curve_budget_s) are recorded as skipped."""
    model_config = llm.model.config
    dtype_bytes = jnp.dtype(llm.model.dtype).itemsize
    # decode steps a sequence takes while measured (an engine step is a chunk of num_scheduler_steps of them)
    num_steps = (settings.warmup_steps + settings.steps) * settings.num_scheduler_steps
    rows, skipped = [], []
    start = time.perf_counter()
    for prompt in settings.prompts:
        for batch in settings.batches:
            elapsed = time.perf_counter() - start
            reason = skip_reason(llm, batch, prompt, num_steps)
            if reason is None and settings.curve_budget_s is not None and elapsed > settings.curve_budget_s:
                reason = f"time budget: {elapsed:.0f}s spent > curve_budget_s={settings.curve_budget_s:g}"
            if reason:
                skipped.append({"batch": batch, "prompt": prompt, "reason": reason})
                print(f"  decode-curve b{batch} p{prompt}: skipped ({reason})", flush=True)
                continue
            row = measure(llm, batch, prompt, settings.steps, warmup_steps=settings.warmup_steps,
                          device_repeats=settings.device_repeats)
            rows.append(with_roofline(row, model_config, dtype_bytes, settings.bandwidth))
            print(f"  decode-curve b{batch} p{prompt}: {row['step_ms']:.2f} ms/step, {row['tok_per_s']:.0f} tok/s "
                  f"({percent(rows[-1]['roofline_fraction'])} of roofline) [{time.perf_counter() - start:.0f}s]", flush=True)
    return {"rows": rows, "skipped": skipped, "table": markdown_table(rows, COLUMNS), "seconds": time.perf_counter() - start,
            "roofline": roofline_notes(model_config, dtype_bytes, settings.bandwidth),
            "analysis": explain(model_config, rows, dtype_bytes, settings.bandwidth, settings.async_scheduling)}


def roofline_notes(model_config, dtype_bytes: int, bytes_per_s: float) -> dict:
    return {
        "bytes_per_s": bytes_per_s, "dtype_bytes": dtype_bytes,
        "kv_bytes_per_token": kv_bytes_per_token(model_config, dtype_bytes),
        "experts_touched": "E * (1 - (1 - k/E)^B) per MoE layer: each token picks top-k of E experts uniformly "
                           "at random, independently of the other tokens",
        "bytes": "always-read weights (attention, norms, dense MLPs, routers, shared experts, lm_head) + B "
                 "embedding rows + touched routed experts + KV latents read over each sequence's context and "
                 "written for its new token; activations left out",
    }


def explain(model_config, rows: list[dict], dtype_bytes: int, bytes_per_s: float,
            overlapped: bool = False) -> list[str]:
    """Where the roofline bends and why, and how the measured curve follows it, from this run's numbers.
    overlapped: the engine ran with async scheduling (host work overlaps the device step)."""
    c = model_config
    lines = []
    one = decode_step_bytes(c, 1, 1, dtype_bytes)
    if c.num_moe_layers:
        e, k = c.n_routed_experts, c.num_experts_per_tok
        b50, b95 = batch_touching_fraction(0.5, e, k), batch_touching_fraction(0.95, e, k)
        full = decode_step_bytes(c, b95, b95, dtype_bytes)
        lines.append(
            f"Expert bend: a token reads top-{k} of {e} routed experts a layer; a batch of B touches "
            f"E(1-(1-k/E)^B) of them on average: {k} at B=1, half at B={b50}, 95% at B={b95}. Up to there each "
            f"added sequence brings experts of its own, so a step's bytes grow almost as fast as its tokens "
            f"({size(one.total)} at B=1, {size(full.total)} at B={b95}) and the roofline rises "
            f"slowly ({one.tok_per_s(bytes_per_s):,.0f} -> {full.tok_per_s(bytes_per_s):,.0f} tok/s). Past it every "
            f"weight is read every step, a fixed cost, and tok/s grows in proportion to the batch: the memory wall.")
    weight_bytes = all_weight_bytes(c, dtype_bytes)
    per_token = kv_bytes_per_token(c, dtype_bytes)
    equal = weight_bytes / per_token
    lines.append(
        f"KV bend: each token of context costs {per_token:,} bytes a step ({c.num_hidden_layers} layers x "
        f"{c.kv_cache_dim} latents x {dtype_bytes} B); the KV read equals the {size(weight_bytes)} of weights "
        f"at batch x context = {equal:,.0f} tokens (batch {equal / 2048:,.0f} at 2k context). Beyond that the step "
        f"time grows with the batch again and tok/s levels off at bandwidth / (context x {per_token:,} B) "
        f"({bytes_per_s / (2048 * per_token):,.0f} tok/s at 2k context).")
    for prompt in sorted({r["prompt"] for r in rows}):
        curve = sorted((r for r in rows if r["prompt"] == prompt), key=lambda r: r["batch"])
        lo, hi = curve[0], curve[-1]
        flat = max(r["batch"] for r in curve if r["step_ms"] <= 1.5 * lo["step_ms"])
        line = (f"Measured, prompt {prompt}: {lo['tok_per_s']:,.0f} tok/s at batch {lo['batch']} "
                f"({percent(lo['roofline_fraction'])} of its roofline) to {hi['tok_per_s']:,.0f} at batch "
                f"{hi['batch']} ({percent(hi['roofline_fraction'])}); ")
        base = f"batch {lo['batch']}'s {lo['step_ms']:.2f} ms"
        if flat == hi["batch"]:
            line += f"the step stays within 1.5x of {base} at every batch measured ({hi['step_ms']:.2f} ms at " \
                    f"batch {hi['batch']})"
        elif flat == lo["batch"]:
            nxt = curve[1]
            line += f"the step passes 1.5x of {base} already at batch {nxt['batch']} ({nxt['step_ms']:.2f} ms) " \
                    f"and reaches {hi['step_ms']:.2f} ms at batch {hi['batch']}"
        else:
            line += f"the step stays within 1.5x of {base} up to batch {flat}, then reaches {hi['step_ms']:.2f} ms"
        if hi.get("host_ms") is not None and overlapped:
            line += (f"; with async scheduling the host's work (schedule, pack, fetch) overlaps the device step: "
                     f"the engine step is {lo['step_ms'] / lo['device_step_ms']:.2f}x the compiled step alone at "
                     f"batch {lo['batch']} and {hi['step_ms'] / hi['device_step_ms']:.2f}x at batch {hi['batch']}")
        elif hi.get("host_ms") is not None:
            line += (f"; host work (schedule, pack, fetch) is {lo['host_ms'] / lo['step_ms']:.0%} of the step at "
                     f"batch {lo['batch']} and {hi['host_ms'] / hi['step_ms']:.0%} at batch {hi['batch']}")
        lines.append(line + ".")
    return lines


def size(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.3g} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.3g} MB"


def percent(fraction: float) -> str:
    """Two significant digits below 1% (the CPU's points against an H200 roofline), whole percents above."""
    return f"{fraction:.0%}" if fraction >= 0.01 else f"{fraction * 100:.2g}%"


def plot_decode_curve(payload: dict, directory: Path, name: str) -> list[Path]:
    """<name>_throughput.png (tok/s against batch, roofline dashed, issue #8's H200 targets starred) and
    <name>_latency.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    prompts = sorted({r["prompt"] for r in rows})
    colors = dict(zip(prompts, plt.get_cmap("viridis")([i / max(1, len(prompts) - 1) * 0.85 for i in range(len(prompts))])))
    title = f"{payload['preset']} decode, {payload['device']}"
    paths = []
    for kind in ("throughput", "latency"):
        fig, ax = plt.subplots(figsize=(7.5, 5))
        for prompt in prompts:
            curve = sorted((r for r in rows if r["prompt"] == prompt), key=lambda r: r["batch"])
            x = [r["batch"] for r in curve]
            key, dev, roof = (("tok_per_s", "device_tok_per_s", "roofline_tok_per_s") if kind == "throughput"
                              else ("step_ms", "device_step_ms", "roofline_step_ms"))
            color = colors[prompt]
            ax.plot(x, [r[key] for r in curve], "o-", color=color, label=f"prompt {prompt}: engine step")
            if all(dev in r for r in curve):
                ax.plot(x, [r[dev] for r in curve], ".:", color=color, label=f"prompt {prompt}: compiled step alone")
            ax.plot(x, [r[roof] for r in curve], "--", color=color, alpha=0.6, label=f"prompt {prompt}: roofline")
        if kind == "throughput":
            for target in payload.get("targets", []):
                batch, prompt, target = target["batch"], target["prompt"], target["tok_per_s"]
                ax.plot([batch], [target], "k*", markersize=11)
                ax.annotate(f"H200 target b{batch}, prompt {prompt}", (batch, target), textcoords="offset points",
                            xytext=(6, -10), fontsize=8, ha="right" if batch == max(r["batch"] for r in rows) else "left")
        ax.set_xscale("log", base=2)
        batches = sorted({r["batch"] for r in rows})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences decoding)")
        ax.set_ylabel("decode tokens/s" if kind == "throughput" else "step latency (ms)")
        bw = payload["roofline"]["bytes_per_s"] / 1e12
        ax.set_title(f"{title}\nroofline: bytes a step must read / {bw:.2f} TB/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = Path(directory) / f"{name}_{kind}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
