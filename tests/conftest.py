"""Shared test set-up: CPU-friendly JAX flags and tiny random Hugging Face checkpoints."""

from __future__ import annotations

import jax
import pytest

from pathlib import Path

jax.config.update("jax_default_matmul_precision", "highest")
# Engines of the same shape recompile the same step programs across tests and xdist workers: share them, the
# quick ones too (the tiny model's many sub-second compiles; a cold suite 835 -> 790 s on 2 cores, 2026-12-06).
jax.config.update("jax_compilation_cache_dir", str(Path(__file__).resolve().parents[1] / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
