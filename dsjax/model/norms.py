"""RMSNorm, computed in f32 and scaled in the input dtype (as transformers does)."""

from __future__ import annotations

from flax import nnx

from dsjax.model.params import param
from pallas_kernels.common import rms_norm  # the arithmetic the decode kernels fuse; re-exported here

__all__ = ["RMSNorm", "rms_norm"]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis: str, dtype):
        self.weight = param(None, (dim,), (axis,), dtype, init="ones")
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)
