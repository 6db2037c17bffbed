"""One dispatch point per hot op: the pure-jnp reference, or its Pallas kernel.

``kernel_backend``:
  reference  the jnp references (any platform)
  pallas     the Pallas GPU kernels
  interpret  the Pallas kernels in interpret mode: slow, for CPU tests of the kernel code
  auto       pallas on GPU, reference elsewhere
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from dsjax.parallel.collectives import axis_size
from dsjax.parallel.expert import ExpertDispatch, moe_expert_parallel
from dsjax.parallel.mesh import EXPERT
from pallas_kernels.mla_decode import mla_paged, mla_paged_pools_reference, mla_paged_reference
from pallas_kernels.mla_prefill import mla_prefill as mla_prefill_kernel
from pallas_kernels.mla_prefill import mla_prefill_reference
from pallas_kernels.moe_experts import moe_experts as moe_experts_kernel
from pallas_kernels.moe_experts import moe_experts_reference
from pallas_kernels.moe_routing import RoutingSpec, route, route_reference
from pallas_kernels.stacked_gemv import stacked_gemv, stacked_gemv_reference
from pallas_kernels.swiglu import swiglu as swiglu_kernel
from pallas_kernels.swiglu import swiglu_reference

KERNEL_BACKENDS = ("reference", "pallas", "interpret", "auto")


def resolve_backend(kernel_backend: str) -> str:
    """'auto' -> 'pallas' on GPU, else 'reference'; anything unknown is refused."""
    if kernel_backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend={kernel_backend!r} is not supported; accepted: "
                         + ", ".join(KERNEL_BACKENDS))
    if kernel_backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return kernel_backend


def swiglu(x, w_gate, w_up, backend: str):
    """x [T, D], w_gate/w_up [D, I] -> silu(x w_gate) * (x w_up) [T, I].

    On the GPU ("pallas") this stays with XLA: in the same H200 run XLA's fused GEMMs beat the Pallas
    kernel (582 vs 557 TFLOP/s at M=4096, benchmarks/results/moe_h200.json), and inside the layer scan
    XLA reads each layer's slice of the stacked weights in place while a kernel operand is copied.
    ``interpret`` still runs the kernel, so CPU tests keep covering it.
    """
    if backend in ("reference", "pallas"):
        return swiglu_reference(x, w_gate, w_up)
    return swiglu_kernel(x, w_gate, w_up, interpret=backend == "interpret")


# Batches up to this many tokens run a stacked MLP (dense layers, shared experts) through the grouped
# kernels, reading the layer's weights in place; larger ones through XLA's GEMMs. H200, V2-Lite decode
# (benchmarks/results/e2e_decode_curve_h200*.json): the kernels save 0.9 ms a step at batch 1 and 0.15
# at 32, but cost 0.1-0.7 ms from 64 on, where each of their row tiles re-reads the weights.
STACKED_MLP_MAX_TOKENS = 32
# Steps of up to this many tokens run the attention projections and a stacked MLP through the stacked
# GEMV kernel (pallas_kernels/stacked_gemv.py), reading the layer's weights in place: measured on the
# H200 at batch 1 and 16 (benchmarks/results/decode_profile.md, round 4). The kernel takes up to 64
# rows; `benchmarks/kernels_gemv.py` compares it with XLA's sliced GEMM at 16-64 rows.
STACKED_GEMV_MAX_TOKENS = 16


def stacked_mlp(x, w_gate, w_up, w_down, layer, backend: str):
    """x [T, D] through layer ``layer``'s SwiGLU MLP, given every layer's w_gate/w_up [L, D, I] and
    w_down [L, I, D] -> [T, D]: up to ``STACKED_GEMV_MAX_TOKENS`` tokens the stacked GEMV kernel, three times,
    else the routed-expert kernels with one expert, taken by every token at weight 1. In a layer scan
    XLA would copy the layer's slice for cuBLAS (about 60 MB a V2-Lite layer at decode sizes); the
    kernels read it in place and stay weight-bandwidth bound."""
    if backend == "reference":
        return jnp.dot(swiglu_reference(x, w_gate[layer], w_up[layer]), w_down[layer])
    if x.shape[0] <= STACKED_GEMV_MAX_TOKENS:  # three split-K GEMVs: 14.5 µs against 21.2 for the grouped pair
        # (H200, V2-Lite shared experts, one token: the grouped kernels run too few programs)
        gemv = partial(stacked_gemv, layer=layer, interpret=backend == "interpret")
        h = jax.nn.silu(gemv(x, w_gate)) * gemv(x, w_up)
        return gemv(h.astype(x.dtype), w_down).astype(x.dtype)
    ones, zeros = jnp.ones((x.shape[0], 1), jnp.float32), jnp.zeros((x.shape[0], 1), jnp.int32)
    return moe_experts_kernel(x, ones, zeros, w_gate[:, None], w_up[:, None], w_down[:, None], layer=layer,
                              interpret=backend == "interpret")




def stacked_matmul(x, w, layer, backend: str):
    """x [T, K] @ w[layer] for a stacked w [L, K, N] -> f32[T, N], the layer's slice read in place."""
    if backend == "reference":
        return stacked_gemv_reference(x, w, layer)
    return stacked_gemv(x, w, layer, interpret=backend == "interpret")


def moe_route(logits, bias, spec: RoutingSpec, backend: str):
    """logits f32[T, E], bias f32[E] | None -> (weights f32[T, k], ids i32[T, k])."""
    if backend == "reference":
        return route_reference(logits, bias, spec)
    return route(logits, bias, spec, interpret=backend == "interpret")


def moe_experts(x, weights, ids, w_gate, w_up, w_down, backend: str, layer=None,
                expert_dispatch: ExpertDispatch = ExpertDispatch()):
    """x [T, D] through experts ids i32[T, k] weighted by f32[T, k] -> [T, D].

    w_* are one layer's experts [E, ...], or with ``layer`` every layer's [L, E, ...] (the kernels then
    read that layer's in place instead of receiving a copied slice). Inside a shard_map over an
    'expert' axis of several ranks, w_* are this rank's experts and tokens travel to their owners
    (dsjax.parallel.expert); the same computation then runs per rank on the rows it received.
    """
    if axis_size(EXPERT) > 1:
        num_local_experts = w_gate.shape[0 if layer is None else 1]
        local = partial(_local_experts, w_gate=w_gate, w_up=w_up, w_down=w_down, backend=backend, layer=layer)
        return moe_expert_parallel(x, weights, ids, num_local_experts, local, expert_dispatch)
    return _local_experts(x, weights, ids, w_gate=w_gate, w_up=w_up, w_down=w_down, backend=backend, layer=layer)


def _local_experts(x, weights, ids, *, w_gate, w_up, w_down, backend: str, layer):
    if backend == "reference":
        if layer is not None:
            w_gate, w_up, w_down = (w[layer] for w in (w_gate, w_up, w_down))
        return moe_experts_reference(x, weights, ids, w_gate, w_up, w_down)
    return moe_experts_kernel(x, weights, ids, w_gate, w_up, w_down, layer=layer,
                              interpret=backend == "interpret")


def mla_paged_attention(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale, backend: str,
                        c_kv_scale=None, compressed=None, pools=None):
    """Absorbed MLA over the paged latent cache (8-bit c_kv with its c_kv_scale; or two pools, see
    ``mla_paged_pools_reference``); see ``mla_paged_reference`` for shapes."""
    if backend == "reference":
        if pools:
            return mla_paged_pools_reference(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale,
                                             compressed, pools)
        return mla_paged_reference(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale,
                                   c_kv_scale)
    return mla_paged(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale, c_kv_scale=c_kv_scale,
                     compressed=compressed, pools=pools, interpret=backend == "interpret")


def mla_prefill(q_nope, q_pe, k_nope, k_pe, v, scale, backend: str):
    """Expanded causal MLA attention; see ``mla_prefill_reference`` for shapes."""
    if backend == "reference":
        return mla_prefill_reference(q_nope, q_pe, k_nope, k_pe, v, scale)
    return mla_prefill_kernel(q_nope, q_pe, k_nope, k_pe, v, scale, interpret=backend == "interpret")
