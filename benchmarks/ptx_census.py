"""What Triton made of a Pallas kernel: its PTX from XLA's dump, and a census of the instructions that
tell how it streams memory (asynchronous copies and their widths, plain global loads, barriers, MMAs).

``moe_decode`` at one token streams only ~21 GB/s an SM when every SM holds one program
(decode_profile.md round 16), as if its loads were not pipelined; this shows whether its gate / up
and down loops issue ``cp.async`` (Triton's software pipeline) or plain ``ld.global``, and how wide,
for gate and up read from rows or from column tiles. GPU only: XLA compiles the PTX there.

    python benchmarks/ptx_census.py --out-dir /tmp/ptx   # per layout: the kernel's PTX and a census
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Instruction families counted in a kernel's PTX: name -> pattern at the start of an instruction.
FAMILIES = {
    "cp.async (cache global)": r"cp\.async\.cg\.shared\.global",
    "cp.async (cache all)": r"cp\.async\.ca\.shared\.global",
    "cp.async.bulk (TMA)": r"cp\.async\.bulk",
    "cp.async wait": r"cp\.async\.(wait_group|wait_all|commit_group)",
    "ld.global v4": r"ld\.global(\.\w+)*\.v4",
    "ld.global v2": r"ld\.global(\.\w+)*\.v2",
    "ld.global scalar": r"ld\.global(?!(\.\w+)*\.v[24])",
    "st.global": r"st\.global",
    "bar.sync": r"bar\.sync|barrier\.sync",
    "mma": r"mma\.sync",
    "wgmma": r"wgmma\.",
    "ldmatrix": r"ldmatrix",
}


def kernel_bodies(ptx: str) -> dict[str, str]:
    """PTX text -> {entry name: its body} for every ``.entry`` (kernel) in it."""
    bodies, starts = {}, [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+(\w+)", ptx)]
    for (start, name), nxt in zip(starts, [s for s, _ in starts[1:]] + [len(ptx)]):
        bodies[name] = ptx[start:nxt]
    return bodies


def census(body: str) -> dict[str, int]:
    """Instruction counts by family (``FAMILIES``) in a kernel body, one per PTX instruction line
    (predicated lines such as ``@%p1 cp.async...`` count too)."""
    lines = [re.sub(r"^\s*@!?%\w+\s+", "", line).strip() for line in body.splitlines()]
    return {family: sum(bool(re.match(pattern, line)) for line in lines) for family, pattern in FAMILIES.items()}


LAYOUTS = ("rows", "column_tiles")


def run_moe_decode(layout: str) -> None:
    """Compile and run ``moe_decode`` once at V2-Lite's one-token MoE layer (top-6 of 64 routed + 2 x
    1408 shared, 2 layers stacked), gate and up in ``layout`` (one of ``LAYOUTS``)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.moe_decode import DecodeTiles, moe_decode, tile_columns

    keys = jax.random.split(jax.random.key(0), 6)
    normal = lambda key, *shape: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
    routed = (normal(keys[0], 2, 64, 2048, 1408), normal(keys[1], 2, 64, 2048, 1408),
              normal(keys[2], 2, 64, 1408, 2048))
    shared = (normal(keys[3], 2, 2048, 2816), normal(keys[4], 2, 2048, 2816), normal(keys[5], 2, 2816, 2048))
    if layout == "column_tiles":  # only this layout's copy is made
        block_i = DecodeTiles().block_i
        tiled = lambda ws: (tile_columns(ws[0], block_i), tile_columns(ws[1], block_i), ws[2])
        routed, shared = tiled(routed), tiled(shared)
    x, weights = jnp.ones((1, 2048), jnp.bfloat16), jnp.full((1, 6), 1 / 6, jnp.float32)
    ids = jnp.arange(6, dtype=jnp.int32)[None]
    jax.block_until_ready(moe_decode(x, weights, ids, *routed, jnp.int32(1), shared))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True, help="where each layout's PTX and census.json go")
    parser.add_argument("--entry", default="moe_decode", help="count only PTX entries whose name contains this")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in LAYOUTS:
        # One process a layout: XLA reads its dump flags once, at the backend's start.
        dump = tempfile.mkdtemp(prefix=f"ptx_{name}_")
        code = (f"import os, sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
                f"from benchmarks.ptx_census import run_moe_decode; run_moe_decode({name!r})")
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()}
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        entries = {}
        for path in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
            for entry, body in kernel_bodies(Path(path).read_text()).items():
                if args.entry in entry:
                    entries[entry] = census(body)
                    (out_dir / f"{name}_{entry}.ptx").write_text(body)
        if not entries:
            raise SystemExit(f"ptx_census: no PTX entry containing {args.entry!r} in {dump} "
                             f"(files: {sorted(os.listdir(dump))[:20]})")
        results[name] = entries
        for entry, counts in entries.items():
            print(f"{name:>12} {entry}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v), flush=True)
    (out_dir / "census.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
