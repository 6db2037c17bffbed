"""Shared test set-up: CPU-friendly JAX flags and tiny random Hugging Face checkpoints."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu") if not os.environ.get("DSJAX_TEST_GPU") else None

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
