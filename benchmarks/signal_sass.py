"""What each way of signalling a global semaphore compiles to: a tiny PTX kernel a variant, assembled by ptxas for
sm_90a, and its machine code (SASS) printed when a disassembler is at hand (``cuobjdump`` with ``nvdisasm``, beside
ptxas or on PATH: the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels have them).

Why: the step kernels' releases (``red.release.gpu``, one a CTA at every grid barrier) cost ~0.7 µs each on the
critical path (decode_profile.md round 44); the instructions a fence becomes say what it waits for.

    python -m benchmarks.signal_sass            # on a machine with ptxas (the device's JAX CUDA plugin has one)
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import tempfile

from benchmarks.code_size import ptxas

VARIANTS = {  # name -> the signal's PTX (the semaphore's address in %rd1)
    "red.release": "red.release.gpu.global.add.u32 [%rd1], 1;",
    "fence.release": "fence.release.gpu;\n    red.relaxed.gpu.global.add.u32 [%rd1], 1;",
    "fence.acq_rel": "fence.acq_rel.gpu;\n    red.relaxed.gpu.global.add.u32 [%rd1], 1;",
    "relaxed": "red.relaxed.gpu.global.add.u32 [%rd1], 1;",
    "acquire (the reader's poll, then its fences)": "ld.relaxed.gpu.global.b32 %r1, [%rd1];\n    fence.acquire.gpu;\n"
                                                    "    fence.proxy.async.global;\n    st.global.b32 [%rd1+4], %r1;",
    # A cluster's scope, for a barrier of clusters (CTAs meeting in their cluster first, one a cluster arriving at
    # the grid's): both hold the same MEMBAR.ALL.GPU as the grid's release (round 45), so meeting in clusters first
    # would put two of them on a barrier's path instead of one.
    "cluster: red.release.cluster": "red.release.cluster.global.add.u32 [%rd1], 1;",
    "cluster: barrier.cluster arrive.release, wait.acquire": "barrier.cluster.arrive.release;\n"
                                                             "    barrier.cluster.wait.acquire;",
}


def kernel_ptx(signal: str, version: str) -> str:
    return f""".version {version}
.target sm_90a
.address_size 64

.visible .entry k(.param .u64 sem)
{{
    .reg .b64 %rd<2>;
    .reg .b32 %r<2>;
    ld.param.u64 %rd1, [sem];
    cvta.to.global.u64 %rd1, %rd1;
    {signal}
    ret;
}}
"""


def _tool(name: str) -> str | None:
    """``name`` beside ptxas, else on PATH."""
    found = glob.glob(os.path.join(os.path.dirname(ptxas()), name))
    return found[0] if found else shutil.which(name)


def disassembler() -> list[str] | None:
    """``cuobjdump -sass`` when it and the ``nvdisasm`` it runs are at hand, else None."""
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    return [cuobjdump, "-sass"] if cuobjdump and nvdisasm else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default="8.7", help="the PTX ISA version of the kernels (8.7 by default)")
    args = parser.parse_args(argv)
    assembler, dis = ptxas(), disassembler()
    if dis:  # cuobjdump runs the nvdisasm found beside it or on PATH
        env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(_tool("nvdisasm")), os.environ.get("PATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "signal.ptx"), os.path.join(tmp, "signal.cubin")
        for name, signal in VARIANTS.items():
            with open(ptx, "w") as f:
                f.write(kernel_ptx(signal, args.version))
            done = subprocess.run([assembler, "-arch=sm_90a", "-o", cubin, ptx], capture_output=True, text=True)
            print(f"## {name}: ptxas rc {done.returncode} {done.stderr.strip()}")
            if done.returncode == 0 and dis:
                sass = subprocess.run([*dis, cubin], capture_output=True, text=True, env=env).stdout
                body = [line.split(";")[0].strip() + ";" for line in sass.splitlines() if "/*0" in line]
                print("\n".join(line for line in body if line.split()[-1] not in ("NOP;", "EXIT;"))
                      .replace("/*", "").replace("*/", ""))
    if dis is None:
        print("no cuobjdump with nvdisasm beside ptxas or on PATH: only whether each assembles")


if __name__ == "__main__":
    main()
