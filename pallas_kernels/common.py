"""Small pieces the kernels share."""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def why_not_hopper() -> str | None:
    """None on a Hopper GPU (the Mosaic GPU kernels' wgmma/TMA need sm_90a), else why not."""
    if jax.default_backend() != "gpu":
        return "not on a GPU"
    if _compute_capability() != "9.0":
        return "not a Hopper GPU (wgmma/TMA as written here need sm_90a)"
    return None


def lower_for_h200(fn, *args) -> str:
    """StableHLO of fn lowered for an abstract H200 (no GPU needed): runs the Pallas Triton and Mosaic
    GPU lowerings, which reject what the GPU could not run (non-power-of-two blocks, unsupported ops). Traced
    anew each call: JAX caches a function's trace by its identity, and a kernel's trace-time module constants
    (a plan, a variant) may have changed since the last call."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Pallas Triton backend's notice
        return jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@functools.cache
def _compute_capability() -> str:
    return str(getattr(jax.devices()[0], "compute_capability", ""))


def inv_rms(sum_of_squares, depth: int, eps: float):
    """RMSNorm's scale 1 / sqrt(mean(x^2) + eps) from a row's sum of squares over ``depth`` values (the
    kernels that fold the norm in get the sum from split-K partials)."""
    return jax.lax.rsqrt(sum_of_squares / depth + eps)


def rms_norm(x, weight, eps: float):
    """x [..., D] over its last axis, in f32 and scaled in x's dtype (as transformers does), times weight
    [D]: the model's RMSNorm (``dsjax.model.norms``) and the references of the kernels that fuse it."""
    x32 = x.astype(jnp.float32)
    return scale_rows(x, weight, inv_rms(jnp.sum(x32 * x32, axis=-1, keepdims=True), x.shape[-1], eps))


def scale_rows(x, weight, scale):
    """RMSNorm's output from each row's 1 / rms ``scale`` [..., 1] (f32): x * scale in f32, rounded to
    x's dtype, times weight [D] (``rms_norm``; the kernels that sum the squares apart finish with it)."""
    return weight * (x.astype(jnp.float32) * scale).astype(x.dtype)


def cos_sin(freqs, cos_sin_scale: float):
    """cos and sin of the rope angles ``freqs``, scaled by ``cos_sin_scale`` (YaRN)."""
    return jnp.cos(freqs) * cos_sin_scale, jnp.sin(freqs) * cos_sin_scale


# 2 pi as three f32 parts whose sum is within 2e-13 of it (Cody and Waite's reduction): the first two keep 8
# significant bits, so k times either is exact for k < 2^16; the third is 2 pi's rest, rounded
TWO_PI_PARTS = (6.28125, 0.0019302368, 5.0703634e-06)
REDUCED_ANGLES_BELOW = 2 ** 16 * 6.28125  # where k times the first two parts stops being exact


def reduced_cos_sin(angles, cos_sin_scale: float):
    """``cos_sin`` of f32 angles in [0, ``REDUCED_ANGLES_BELOW``) taken to [-pi, pi] first: k = round(angle / 2 pi),
    angle - k * each part of ``TWO_PI_PARTS`` in turn (within ~3e-7 of the f32 angle's true remainder). A kernel
    compiled with approximate math (``cos.approx`` / ``sin.approx``, accurate to ~1e-6 on [-pi, pi] only) then
    gives the rope's cos and sin of any position it takes; the engine computes them exactly (``cos_sin``)."""
    k = jnp.round(angles * (1 / (2 * math.pi)))
    rest = angles
    for part in TWO_PI_PARTS:
        rest = rest - k * part
    return cos_sin(rest, cos_sin_scale)


def rotate_by(x1, x2, cos, sin):
    """One rope rotation of the pairs (x1, x2) given the (scaled) cos and sin of its angles -> (x1 cos - x2
    sin, x2 cos + x1 sin)."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def rotate_pair(x1, x2, freqs, cos_sin_scale: float):
    """One rope rotation of the pairs (x1, x2) by angles freqs, cos and sin scaled by ``cos_sin_scale``
    (YaRN); kernels that load the two halves apart call it."""
    return rotate_by(x1, x2, *cos_sin(freqs, cos_sin_scale))


def rotate(x32, freqs, cos_sin_scale: float, interleave: bool):
    """Rotary embedding of f32 x [..., R] by angles freqs [..., R / 2] (broadcast against x's leading
    axes) -> f32 [..., R] in the halves layout [rotated evens | rotated odds], whether x's pairs are
    interleaved (x0, x1), (x2, x3), ... (DeepSeek's checkpoints) or (x_i, x_{i+R/2}). q and k share the
    layout, so q·k is unchanged. ``dsjax.model.rope.apply_rope`` and the kernels' references use it."""
    if interleave:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    else:
        x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate(rotate_pair(x1, x2, freqs, cos_sin_scale), axis=-1)


def dot_precision(dtype):
    """f32 operands get IEEE products: the Triton lowering otherwise runs f32 dots as TF32, which
    would make f32 runs disagree with the references. bf16/fp16 keep the tensor cores' native path."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def shrink_for_itemsize(block_k: int, num_stages: int, itemsize: int) -> tuple[int, int]:
    """Tile tables are tuned for 2-byte operands; 4-byte (f32) tiles halve block_k and keep at most
    two pipeline stages so the staged tiles still fit in shared memory (227 KiB per block on H100/H200)."""
    if itemsize <= 2:
        return block_k, num_stages
    return max(16, block_k // 2), min(num_stages, 2)


def swiglu_accumulators(x_ref, x_rows, load_gate, load_up, *, block_m: int, block_n: int, block_k: int,
                        depth: int):
    """Both GEMMs of one SwiGLU output tile over the whole K extent (inside a kernel): rows ``x_rows``
    of x_ref [*, depth] times the weight tiles load_gate(k0) / load_up(k0) [block_k, block_n] -> two f32
    [block_m, block_n] accumulators. Each K step loads its x tile once, for both GEMMs."""

    def body(kk, carry):
        acc_gate, acc_up = carry
        k0 = pl.multiple_of(kk * block_k, block_k)
        k_idx = k0 + jnp.arange(block_k)
        x_tile = x_ref.at[x_rows[:, None], k_idx[None, :]]
        if depth % block_k:
            x = plgpu.load(x_tile, mask=(k_idx < depth)[None, :], other=0)
        else:
            x = plgpu.load(x_tile)
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=dot_precision(x.dtype))
        return acc_gate + dot(x, load_gate(k0)), acc_up + dot(x, load_up(k0))

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    return jax.lax.fori_loop(0, pl.cdiv(depth, block_k), body, (zeros, zeros))
