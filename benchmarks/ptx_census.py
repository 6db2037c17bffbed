"""What Triton makes of a Pallas kernel, on the CPU: its Triton IR as the H200 lowering emits it, compiled
to PTX by the ``triton`` package, and a census of the instructions that tell how it streams memory
(asynchronous copies and their waits, plain global loads, barriers, MMAs).

XLA's dumps hold no Triton PTX (session 31's census looked for it there, 2026-12-02), and device time is
scarce, so this compiles the IR itself: it captures each Pallas Triton module while ``jax`` lowers a
function for an abstract H200 (``pallas_kernels.common.lower_for_h200``), with its ``num_warps`` and
``num_stages``, and hands the text to ``triton.compile`` for sm_90a in an interpreter that has the
package (``--triton-python``; the GPU image's triton 3.6, or ``pip install triton==3.6.0`` in a venv of
its own). XLA compiles the same IR with the Triton it bundles, so passes may differ in detail; the
pipelining decisions (which loads become ``cp.async``, how many stages) are the upstream pipeliner's.

    python -m benchmarks.ptx_census --triton-python /tmp/trivenv/bin/python --out-dir /tmp/ptx

Kernels: ``moe_decode`` at V2-Lite's one-token layer with the engine's tiles (``KERNELS``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Instruction families counted in a kernel's PTX: name -> pattern at the start of an instruction.
FAMILIES = {
    "cp.async 16 B (cache global)": r"cp\.async\.cg\.shared\.global(\.\w+)*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(16|0x10)\b",
    "cp.async (cache global)": r"cp\.async\.cg\.shared\.global",
    "cp.async (cache all)": r"cp\.async\.ca\.shared\.global",
    "cp.async.bulk (TMA)": r"cp\.async\.bulk",
    "cp.async commit": r"cp\.async\.commit_group",
    "cp.async wait": r"cp\.async\.wait_(group|all)",
    "ld.global v4": r"ld\.global(\.\w+)*\.v4",
    "ld.global v2": r"ld\.global(\.\w+)*\.v2",
    "ld.global scalar": r"ld\.global(?!(\.\w+)*\.v[24])",
    "st.global": r"st\.global",
    "bar.sync": r"bar\.sync|barrier\.sync",
    "mma": r"mma\.sync",
    "wgmma": r"wgmma\.",
    "ldmatrix": r"ldmatrix",
}

_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
src, out, warps, stages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
open(out, "w").write(kernel.asm["ptx"])
"""


def census(ptx: str) -> dict[str, int]:
    """Instruction counts by family (``FAMILIES``) in PTX text, one per instruction line (predicated
    lines such as ``@%p1 cp.async...`` count too)."""
    lines = [re.sub(r"^\s*@!?%\w+\s+", "", line).strip() for line in ptx.splitlines()]
    return {family: sum(bool(re.match(pattern, line)) for line in lines) for family, pattern in FAMILIES.items()}


def capture_triton_modules(fn, *args) -> list[dict]:
    """fn(*args) lowered for an abstract H200 -> [{name, ttir, num_warps, num_stages}] for each Pallas
    Triton kernel in it, in lowering order (no GPU needed)."""
    from jax._src.pallas.triton import lowering

    from pallas_kernels.common import lower_for_h200

    texts, original = [], lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = original(*a, **k)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        hlo = lower_for_h200(fn, *args)
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    # each Triton custom call's backend config names the kernel and its warps and stages, in order
    configs = re.findall(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', hlo)
    if len(configs) != len(texts):
        raise RuntimeError(f"ptx_census: {len(texts)} Triton modules but {len(configs)} kernel configs in the HLO")
    return [dict(name=name, ttir=text, num_stages=int(stages), num_warps=int(warps))
            for text, (name, stages, warps) in zip(texts, configs)]


def compile_ptx(module: dict, python: str, work: Path) -> str:
    """PTX of a captured module, compiled by ``triton`` in the interpreter ``python``."""
    src, out = work / f"{module['name']}.ttir", work / f"{module['name']}.ptx"
    src.write_text(module["ttir"])
    run = subprocess.run([python, "-c", _COMPILE, str(src), str(out), str(module["num_warps"]),
                          str(module["num_stages"])], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ptx_census: triton.compile of {module['name']} failed in {python}:\n{run.stderr[-3000:]}")
    return out.read_text()


def _moe_decode_v2_lite():
    import jax
    import jax.numpy as jnp

    from dsjax.model import dispatch
    from pallas_kernels.moe_decode import moe_decode

    shape, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    shared = (shape((26, 2048, 2816), bf16), shape((26, 2048, 2816), bf16), shape((26, 2816, 2048), bf16))
    fn = lambda *a: moe_decode(*a, tiles=dispatch.MOE_DECODE_TILES)
    return fn, (shape((1, 2048), bf16), shape((1, 6), jnp.float32), shape((1, 6), jnp.int32),
                shape((26, 64, 2048, 1408), bf16), shape((26, 64, 2048, 1408), bf16),
                shape((26, 64, 1408, 2048), bf16), shape((), jnp.int32), shared)


KERNELS = {"moe_decode": _moe_decode_v2_lite}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="moe_decode")
    parser.add_argument("--triton-python", default=sys.executable,
                        help="an interpreter with the triton package (default: this one)")
    parser.add_argument("--out-dir", default=None, help="where the IR, the PTX and census.json go")
    args = parser.parse_args(argv)
    fn, fn_args = KERNELS[args.kernel]()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.out_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = {}
        for module in capture_triton_modules(fn, *fn_args):
            counts = census(compile_ptx(module, args.triton_python, work))
            result[module["name"]] = dict(num_warps=module["num_warps"], num_stages=module["num_stages"], **counts)
            print(module["name"], json.dumps(result[module["name"]]), flush=True)
        (work / "census.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
