"""Which source lines a kernel's machine code comes from: a Mosaic GPU PTX dump (``MOSAIC_GPU_DUMP_PTX=1
MOSAIC_GPU_DUMP_TO=<dir>``, on the GPU machine) assembled here by ptxas with line info, disassembled by nvdisasm,
its SASS instructions counted by the ``pallas_kernels`` file and line each belongs to; with ``--base``, against
another dump's (what a variant adds or removes, line by line).

Why: the whole layers' kernel sits at the edge of the SM's instruction cache (decode_profile.md rounds 26-28 and
46), so a build that adds a few hundred instructions to a phase can cost microseconds a layer; ``code_size`` gives
the total, ``code_lines`` the MLIR ops by line (no GPU), this the machine code by line (no GPU, once the PTX is
here).

    python -m benchmarks.sass_lines ptx_flagged/anonymous_0.ptx --base ptx_built/anonymous_0.ptx --top 30
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import site
import subprocess
import tempfile

from benchmarks.code_size import ptxas
from benchmarks.common import markdown_table, write_probe

_FILE_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S")


def nvdisasm() -> str:
    """nvdisasm: $NVDISASM, beside ptxas (a CUDA toolkit, the nvidia-cuda-nvdisasm wheel), else on PATH."""
    found = [os.environ["NVDISASM"]] if os.environ.get("NVDISASM") else []
    found += [path for packages in site.getsitepackages()
              for path in glob.glob(os.path.join(packages, "nvidia", "**", "bin", "nvdisasm"), recursive=True)]
    found += glob.glob(os.path.join(os.path.dirname(ptxas()), "nvdisasm")) + glob.glob("/usr/local/cuda*/bin/nvdisasm")
    path = next((p for p in found if os.path.exists(p)), None) or shutil.which("nvdisasm")
    if path is None:
        raise SystemExit("no nvdisasm found ($NVDISASM, a CUDA toolkit or the nvidia-cuda-nvdisasm wheel has it)")
    return path


def count_lines(sass: str) -> collections.Counter:
    """nvdisasm -g output -> SASS instructions counted by (file name, line) of the line info before them
    (None: before any)."""
    counts, where = collections.Counter(), None
    for line in sass.splitlines():
        if found := _FILE_LINE.search(line):
            where = (os.path.basename(found.group(1)), int(found.group(2)))
        elif _INSTRUCTION.match(line):
            counts[where] += 1
    return counts


def sass_lines(ptx: str, arch: str = "sm_90a") -> collections.Counter:
    """A PTX file -> its SASS instructions by (file, line)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run([ptxas(), f"-arch={arch}", "-O3", "-lineinfo", ptx, "-o", cubin], capture_output=True,
                       check=True)
        sass = subprocess.run([nvdisasm(), "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    return count_lines(sass)


def rows(counts: collections.Counter, base: collections.Counter | None, top: int) -> list[dict]:
    """The ``top`` lines by instructions (with a base: by the change's size), and each file's total."""
    base = base if base is not None else collections.Counter()
    keys = set(counts) | set(base)
    by = (lambda k: -abs(counts[k] - base[k])) if base else (lambda k: -counts[k])
    out = [{"line": f"{k[0]}:{k[1]}" if k else "(none)", "instructions": counts[k], "base": base[k],
            "change": counts[k] - base[k]} for k in sorted(keys, key=by)[:top]]
    files = collections.Counter(), collections.Counter()
    for counter, total in zip((counts, base), files):
        for k, n in counter.items():
            total[k[0] if k else "(none)"] += n
    out += [{"line": f"{name} (all)", "instructions": files[0][name], "base": files[1][name],
             "change": files[0][name] - files[1][name]} for name in sorted(set(files[0]) | set(files[1]))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ptx")
    parser.add_argument("--base", default=None, help="another dump's PTX: the change, line by line")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    counts = sass_lines(args.ptx)
    table_rows = rows(counts, sass_lines(args.base) if args.base else None, args.top)
    columns = ["line", "instructions", "base", "change"] if args.base else ["line", "instructions"]
    write_probe(table_rows, markdown_table(table_rows, columns), args.out,
                command=f"python -m benchmarks.sass_lines {args.ptx}" + (f" --base {args.base}" if args.base else ""))


if __name__ == "__main__":
    main()
