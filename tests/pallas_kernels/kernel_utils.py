"""Helpers the kernel tests share: fast CPU compiles of interpret-mode kernels, GPU lowering checks."""

from __future__ import annotations

import jax

from dsjax.model.dispatch import compiler_options
from pallas_kernels.common import lower_for_h200  # noqa: F401 (the kernel tests import it from here)


def run_fast(fn, *args):
    """jit with dispatch.compiler_options (XLA -O1): interpret-mode kernels become large CPU programs
    that compile faster so."""
    return jax.jit(fn, compiler_options=compiler_options("interpret"))(*args)
