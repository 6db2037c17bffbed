"""Which source lines make a step kernel's code, on the CPU: the kernel lowered for an abstract H200, and the
ops of its lowered Mosaic GPU module counted by the ``pallas_kernels`` line each comes from.

Why: the whole layer's kernel (``decode_step_moe.moe_layer_chain``) is 153 KB of machine code against the
attention chain's 99, and its attention phases run slower in it than alone (decode_profile.md rounds 26-27):
code that overflows the SM's instruction cache is refetched each layer. ``benchmarks.code_size`` measures the
machine code on the GPU; this finds where it comes from, with no GPU, before a device session. Ops are not
instructions (LLVM folds much of the index arithmetic), so compare lines and kernels with each other, and
confirm a cut with ``code_size`` on the device.

    python -m benchmarks.code_lines --kernel whole --top 30
    python -m benchmarks.code_lines --kernel attention --kernel tail --out code_lines.json
"""

from __future__ import annotations

import argparse
import collections
import re

import jax
import jax.numpy as jnp

from benchmarks.common import markdown_table, write_probe

KERNELS = ("whole", "attention", "tail", "gemv")
_SKIPPED = {"arith.constant", "builtin.unrealized_conversion_cast", "llvm.mlir.constant", "llvm.mlir.undef"}
_ALIAS = re.compile(r"^#(loc\d*) = loc\((.*)\)$", re.M)
_SOURCE = re.compile(r'"[^"]*pallas_kernels/([^"]*)":(\d+):\d+')
_OP = re.compile(r'^(?:%[^=]+=\s*)?"?([a-z_]+\.[a-z_.]+)"?')
_OP_LOC = re.compile(r"loc\((#loc\d*|.*)\)\s*$")


def ops_by_line(asm: str) -> collections.Counter:
    """A module's text (with debug info) -> its ops counted by the innermost ``pallas_kernels`` file:line of
    their locations (None: no such line), constants and casts left out."""
    aliases = {name: body for name, body in _ALIAS.findall(asm)}
    resolved: dict[str, str | None] = {}

    def source(body: str, depth: int = 0) -> str | None:
        if found := _SOURCE.search(body):  # callsite(callee at caller): the callee comes first
            return f"{found.group(1)}:{found.group(2)}"
        for name in re.findall(r"#(loc\d*)", body):
            if depth < 64:
                if name not in resolved:
                    resolved[name] = source(aliases.get(name, ""), depth + 1)
                if resolved[name]:
                    return resolved[name]
        return None

    counts = collections.Counter()
    for line in asm.splitlines():
        text = line.strip()
        if not text or text[0] in "#}" or not (loc := _OP_LOC.search(text)):
            continue
        op = _OP.match(text)
        if op is None or op.group(1) in _SKIPPED:
            continue
        counts[source(loc.group(1))] += 1
    return counts


def lowered_modules(fn, *args) -> list[str]:
    """The Mosaic GPU modules (text with debug info) that lowering ``fn(*args)`` for an abstract H200 builds."""
    from jax.experimental.mosaic.gpu import core

    from pallas_kernels.common import lower_for_h200

    if not hasattr(core, "lower_mgpu_module"):
        raise SystemExit(f"jax {jax.__version__}: jax.experimental.mosaic.gpu.core has no lower_mgpu_module "
                         "to watch (this tool reads JAX 0.11's lowering)")
    modules, lower = [], core.lower_mgpu_module

    def watched(module, *a, **k):
        result = lower(module, *a, **k)
        modules.append(module.operation.get_asm(enable_debug_info=True))
        return result

    core.lower_mgpu_module = watched
    try:
        lower_for_h200(fn, *args)
    finally:
        core.lower_mgpu_module = lower
    return modules


def kernel_call(kernel: str, layers: int = 2):
    """(fn, abstract args) of a step kernel at V2-Lite's shapes (``megakernel_probe.layer_inputs``'s)."""
    from benchmarks.megakernel_probe import attention_inputs, layer_inputs
    from pallas_kernels import decode_step_attention, decode_step_mgpu, decode_step_moe

    spec, moe_spec = attention_inputs(1, 0, capacity=64)[-1], decode_step_moe.RouterSpec(1e-6)
    arrays = jax.eval_shape(lambda: tuple(a for i, a in enumerate(layer_inputs(layers, 0)) if i != 6))
    x, pos, table, c_kv, k_pe, attention, norm, router, routed, shared = arrays
    cls = decode_step_attention.AttentionWeights
    if kernel == "whole":
        return (lambda x, pos, table, c_kv, k_pe, attention, norm, router, routed, shared:
                decode_step_moe.moe_layer_chain(x, pos, table, c_kv, k_pe, cls(*attention), spec, norm, router,
                                                moe_spec, 6, *routed, shared)), arrays
    if kernel == "attention":
        return (lambda x, pos, table, c_kv, k_pe, attention: decode_step_attention.attention_chain(
            x, pos, table, c_kv, k_pe, cls(*attention), spec)), (x, pos, table, c_kv, k_pe, attention)
    if kernel == "tail":
        attn = jax.ShapeDtypeStruct((layers, 2048), jnp.bfloat16)
        o_proj = jax.ShapeDtypeStruct((layers, 2048, 2048), jnp.bfloat16)
        return (lambda x, attn, o_proj, norm, router, routed, shared: decode_step_moe.moe_layer_tail_chain(
            x, attn, o_proj, norm, router, moe_spec, 6, *routed, shared)), (x, attn, o_proj, norm, router, routed,
                                                                             shared)
    if kernel == "gemv":
        w = jax.ShapeDtypeStruct((layers, 2048, 2048), jnp.bfloat16)
        return decode_step_mgpu.gemv_chain, (x, w)
    raise SystemExit(f"--kernel {kernel!r}; accepted: {', '.join(KERNELS)}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", action="append", choices=KERNELS, help="default: whole")
    parser.add_argument("--top", type=int, default=25, help="source lines listed a kernel")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    for kernel in args.kernel or ["whole"]:
        counts = collections.Counter()
        fn, operands = kernel_call(kernel)
        for asm in lowered_modules(fn, *operands):
            counts.update(ops_by_line(asm))
        total = sum(counts.values())
        rows.append(dict(kernel=kernel, line="(all)", ops=total, share=1.0))
        rows += [dict(kernel=kernel, line=line or "(no pallas_kernels line)", ops=n, share=round(n / total, 4))
                 for line, n in counts.most_common(args.top)]
    return write_probe(rows, markdown_table(rows, ["kernel", "line", "ops", "share"]), args.out,
                       command="python -m benchmarks.code_lines" + "".join(
                           f" --kernel {k}" for k in args.kernel or ["whole"]) + f" --top {args.top}")


if __name__ == "__main__":
    main()
