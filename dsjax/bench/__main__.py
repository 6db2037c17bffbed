"""End-to-end benchmark: ``python -m dsjax.bench decode-curve|mixed|hf-baseline|all [flags]``.

Regenerate everything on the GPU machine with one command, from the repository root (one H200, about
3 minutes; results, plots and e2e_summary_h200.md go to benchmarks/results/):

    python -m dsjax.bench all

On CPU the same command runs the tiny preset on a small grid (CI runs it through
tests/benchmarks/test_e2e_bench.py). ``--help`` lists the flags; the code lives in benchmarks/e2e.py.
"""

from __future__ import annotations

import os
import sys

# JAX takes 75% of the GPU at start by default; the Hugging Face baseline runs in this process too
# (scenario all), so JAX keeps 60% (weights 29 GiB + the grid's KV) and leaves torch the rest
# (its model is another 29 GiB). Read when JAX starts its backend, at the first device call; a value
# already set wins.
JAX_MEMORY_FRACTION = "0.6"


def main(argv: list[str] | None = None):
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEMORY_FRACTION)
    try:
        from benchmarks import e2e
    except ModuleNotFoundError as e:
        if e.name != "benchmarks":
            raise
        sys.exit("dsjax.bench runs the scripts in benchmarks/ of the dsjax checkout, which is not importable "
                 f"from {os.getcwd()}: run it from the repository root (the folder holding benchmarks/ and dsjax/)")
    return e2e.main(argv)


if __name__ == "__main__":
    main()
