"""Attention kernels on the GPU: MLA decode and MLA prefill, ours against the alternatives.

Decode (absorbed MLA over the paged latent cache, bf16, C=512, R=64, page size 64, shuffled page
tables, every sequence at the full context): the Triton ``mla_decode`` over a sweep of block_h /
block_k / num_warps / num_stages / num_splits, the Mosaic GPU kernel (``mla_decode_mosaic``, heads a
multiple of 64) over its split counts, the jitted XLA ``mla_decode_reference``, and JAX's bundled
Triton ``paged_attention`` on GQA with head dim 128 as an anchor (2 KV heads: 512 cached values a
token, next to MLA's 576). Effective bandwidth = cache bytes read / time; FLOPs = 2·H·(C+R+C) a key.

Prefill (causal, B=4, S=4096, H=16, Dn=128, R=64, Dv=128): the Triton ``mla_prefill`` over a block
sweep, the Mosaic GPU kernel (``mla_prefill_mosaic``) over key blocks and ring depths, the XLA
``mla_prefill_reference``, cuDNN flash attention through ``jax.nn.dot_product_attention`` and JAX's
bundled FlashAttention-3 on Mosaic GPU (both need v at the q/k head dim: v is zero-padded to 192).
FLOPs = 2·S²·H·(192+128)/2 a sequence.

Each loop time (``us``) is the median over repeats of one jitted ``lax.fori_loop`` of many calls,
divided by the call count: per-call dispatch never enters the number, but XLA's while loop adds about
7 µs an iteration on the H200 (jax 0.11.2: 91 µs a call in the loop against 84 µs of kernels at
V2-Lite B64, 15.7 against 7.5 µs at batch 1). So every decode row on the GPU is also profiled:
``kernel_us`` is the kernels' own device time per call (decode, split merge and any small op, summed,
without launch gaps), and the decode rates (TB/s, TFLOP/s) and the best-of choice use it;
``loop_TB/s`` keeps the loop's rate. Prefill calls take milliseconds: their loop time stands.

    python benchmarks/kernels_attention.py            # H200: table + benchmarks/results/attention_h200.json
    python benchmarks/kernels_attention.py --no-sweep # only the tuned defaults
    python benchmarks/kernels_attention.py --only decode --out benchmarks/results/attention_h200_decode.json
    python benchmarks/kernels_attention.py --join benchmarks/results/attention_h200_{decode,prefill}.json
    python benchmarks/kernels_attention.py --quick    # tiny shapes, interpret mode on CPU (CI)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_time_us, kernel_time_us  # noqa: E402
from dsjax.model.dispatch import compiler_options  # noqa: E402
from pallas_kernels import mla_decode_mgpu, mla_prefill_mgpu  # noqa: E402
from pallas_kernels.mla_decode import decode_blocks, default_num_splits, mla_decode, mla_decode_reference  # noqa: E402
from pallas_kernels.mla_prefill import PREFILL_BLOCKS, mla_prefill, mla_prefill_reference  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "attention_h200.json"
ANCHOR_KV_HEADS, ANCHOR_HEAD_DIM = 2, 128


class DecodeShape(NamedTuple):
    name: str
    batch: int
    context: int
    num_heads: int
    latent_dim: int = 512
    rope_dim: int = 64
    block_size: int = 64


class PrefillShape(NamedTuple):
    name: str
    batch: int
    seq_len: int
    num_heads: int
    nope_dim: int = 128
    rope_dim: int = 64
    value_dim: int = 128


DECODE_SHAPES = [
    DecodeShape("V2-Lite B64 ctx4096", 64, 4096, 16),
    DecodeShape("V3 B128 ctx2048", 128, 2048, 128),
    DecodeShape("B1 ctx4096 H16", 1, 4096, 16),
    DecodeShape("B1 ctx4096 H128", 1, 4096, 128),
]
PREFILL_SHAPES = [PrefillShape("B4 S4096 H16", 4, 4096, 16)]

# (block_h, block_k, num_warps, num_stages) tried per head count; the DECODE_BLOCKS default comes
# first. Each is also run at half and twice the default split count. Left out: block_h 64 (its
# f32 accumulator spills at 8 warps) and block_k 128 at 4 warps (spills).
DECODE_SWEEP = {
    16: [(16, 32, 4, 2), (16, 32, 8, 3), (16, 64, 8, 2), (16, 64, 4, 3), (16, 128, 8, 2), (16, 32, 4, 4),
         (16, 32, 4, 5), (16, 16, 4, 6)],
    128: [(16, 64, 4, 2), (16, 32, 4, 2), (32, 32, 8, 3), (32, 32, 4, 3), (32, 64, 8, 3), (64, 32, 8, 2)],
}
# Latency configs for a few sequences: one short iteration a program, few stages.
SMALL_BATCH_SWEEP = {16: [(16, 32, 4, 1), (16, 64, 4, 1), (16, 16, 4, 2), (16, 32, 2, 2)],
                     128: [(32, 32, 4, 1), (16, 32, 4, 1)]}
# (block_q, block_k, num_warps, num_stages); 128 x 128 needs 3 stages of 288 KiB: past the SM.
# (block_kv, stages) of the Mosaic kernel; 128 x 3 stages is past shared memory.
MOSAIC_PREFILL_SWEEP = [(64, 2), (64, 3), (64, 4), (128, 2)]
PREFILL_SWEEP = [(128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2)]

QUICK_DECODE = [DecodeShape("quick decode", 2, 64, 16, latent_dim=64, rope_dim=16, block_size=16)]
QUICK_PREFILL = [PrefillShape("quick prefill", 1, 64, 2, nope_dim=32, rope_dim=16, value_dim=32)]


def _decode_inputs(shape: DecodeShape, rng):
    pages_per_seq = shape.context // shape.block_size
    num_pages = shape.batch * pages_per_seq
    bf16 = jnp.bfloat16
    rand = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), bf16)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(shape.batch, pages_per_seq), jnp.int32)
    return (rand(shape.batch, shape.num_heads, shape.latent_dim), rand(shape.batch, shape.num_heads, shape.rope_dim),
            rand(num_pages, shape.block_size, shape.latent_dim), rand(num_pages, shape.block_size, shape.rope_dim),
            tables, jnp.full((shape.batch,), shape.context, jnp.int32))


def _time(row: dict) -> float:
    """µs a call that rates and rankings use: the kernels' own device time where profiled."""
    return row.get("kernel_us", row["us"])


def _row(kernel, shape, config, us=None, *, bytes_read=None, flops=None, error=None, kernels=None):
    row = dict(kernel=kernel, shape=shape._asdict(), config=config)
    if error is not None:
        row["error"] = error
        print(f"  {kernel:<22} {json.dumps(config):<70} FAILED: {error}", flush=True)
        return row
    row["us"] = us
    if kernels is not None:
        row["kernel_us"] = kernels.pop("total")
        row["kernels_us"] = kernels
    seconds = _time(row) * 1e-6
    metric = ""
    if bytes_read is not None:
        row["TB/s"] = bytes_read / seconds / 1e12
        metric = f"{row['TB/s']:7.2f} TB/s "
        if kernels is not None:
            row["loop_TB/s"] = bytes_read / (us * 1e-6) / 1e12
    if flops is not None:
        row["TFLOP/s"] = flops / seconds / 1e12
        metric += f"{row['TFLOP/s']:7.1f} TFLOP/s"
    print(f"  {kernel:<22} {json.dumps(config):<70} {us:10.1f} us {metric}", flush=True)
    if kernels is not None:
        print(f"  {'':<22} kernels alone: {row['kernel_us']:.1f} us "
              + ", ".join(f"{k} {v:.1f}" for k, v in kernels.items()), flush=True)
    return row


def _attempt(kernel, shape, config, fn, args, *, estimate_s, bytes_read=None, flops=None, profile=False, **timing):
    """Times fn in a jitted loop (launch gaps and loop overhead included); with ``profile`` also the
    kernels' own device time per call from a profiler trace (``kernel_us``, and per kernel), which
    the rates then use."""
    try:
        us = device_time_us(fn, args, estimate_s=estimate_s, **timing)
        kernels = kernel_time_us(fn, args) if profile else None
    except Exception as e:  # a config past the SM's shared memory, an unsupported cuDNN shape, ...
        return _row(kernel, shape, config, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return _row(kernel, shape, config, us, bytes_read=bytes_read, flops=flops, kernels=kernels)


def _split_counts(auto: int, max_splits: int, sweep: bool) -> list[int]:
    """The default split count, and with ``sweep`` half and twice it (within one iteration a split)."""
    return sorted({auto, max(1, auto // 2), min(max(1, max_splits), auto * 2)}) if sweep else [auto]


def bench_decode(shape: DecodeShape, *, sweep: bool, interpret: bool, timing: dict) -> list[dict]:
    print(f"decode {shape.name}: B={shape.batch} ctx={shape.context} H={shape.num_heads} "
          f"C={shape.latent_dim} R={shape.rope_dim} bs={shape.block_size}", flush=True)
    rng = np.random.default_rng(0)
    args = _decode_inputs(shape, rng)
    scale = (128 + shape.rope_dim) ** -0.5
    bytes_read = shape.batch * shape.context * (shape.latent_dim + shape.rope_dim) * 2
    # What the absorbed form computes (scores over C + R, values over C, every head and key).
    flops = 2 * shape.batch * shape.num_heads * shape.context * (2 * shape.latent_dim + shape.rope_dim)
    estimate = max(bytes_read / 3e12, flops / 4e14, 5e-6)
    profile = not interpret  # the kernels' own time, without the loop's per-iteration overhead
    rows = []

    default = decode_blocks(shape.num_heads, 2, shape.batch)
    configs = [tuple(default)] + (DECODE_SWEEP[16 if shape.num_heads < 64 else 128] if sweep else [])
    if sweep and shape.batch <= 4:
        configs += SMALL_BATCH_SWEEP[16 if shape.num_heads < 64 else 128]
    configs = list(dict.fromkeys(configs))  # the default may also sit in a sweep list
    for block_h, block_k, num_warps, num_stages in configs:
        auto = default_num_splits(shape.batch, shape.num_heads, shape.context, block_h, block_k)
        splits = _split_counts(auto, shape.context // block_k, sweep)
        for num_splits in splits:
            config = dict(block_h=block_h, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                          num_splits=num_splits, auto_splits=num_splits == auto)
            fn = lambda *a, c=config: mla_decode(
                *a, scale, num_splits=c["num_splits"], block_h=c["block_h"], block_k=c["block_k"],
                num_warps=c["num_warps"], num_stages=c["num_stages"], interpret=interpret, impl="triton")
            rows.append(_attempt("mla_decode", shape, config, fn, args, estimate_s=estimate,
                                 bytes_read=bytes_read, flops=flops, profile=profile, **timing))

    if not interpret and shape.num_heads % mla_decode_mgpu.BLOCK_H == 0:
        # The Mosaic GPU kernel (TMA + wgmma, 64 heads a CTA), what impl="auto" picks on Hopper here.
        auto = default_num_splits(shape.batch, shape.num_heads, shape.context, mla_decode_mgpu.BLOCK_H,
                                  mla_decode_mgpu.BLOCK_K)
        splits = _split_counts(auto, shape.context // mla_decode_mgpu.BLOCK_K, sweep)
        for num_splits in splits:
            config = dict(num_splits=num_splits, auto_splits=num_splits == auto)
            fn = lambda *a, n=num_splits: mla_decode(*a, scale, num_splits=n, impl="mosaic")
            rows.append(_attempt("mla_decode_mosaic", shape, config, fn, args, estimate_s=estimate,
                                 bytes_read=bytes_read, flops=flops, profile=profile, **timing))

    rows.append(_attempt("xla_reference", shape, {}, lambda *a: mla_decode_reference(*a, scale), args,
                         estimate_s=estimate * 4, bytes_read=bytes_read, profile=profile, **timing))
    rows.append(_bench_gqa_anchor(shape, rng, interpret=interpret, timing=timing))
    return rows


def _bench_gqa_anchor(shape: DecodeShape, rng, *, interpret: bool, timing: dict) -> dict:
    """JAX's bundled Triton paged attention (GQA), the same batch / context / query heads."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as gqa
    pages_per_seq = shape.context // shape.block_size
    num_pages = shape.batch * pages_per_seq
    head_dim = ANCHOR_HEAD_DIM if not interpret else 32
    rand = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)
    pages = lambda: rand(ANCHOR_KV_HEADS, num_pages, shape.block_size, head_dim)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(shape.batch, pages_per_seq), jnp.int32)
    args = (rand(shape.batch, shape.num_heads, head_dim), pages(), pages(), tables,
            jnp.full((shape.batch,), shape.context, jnp.int32))
    # Its k_splits must divide the pages of a sequence; 16 query heads a program.
    k_splits = min(pages_per_seq, default_num_splits(
        shape.batch * ANCHOR_KV_HEADS, shape.num_heads // ANCHOR_KV_HEADS, shape.context, 16, 64))
    pages_per_block = max(1, min(64 // shape.block_size, pages_per_seq // k_splits))
    config = dict(kv_heads=ANCHOR_KV_HEADS, head_dim=head_dim, block_h=16, k_splits=k_splits,
                  pages_per_compute_block=pages_per_block, num_warps=4, num_stages=2)
    fn = lambda *a: gqa.paged_attention(*a, block_h=16, pages_per_compute_block=pages_per_block,
                                        k_splits=k_splits, num_warps=4, num_stages=2, interpret=interpret)
    bytes_read = shape.batch * shape.context * ANCHOR_KV_HEADS * head_dim * 2 * 2  # K and V, bf16
    return _attempt("jax_paged_attention_gqa", shape, config, fn, args,
                    estimate_s=max(bytes_read / 3e12, 5e-6), bytes_read=bytes_read, profile=not interpret, **timing)


def bench_prefill(shape: PrefillShape, *, sweep: bool, interpret: bool, timing: dict) -> list[dict]:
    print(f"prefill {shape.name}: B={shape.batch} S={shape.seq_len} H={shape.num_heads} "
          f"Dn={shape.nope_dim} R={shape.rope_dim} Dv={shape.value_dim} causal", flush=True)
    rng = np.random.default_rng(1)
    b, s, h = shape.batch, shape.seq_len, shape.num_heads
    rand = lambda *d: jnp.asarray(rng.standard_normal(d, np.float32), jnp.bfloat16)
    args = (rand(b, s, h, shape.nope_dim), rand(b, s, h, shape.rope_dim), rand(b, s, h, shape.nope_dim),
            rand(b, s, shape.rope_dim), rand(b, s, h, shape.value_dim))
    qk_dim = shape.nope_dim + shape.rope_dim
    scale = qk_dim ** -0.5
    flops = b * 2 * s * s * h * (qk_dim + shape.value_dim) / 2
    estimate = max(flops / 4e14, 5e-6)
    rows = []

    configs = [tuple(PREFILL_BLOCKS[2])] + (PREFILL_SWEEP if sweep else [])
    for block_q, block_k, num_warps, num_stages in configs:
        config = dict(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
        fn = lambda *a, c=config: mla_prefill(*a, scale, **c, interpret=interpret, impl="triton")
        rows.append(_attempt("mla_prefill", shape, config, fn, args, estimate_s=estimate, flops=flops,
                             **timing))

    if not interpret:  # the Mosaic GPU kernel (FA3-style), what impl="auto" picks on Hopper
        default = (mla_prefill_mgpu.BLOCK_KV, mla_prefill_mgpu.STAGES)
        for block_kv, stages in [default] + ([c for c in MOSAIC_PREFILL_SWEEP if c != default] if sweep else []):
            config = dict(block_kv=block_kv, stages=stages)
            fn = lambda *a, c=config: mla_prefill_mgpu.mla_prefill_mgpu(*a, scale, **c)
            rows.append(_attempt("mla_prefill_mosaic", shape, config, fn, args, estimate_s=estimate,
                                 flops=flops, **timing))

    rows.append(_attempt("xla_reference", shape, {}, lambda *a: mla_prefill_reference(*a, scale), args,
                         estimate_s=estimate * 10, flops=flops, **timing))

    # cuDNN takes one q/k head dim and v at the same dim: concatenate the parts, pad v with zeros.
    q = jnp.concatenate(args[:2], axis=-1)
    k = jnp.concatenate([args[2], jnp.broadcast_to(args[3][:, :, None], (b, s, h, shape.rope_dim))], axis=-1)
    v = jnp.pad(args[4], ((0, 0), (0, 0), (0, 0), (0, qk_dim - shape.value_dim)))
    if jax.default_backend() != "gpu":
        rows.append(_row("cudnn", shape, dict(v_padded_to=qk_dim), error="skipped: needs a CUDA GPU"))
    else:
        cudnn = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn")[..., :shape.value_dim]
        rows.append(_attempt("cudnn", shape, dict(v_padded_to=qk_dim), cudnn, (q, k, v),
                             estimate_s=estimate, flops=flops, **timing))
        rows.append(_bench_fa3_anchor(shape, (q, k, v), estimate=estimate, flops=flops, timing=timing))
    return rows


def _bench_fa3_anchor(shape: PrefillShape, qkv, *, estimate: float, flops: float, timing: dict) -> dict:
    """JAX's bundled FlashAttention-3 on Mosaic GPU (float16; one head dim for q, k, v: v zero-padded
    to 192)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = dict(block_q=64, block_kv=64, max_concurrent_steps=2, v_padded_to=qkv[0].shape[-1])
    tuning = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
    fn = lambda q, k, v: attention_mgpu.attention(q, k, v, tuning)[..., :shape.value_dim]
    half = tuple(a.astype(jnp.float16) for a in qkv)  # its shared-memory buffers are float16
    return _attempt("jax_fa3_mosaic", shape, config, fn, half, estimate_s=estimate, flops=flops, **timing)


def _best(rows: list[dict], kernel: str) -> dict:
    best = {}
    for row in rows:
        if row["kernel"] == kernel and "us" in row:
            name = row["shape"]["name"]
            if name not in best or _time(row) < _time(best[name]):
                best[name] = row
    return best


def run(*, quick: bool = False, sweep: bool = True, only: str | None = None, out: Path | None = None) -> dict:
    """Benchmarks every shape and returns (and writes to ``out`` as it goes) the results."""
    interpret = quick
    timing = dict(repeats=1, iters=2, xla_options=compiler_options("interpret")) if quick else {}
    decode_shapes, prefill_shapes = (QUICK_DECODE, QUICK_PREFILL) if quick else (DECODE_SHAPES, PREFILL_SHAPES)
    sweep = sweep and not quick
    results = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   gpu=jax.devices()[0].device_kind, jax=jax.__version__, quick=quick, decode=[], prefill=[])

    def save():
        results["best_decode"] = {k: r["config"] for k, r in _best(results["decode"], "mla_decode").items()}
        results["best_prefill"] = {k: r["config"] for k, r in _best(results["prefill"], "mla_prefill").items()}
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2) + "\n")

    for shape in decode_shapes if only != "prefill" else []:
        results["decode"] += bench_decode(shape, sweep=sweep, interpret=interpret, timing=timing)
        save()
    for shape in prefill_shapes if only != "decode" else []:
        results["prefill"] += bench_prefill(shape, sweep=sweep, interpret=interpret, timing=timing)
        save()
    _print_summary(results)
    return results


def _print_summary(results: dict) -> None:
    print(f"\n{results['gpu']}, jax {results['jax']}: best of each kernel")
    print(f"{'shape':<22} {'kernel':<24} {'us':>10} {'TB/s':>7} {'TFLOP/s':>8}  config")
    for section in ("decode", "prefill"):
        kernels = dict.fromkeys(r["kernel"] for r in results[section])
        for kernel in kernels:
            for name, row in _best(results[section], kernel).items():
                tbs = f"{row['TB/s']:7.2f}" if "TB/s" in row else f"{'':7}"
                tfl = f"{row['TFLOP/s']:8.1f}" if "TFLOP/s" in row else f"{'':8}"
                print(f"{name:<22} {kernel:<24} {row['us']:10.1f} {tbs} {tfl}  {json.dumps(row['config'])}")


def join_halves(decode: Path, prefill: Path, out: Path = RESULTS) -> dict:
    """One results file from a decode-only and a prefill-only run (each half fills one device call)."""
    halves = {"decode": json.loads(decode.read_text()), "prefill": json.loads(prefill.read_text())}
    first = halves["decode"]
    results = dict(date=first["date"], gpu=first["gpu"], jax=first["jax"], quick=first["quick"],
                   sources={k: f"{p.name} ({v['date']})" for (k, v), p in zip(halves.items(), (decode, prefill))},
                   decode=halves["decode"]["decode"], prefill=halves["prefill"]["prefill"])
    results["best_decode"] = {k: r["config"] for k, r in _best(results["decode"], "mla_decode").items()}
    results["best_prefill"] = {k: r["config"] for k, r in _best(results["prefill"], "mla_prefill").items()}
    out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU, CI)")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="only the tuned defaults")
    parser.add_argument("--only", choices=("decode", "prefill"), help="one half (each fits a 10-minute run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default benchmarks/results/attention_h200.json; none with --quick)")
    parser.add_argument("--join", nargs=2, type=Path, metavar=("DECODE_JSON", "PREFILL_JSON"),
                        help="no run: write --out (default attention_h200.json) from a decode and a prefill half")
    args = parser.parse_args(argv)
    if args.join:
        return join_halves(*args.join, out=args.out or RESULTS)
    out = args.out if args.out is not None or args.quick else RESULTS
    return run(quick=args.quick, sweep=args.sweep, only=args.only, out=out)


if __name__ == "__main__":
    main()
