"""Helpers the kernel tests share: fast CPU compiles of interpret-mode kernels, GPU lowering checks."""

from __future__ import annotations

import jax

from pallas_kernels.common import lower_for_h200  # noqa: F401 (the kernel tests import it from here)


def run_fast(fn, *args):
    """jit at XLA -O0: interpret-mode kernels become large CPU programs that compile ~3x faster so."""
    return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)
