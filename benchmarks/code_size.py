"""Machine-code size of the Mosaic GPU kernels a run compiled: ptxas on each PTX file that Mosaic GPU dumped
(``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=<dir>``), the size of each kernel's ``.text`` section (SASS,
16 bytes an instruction) and ptxas' registers and spill.

Why: a persistent kernel that runs every phase of a layer loops over more code than an SM's instruction
cache holds; a phase then waits on instruction fetches each layer (decode_profile.md round 26).

    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=/tmp/dump python -m benchmarks.megakernel_probe --layer-chain 2
    python -m benchmarks.code_size /tmp/dump --out code_size.json
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import site
import struct
import subprocess
import tempfile

from benchmarks.common import markdown_table, write_probe


def text_bytes(cubin: bytes) -> dict[str, int]:
    """The ``.text.<kernel>`` section sizes of an ELF64 cubin."""
    section_offset = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names_at = headers[names_index][4]  # the section-name table's file offset
    sizes = {}
    for header in headers:
        start = names_at + header[0]
        name = cubin[start:cubin.index(b"\0", start)].decode()
        if name.startswith(".text."):
            sizes[name[len(".text."):]] = header[5]
    return sizes


def ptxas() -> str:
    """The ptxas beside JAX's CUDA plugin (the nvidia-cuda-nvcc wheel), else the one on PATH."""
    found = [path for packages in site.getsitepackages()
             for path in glob.glob(os.path.join(packages, "nvidia", "**", "bin", "ptxas"), recursive=True)]
    found += glob.glob("/usr/local/cuda*/bin/ptxas")
    path = found[0] if found else shutil.which("ptxas")
    if path is None:
        raise SystemExit("no ptxas found (the nvidia-cuda-nvcc wheel or a CUDA toolkit has it)")
    return path


def sizes(dump_dir: str, arch: str = "sm_90a") -> list[dict]:
    """A row a dumped PTX file, in the order the run compiled them: its kernels' code bytes and ptxas' report."""
    tool, rows = ptxas(), []
    files = sorted(glob.glob(os.path.join(dump_dir, "*.ptx")), key=os.path.getmtime)
    with tempfile.TemporaryDirectory() as tmp:
        for ptx in files:
            cubin = os.path.join(tmp, "k.cubin")
            report = subprocess.run([tool, f"-arch={arch}", "-O3", "-v", ptx, "-o", cubin], capture_output=True,
                                    text=True, check=True).stderr
            used = re.search(r"Used (\d+) registers", report)
            spill = re.search(r"(\d+) bytes spill stores", report)
            with open(cubin, "rb") as f:
                code = sum(text_bytes(f.read()).values())
            rows.append({"ptx": os.path.basename(ptx), "code_bytes": code, "instructions": code // 16,
                         "registers": int(used.group(1)) if used else None,
                         "spill_store_bytes": int(spill.group(1)) if spill else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump_dir")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = sizes(args.dump_dir)
    table = markdown_table(rows, ["ptx", "code_bytes", "instructions", "registers", "spill_store_bytes"])
    write_probe(rows, table, args.out, command=f"python -m benchmarks.code_size {args.dump_dir}")


if __name__ == "__main__":
    main()
