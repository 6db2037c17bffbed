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

from dsjax.model.norms import rms_norm
from dsjax.parallel.collectives import axis_size
from dsjax.parallel.expert import ExpertDispatch, moe_expert_parallel
from dsjax.parallel.mesh import EXPERT
from pallas_kernels import moe_decode_mgpu
from pallas_kernels.latent_write import write_latents as write_latents_kernel
from pallas_kernels.latent_write import store_rows as store_rows_kernel
from pallas_kernels.latent_write import store_rows_reference, write_latents_reference
from pallas_kernels.mla_decode import mla_paged, mla_paged_pools_reference, mla_paged_reference
from pallas_kernels.mla_prefill import mla_prefill as mla_prefill_kernel
from pallas_kernels.mla_prefill import mla_prefill_reference
from pallas_kernels.moe_decode import DecodeTiles
from pallas_kernels.moe_decode import moe_decode as moe_decode_kernel
from pallas_kernels.moe_decode import moe_decode_reference
from pallas_kernels.moe_experts import moe_experts as moe_experts_kernel
from pallas_kernels.moe_experts import moe_experts_reference
from pallas_kernels.moe_routing import NormRows, RoutingSpec, route, route_norm_reference, route_reference
from pallas_kernels.stacked_gemv import (stacked_gemv_reference, stacked_gemvs, stacked_head_gemv,
                                         stacked_head_gemv_reference)
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


def compiler_options(kernel_backend: str) -> dict | None:
    """XLA options for a program of this backend. Interpret-mode kernels unroll into large CPU programs:
    at -O1 they compile about as fast as at -O0 (~1.5x faster than at the default -O2) and run as fast
    as at -O2 (-O0's code ran an interpret engine's steps ~4x slower)."""
    return {"xla_backend_optimization_level": 1} if kernel_backend == "interpret" else None


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


# Steps of up to this many tokens run the attention projections and a stacked MLP (dense layers, shared
# experts) through the stacked GEMV kernel (pallas_kernels/stacked_gemv.py), reading the layer's weights
# in place; larger ones through XLA's GEMMs, which copy the layer's slice for cuBLAS. H200, V2-Lite shapes
# (benchmarks/results/gemv_h200.json, `benchmarks/kernels_gemv.py`): q_proj 5.0/6.9/10.0 µs at 1/32/64
# rows against 12.1/14.4/15.3 for XLA's sliced GEMM; the kernel takes at most 64 rows.
STACKED_GEMV_MAX_TOKENS = 64


# Steps of up to this many tokens fold MLA's W_UK into write_latents (the absorbed queries). Its programs
# are per token, so each token reads the heads' slices again (from L2), where the stacked per-head GEMV
# reads them once for all rows: a launch saved against ~1 MB more L2 traffic a token. H200, V2-Lite
# (decode_profile.md round 10): write_latents with W_UK 4.0 µs a layer against 2.7 + 2.4 for the two
# launches. (W_UV in the attention's split merge, the same move on the output side, took 23.6 µs
# against 12.6 for the merge, then the per-head GEMV, and was removed.)
QUERY_FOLD_MAX_TOKENS = 8


def stacked_mlp(x, w_gate, w_up, w_down, layer, backend: str):
    """x [T, D] (T <= ``STACKED_GEMV_MAX_TOKENS``) through layer ``layer``'s SwiGLU MLP, given every
    layer's w_gate/w_up [L, D, I] and w_down [L, I, D] -> [T, D]: split-K GEMVs on the stack in place,
    gate and up in one launch (V2-Lite shared experts at one token: 14.4 µs against 21.2 for the
    grouped expert kernels with one expert, which run too few programs)."""
    gate, up = stacked_matmuls(x, (w_gate, w_up), layer, backend)
    return stacked_swiglu_down(gate, up, w_down, layer, backend, x.dtype)


# One-token steps on Hopper run a dense layer's MLP (V2-Lite's layer 0: 134 MB, intermediate 10944) through the
# TMA-fed expert launch (pallas_kernels/moe_decode_mgpu.py) as the one expert of its stack, weight 1: every CTA
# streams 64 of its intermediate columns' gate / up / down and no launch waits for another. Alone that launch reads
# V2-Lite's 139 MB MoE layer at 3.95 TB/s, where the stacked GEMVs (norm + gate / up, then down: two launches and
# the silu between) read the dense MLP at ~3.3 TB/s in the batch-1 step, 41.2 µs (decode_profile.md round 32).
# Read at trace time. In the batch-1 compiled step (round 33, step_ab_round33_b1_h200.json): 1.7110 vs 1.7303 ms.
DENSE_MLP_MGPU = True


def _expert_launch_takes(x, w_gate, shared_inter: int) -> bool:
    """Whether the TMA-fed expert launch (``moe_decode_mgpu``) takes x [T, D] over experts whose last two
    dimensions of w_gate are [D, I] (shared experts of ``shared_inter`` columns, 0 for none)."""
    hidden, inter = w_gate.shape[-2:]
    return (moe_decode_mgpu.supports(hidden, inter, shared_inter, x.shape[0], w_gate.dtype) is None
            and x.dtype == w_gate.dtype)


def dense_mlp_mgpu_takes(x, w_gate, backend: str) -> bool:
    """Whether ``dense_mlp_decode`` runs the dense MLP of x [T, D] (w_gate [L, D, I]) through the expert launch."""
    return DENSE_MLP_MGPU and backend == "pallas" and _expert_launch_takes(x, w_gate, 0)


def dense_mlp_decode(normed, w_gate, w_up, w_down, layer, residual=None, in_place: bool = False, pdl: bool = False):
    """``normed`` [1, D] (a token after the layer's RMSNorm) through layer ``layer`` of the dense MLP stacks w_gate /
    w_up [L, D, I], w_down [L, I, D] by the expert launch, the MLP as expert 0 of a one-expert stack (a free
    reshape), plus ``residual`` in f32 before the rounding -> [1, D]; with ``in_place`` the launch adds into the
    residual itself and the sum comes back in f32, unrounded (``moe_decode_mgpu(in_place=True)``); with ``pdl`` it
    is launched as a programmatic dependent of the launch before it (its routing is constants here)."""
    one = lambda w: w[:, None]  # [L, 1, ...]
    return moe_decode_mgpu.moe_decode_mgpu(normed, jnp.ones((1, 1), jnp.float32),
                                           jnp.zeros((1, 1), jnp.int32), one(w_gate), one(w_up), one(w_down),
                                           layer, residual=residual, in_place=in_place, pdl=pdl)


def stacked_swiglu_down(gate, up, w_down, layer, backend: str, dtype):
    """silu(gate) * up (f32 [T, I] products) through layer ``layer``'s stacked w_down [L, I, D] -> [T, D]."""
    h = (jax.nn.silu(gate) * up).astype(dtype)
    return stacked_matmuls(h, (w_down,), layer, backend)[0].astype(dtype)


def stacked_matmuls(x, ws, layer, backend: str, norm=None, partials: bool = False):
    """x [T, K] @ w[layer] for each stacked w [L, K, N_i] of ``ws`` -> tuple of f32[T, N_i], each layer's
    slice read in place, one kernel launch for all. ``norm`` = (every layer's RMSNorm weights [L, K], eps):
    x is normalized first (inside the kernel) and the normed rows [T, K] come back last.

    ``partials`` (with ``norm``): the products of x * g unsummed over the kernel's S K-splits, f32[S * T,
    N_i] each, then the rows' partial sums of squares f32[S * T]: for ``write_latents`` to finish (the
    reference: one split)."""
    if partials and norm is None:
        raise ValueError("stacked_matmuls: partials=True comes with the norm's sums of squares; give norm")
    if backend == "reference":
        if partials:
            scaled = (x * norm[0][layer]).astype(x.dtype)
            x32 = x.astype(jnp.float32)
            return tuple(stacked_gemv_reference(scaled, w, layer) for w in ws) + (jnp.sum(x32 * x32, axis=-1),)
        if norm is not None:
            x = rms_norm(x, norm[0][layer], norm[1])
        return tuple(stacked_gemv_reference(x, w, layer) for w in ws) + ((x,) if norm is not None else ())
    weights, eps = norm if norm is not None else (None, None)
    return stacked_gemvs(x, ws, layer, weights, eps=eps, partials=partials, interpret=backend == "interpret")


def stacked_head_matmul(x, w, layer, backend: str, *, contract_rows: bool, out_dtype=jnp.float32):
    """Per-head products with layer ``layer`` of a stacked per-head w [L, R, H, C], read in place (MLA's
    absorbed w_uk / w_uv at decode sizes), in ``out_dtype``; see
    ``pallas_kernels.stacked_gemv.stacked_head_gemv``."""
    if backend == "reference":
        return stacked_head_gemv_reference(x, w, layer, contract_rows=contract_rows).astype(out_dtype)
    return stacked_head_gemv(x, w, layer, contract_rows=contract_rows, out_dtype=jnp.dtype(out_dtype),
                             interpret=backend == "interpret")


# Steps of up to this many tokens run a MoE layer's routed and shared experts in one launch
# (pallas_kernels/moe_decode.py) when the experts are local (no expert axis): at batch 1 the grouped
# path's sort, grouped SwiGLU, down projection, weighting and shared-expert GEMVs cost a launch each.
# H200, V2-Lite layer (benchmarks/kernels_gemv.py, moe_one_launch): 41.1 µs against 51.1 for the grouped
# path at one token, 63.6 against 76.3 at two (the second token's weights come from L2 or are its own).
MOE_DECODE_MAX_TOKENS = 2
# Its tiles (pallas_kernels.moe_decode.DecodeTiles: the H200 sweep's best).
MOE_DECODE_TILES = DecodeTiles()
# One-launch MoE steps (above): the router's split-K partials summed with the rows' squares in one XLA
# reduction and the RMSNorm finished in the routing kernel (logits x 1 / rms, the normed rows), instead
# of XLA's two sums and two scalings (decode_profile.md rounds 12 and 15). H200, V2-Lite batch-1
# compiled step (results/step_ab_folds_b1_h200.json, three rounds in turns): 2.240 ms against 2.274;
# batch 2: 2.856 against 2.876.
ROUTER_NORM_IN_ROUTE = True
# Programs a token block of that routing launch that write the normed rows beside the routing program (0:
# the routing program writes them itself, after their loads; round 15 measured moe_route_norm at 3.4 µs
# a layer against 2.1 for the routing alone). H200, V2-Lite compiled step (round 16,
# results/step_ab_round16_b{1,2}_h200.json, 3 rounds in turns): batch 1 2.197 ms against 2.221 with 0,
# 2.198 with 16; batch 2 2.783 against 2.809 (16: 2.784).
ROUTE_ROWS_PROGRAMS = 4
# One-launch steps of up to this many tokens (0: none) have the layer's residual added to the experts'
# sum by each token's first program, instead of XLA's add after the sum (round 12's launch 18). H200,
# V2-Lite compiled step (results/step_ab_residual_b{1,2}_h200.json, 3 rounds in turns): batch 1 2.214
# ms against 2.236; batch 2 2.846 against 2.841 (no gain), so one token only. The residual as one more
# partial concatenated before the sum lost 39 µs a step (session 29, step_ab_folds_b1_h200.json).
MOE_DECODE_RESIDUAL_MAX_TOKENS = 1
# One-token steps on Hopper through the TMA-fed Mosaic GPU launch (pallas_kernels/moe_decode_mgpu.py)
# instead of the Triton one, where it takes the layer (its ``supports``). V2-Lite's layer alone 35.1 µs
# against 38.8-39.2 (moe_mgpu_transposed_h200.json); the batch-1 compiled step 2.150 / 2.156 ms against
# 2.196 / 2.198 in two calls (session 33's build, step_ab_moe_mgpu_b1_h200.json, 3 rounds in turns), 2.131
# with the products transposed (step_ab_moe_transposed_b1_h200.json; decode_profile.md rounds 19-20).
MOE_DECODE_MGPU = True
# One-token steps on Hopper: the whole MoE stack (attention, o_proj, MoE half of every layer) as one persistent
# kernel (pallas_kernels/decode_step_moe.moe_layer_chain; DeepseekForCausalLM.step_kernel_blocker says where).
# Once its code fit the SM's instruction cache (decode_profile.md round 26: the token's tiles written through a
# flat view, box issues and the top-k in loops), the whole layer runs 69.7-72.1 µs over 8 of V2-Lite's layers
# against ~77 µs of launches a layer, and the batch-1 compiled step takes 1.972 ms against 2.130 with this off
# (step_ab_step_kernel_b1_h200.json, 3 rounds in turns; its in-model GPU tests pass). The runner readies the
# weights on Hopper either way (DeepseekForCausalLM.prepare_step_kernel: the same values), so an A/B may flip
# this knob.
STEP_KERNEL = True
# A folder for the step kernel's per-scope trace (Mosaic GPU's profiler, ``profile_dir``), or None. The first call
# writes a Perfetto JSON of every CTA's scopes, as many as its shared-memory buffer holds (the first ~7 layers;
# later calls find the kernel's file name taken and write none); tracing slows the scopes ~2x. A diagnostic of
# the kernel as the engine runs it (``step_profile --kernel-trace``), read at trace time.
STEP_KERNEL_TRACE: str | None = None
# With the step kernel, a one-token step also runs the dense layer's attention half as one persistent kernel
# (``decode_step_attention.attention_chain``, one layer, its cache after the MoE stack's) in place of its ~7 launches
# (norm + q / kv_a, the latent's write, decode + combine, W_UV, o_proj and the residual's adds: 24.9 µs of work and
# ~2.4 µs at each launch's boundary in decode_profile.md round 34), its new cache row stored with the stack's in one
# launch; the kernel's CTA 0 also norms its output for the MLP (``attention_chain(out_norm=...)``), which the expert
# launch then takes (two launches fewer). Models with one dense layer (V2-Lite, V2). With the four knobs below it
# the batch-1 compiled step took 1.7034 ms against 1.7342 (decode_profile.md round 35, step_ab_round35_b1_h200.json;
# its GPU tests pass); the engine's batch-1 token rate stayed within one process's swing of round 34's (586 tok/s,
# round 36), its device work ~17 µs a step less in 16 ops instead of 26. Read at trace time.
STEP_KERNEL_DENSE_ATTENTION = True
# With the step kernel, the model's final RMSNorm runs in the kernel's tail (CTA 0 after the last layer,
# ``moe_layer_chain(final_norm=...)``) instead of as XLA's reduce and scale after it: two launches fewer
# (input_reduce_fusion + loop_multiply_fusion, 3.2 µs of work and their boundaries in decode_profile.md round 34).
# Timed with the other kernel knobs (round 35). Read at trace time.
STEP_KERNEL_FINAL_NORM = True
# With STEP_KERNEL_DENSE_ATTENTION and the dense MLP by the expert launch: the attention kernel's CTA 0 writes its
# output rounded to bf16 in f32, the expert launch's CTAs add their partial rows into that buffer by TMA
# (``moe_decode_mgpu(in_place=True)``), and the step kernel takes the unrounded f32 sum (it rounds what it reads):
# no XLA reduce of the 171 partial rows, residual add and conversions between the launches (round 34's
# input_reduce_fusion / loop_add_fusion / loop_convert_fusion around layer 0's MLP). Timed with the other kernel
# knobs (round 35). Read at trace time.
DENSE_MLP_IN_PLACE = True
# With STEP_KERNEL_DENSE_ATTENTION: the dense attention kernel reads the token's row of the embedding table itself
# (``attention_chain(embedding=...)``; every CTA, from L2) instead of taking the row XLA gathered before it (round
# 34's loop_select_fusion, the lookup with its bounds check: 1.4 µs plus its boundary). Timed with the other
# kernel knobs (round 35). Read at trace time.
STEP_KERNEL_EMBEDDING = True
# With STEP_KERNEL_DENSE_ATTENTION, its kernel, the dense MLP's expert launch and the step kernel run as programmatic
# dependent launches (PDL): the attention kernel lets the expert launch be set up at once
# (``griddepcontrol.launch_dependents``), the expert launch loads its first weight boxes and lets the step kernel be
# set up before it waits for the attention kernel's writes (``griddepcontrol.wait``), and the step kernel waits
# first thing. The step kernel's bucket runs without CUDA graphs (runner.STEP_KERNEL_GRAPHS off), where PDL
# measured 9.0 -> 4.4 µs a 2 MB kernel in a chain (decode_profile.md, "Programmatic dependent launch": inside XLA's
# graphs it changed nothing). Built and CPU-tested (its GPU tests pass), but the batch-1 compiled step took 1.7186
# ms with it against 1.7034 without (round 35, one round): off. Read at trace time.
STEP_KERNEL_PDL = False


def moe_decode(x, weights, ids, experts, shared, layer, backend: str, residual=None):
    """x [T, D] (T <= ``MOE_DECODE_MAX_TOKENS``) through its routed experts (weights / ids [T, k]) and
    the shared experts, one layer of the stacks ``experts`` (w_gate, w_up [L, E, D, I], w_down [L, E, I, D])
    and ``shared`` ((w_gate, w_up [L, D, S], w_down [L, S, D]) or None) read in place -> [T, D]; plus
    ``residual`` [T, D] in f32 before the sum's rounding to x's dtype when given."""
    if backend == "reference":
        return moe_decode_reference(x, weights, ids, *experts, layer, shared, residual)
    if MOE_DECODE_MGPU and backend == "pallas" and _expert_launch_takes(
            x, experts[0], 0 if shared is None else shared[0].shape[-1]):
        return moe_decode_mgpu.moe_decode_mgpu(x, weights, ids, *experts, layer, shared, residual)
    return moe_decode_kernel(x, weights, ids, *experts, layer, shared, residual, tiles=MOE_DECODE_TILES,
                             interpret=backend == "interpret")


def moe_route(logits, bias, spec: RoutingSpec, backend: str, norm_rows: NormRows | None = None,
              norm_eps: float | None = None):
    """logits f32[T, E], bias f32[E] | None -> (weights f32[T, k], ids i32[T, k]). With ``norm_rows``
    and ``norm_eps`` the MoE sublayer's RMSNorm finishes here: logits f32[T, E + 1] (the products of
    x * g, then the rows' sums of squares) -> (weights, ids, normed rows [T, D]); see ``route``."""
    if backend == "reference":
        if norm_rows is not None:
            return route_norm_reference(logits, bias, spec, norm_rows, norm_eps)
        return route_reference(logits, bias, spec)
    # rows programs split the rows' columns evenly; a width they do not divide keeps them in the routing program
    splits = ROUTE_ROWS_PROGRAMS and norm_rows is not None and norm_rows.x.shape[-1] % ROUTE_ROWS_PROGRAMS == 0
    return route(logits, bias, spec, norm_rows=norm_rows, norm_eps=norm_eps,
                 rows_programs=ROUTE_ROWS_PROGRAMS if splits else 0, interpret=backend == "interpret")


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


def write_latents(c_kv, k_pe, kv, slots, positions, layer, norm, norm_index, backend: str, **rope_and_norm):
    """kv_a_proj's output f32[T, C + R] into the unquantized cache pools c_kv [L, N, bs, C] / k_pe
    [L, N, bs, R] at layer ``layer``: kv_a_norm (weights norm[norm_index]) and rope applied, padding
    slots dropped; see ``pallas_kernels.latent_write.write_latents``. -> (c_kv, k_pe). Given split-K
    partials (``stacked_matmuls(..., partials=True)``: squares, row_rms) it adds them itself, and with
    q / q_heads also returns the queries (q_nope, or with w_uk the absorbed q_latent; q_pe rotated)."""
    if backend == "reference":
        return write_latents_reference(c_kv, k_pe, kv, slots, positions, layer, norm, norm_index, **rope_and_norm)
    return write_latents_kernel(c_kv, k_pe, kv, slots, positions, layer, norm, norm_index,
                                interpret=backend == "interpret", **rope_and_norm)


def store_rows(c_kv, k_pe, rows, slot, backend: str):
    """rows [L, C + R] (each layer's normed latent and rotated rope key; or a tuple of such arrays, consecutive
    layers) into the unquantized pools c_kv [L', N, bs, C] / k_pe [L', N, bs, R] at ``slot`` of layers 0..L-1, a
    slot outside the pools dropped;
    see ``pallas_kernels.latent_write.store_rows``: one launch in place of XLA's bounds-checked scatter (its ~6
    small fusions), the batch-1 compiled step 1.7583 ms against 1.7640 (H200, in turns; decode_profile.md round
    31). -> (c_kv, k_pe)."""
    if backend == "reference":
        return store_rows_reference(c_kv, k_pe, rows, slot)
    return store_rows_kernel(c_kv, k_pe, rows, slot, interpret=backend == "interpret")


def mla_paged_attention(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale, backend: str,
                        c_kv_scale=None, compressed=None, pools=None, layer=None, layer_pages=None):
    """Absorbed MLA over the paged latent cache (8-bit c_kv with its c_kv_scale; or two pools, see
    ``mla_paged_pools_reference``); see ``mla_paged_reference`` for shapes. With ``layer_pages`` (one
    pool) c_kv / k_pe hold every layer's pages and the tables layer ``layer``'s page ids."""
    if backend == "reference":
        if pools:
            return mla_paged_pools_reference(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale,
                                             compressed, pools)
        if layer_pages:
            block_tables = block_tables + layer * layer_pages
        return mla_paged_reference(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale,
                                   c_kv_scale)
    return mla_paged(q_latent, q_pe, c_kv, k_pe, block_tables, seq_ids, positions, scale, c_kv_scale=c_kv_scale,
                     compressed=compressed, pools=pools, layer=layer, layer_pages=layer_pages,
                     interpret=backend == "interpret")


def mla_prefill(q_nope, q_pe, k_nope, k_pe, v, scale, backend: str):
    """Expanded causal MLA attention; see ``mla_prefill_reference`` for shapes."""
    if backend == "reference":
        return mla_prefill_reference(q_nope, q_pe, k_nope, k_pe, v, scale)
    return mla_prefill_kernel(q_nope, q_pe, k_nope, k_pe, v, scale, interpret=backend == "interpret")
