"""Helpers the kernel tests share: fast CPU compiles of interpret-mode kernels, GPU lowering checks, the
relative error of a result."""

from __future__ import annotations

import jax
import numpy as np

from dsjax.model.dispatch import compiler_options
from pallas_kernels.common import lower_for_h200  # noqa: F401 (the kernel tests import it from here)


def run_fast(fn, *args):
    """jit with dispatch.compiler_options (XLA -O1): interpret-mode kernels become large CPU programs
    that compile faster so."""
    return jax.jit(fn, compiler_options=compiler_options("interpret"))(*args)


def relative_error(got, want) -> float:
    """||got - want|| / ||want|| in f32, after checking that got is finite."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))
