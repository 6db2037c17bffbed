"""Helpers the kernel tests share: fast CPU compiles of interpret-mode kernels, GPU lowering checks."""

from __future__ import annotations

import warnings

import jax


def run_fast(fn, *args):
    """jit at XLA -O0: interpret-mode kernels become large CPU programs that compile ~3x faster so."""
    return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)


def lower_for_h200(fn, *args) -> str:
    """StableHLO of fn lowered for an abstract H200 (no GPU needed): runs the Pallas Triton lowering,
    which rejects non-power-of-two blocks and unsupported ops."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
