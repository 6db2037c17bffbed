"""A DeepSeekMoE layer's experts for a decode step of one or two tokens, in one launch.

At batch 1 the MoE layer is a weight stream of ~8 experts (V2-Lite: top-6 routed + 2 shared experts'
worth, 139 MB a layer), and the grouped path spends its time between kernels: sort, grouped SwiGLU,
grouped down projection, weighting, the shared experts' own GEMVs, each a launch of a few µs
(benchmarks/results/decode_profile.md, round 5). Here one program owns one (token, expert slot,
intermediate tile): it streams the tile's gate and up columns over the whole hidden size, forms
silu(gate) * up times the routing weight, and multiplies that straight into the tile's rows of the
down projection, storing a partial [D] output. The shared experts ride along as extra programs of
weight 1 on their own stacked weights. Partials (a few MB at most) are summed by XLA.

Every weight is read in place from the layer stacks ([L, E, ...] routed, [L, ...] shared) with a
traced layer index, as the grouped kernels do. A token's rows are zero-padded to 16 (Triton's
smallest dot); weights shared by two tokens are read twice (from L2 when concurrent), which is why
the engine keeps this for the smallest steps (``dsjax.model.dispatch.MOE_DECODE_MAX_TOKENS``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import dot_precision
from pallas_kernels.moe_experts import moe_experts_reference
from pallas_kernels.swiglu import swiglu_reference

MAX_TOKENS = 8  # tokens a call takes: each is its own set of programs


class DecodeTiles(NamedTuple):
    """H200, V2-Lite layer (2026-12-01, kernels_gemv.moe_one_launch): these take 41.2 µs at one token
    (3.36 TB/s of the 139 MB read) and 65.1 at two; 32-column programs 44.8, 128-column 47.4, 8 warps
    40.5 (within the runs' noise). Persistent programs taking narrow tiles in turn (132 or 264 of them,
    16-32 columns) were slower at every config: 48-106 µs, and so were shared-expert tiles of their own
    width at two tokens (decode_profile.md round 10); and so were the products as multiply-adds on the
    CUDA cores instead of dots of the token padded to 16 rows: 65-126 µs (round 14, code in git 75b3671).
    In the compiled batch-1 step (round 14) 8 warps cost 2.409 ms and 256-row K steps 2.503, against 2.309.
    Programs matched to the SMs through spans narrower than the tile (128 programs of 88 columns in
    128-wide masked tiles, 256 of 44 in 64-wide ones, deeper pipelines) took 52-77 µs at one token
    (round 16, code in git 58ca6d0). Extra programs reading the next layer's attention projections into L2
    (evict-last, the experts' loads evict-first or not) cost 2.388 ms against 2.226 (round 18, code in git
    c60109f): staged lines survive only ~20 MB of later traffic."""
    block_i: int = 64  # intermediate columns a program owns
    block_k: int = 128  # hidden rows a gate/up step streams
    block_d: int = 128  # output columns a down step produces
    num_warps: int = 4
    num_stages: int = 3


def _expert_tile(x_ref, wg, wu, wd, prefix, token, i0, scale, out_ref, program, *, hidden, inter, tiles,
                 residual_ref=None, adds_residual=False):
    """x_ref[token] through columns [i0, i0 + block_i) of one expert (wg / wu [..., D, I] and wd
    [..., I, D] refs, the expert's leading indices ``prefix``), times ``scale``, into out_ref[program];
    plus residual_ref[token] where ``adds_residual`` (a traced bool) holds."""
    block_i, block_k, block_d = tiles.block_i, tiles.block_k, tiles.block_d
    col_ok = i0 + jnp.arange(block_i) < inter
    first_row = (jnp.arange(16) == 0)[:, None]
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=dot_precision(x_ref.dtype))

    def gate_up(i, carry):
        acc_g, acc_u = carry
        k0 = pl.multiple_of(i * block_k, block_k)
        k_ok = k0 + jnp.arange(block_k) < hidden
        x = plgpu.load(x_ref.at[token, pl.ds(k0, block_k)], mask=k_ok, other=0)
        x = jnp.where(first_row, x[None, :], 0).astype(x.dtype)  # [16, block_k]: the token in row 0
        mask = k_ok[:, None] & col_ok[None, :]
        at = (*prefix, pl.ds(k0, block_k), pl.ds(i0, block_i))
        g = plgpu.load(wg.at[at], mask=mask, other=0)
        u = plgpu.load(wu.at[at], mask=mask, other=0)
        return acc_g + dot(x, g), acc_u + dot(x, u)

    zeros = jnp.zeros((16, block_i), jnp.float32)
    acc_g, acc_u = jax.lax.fori_loop(0, pl.cdiv(hidden, block_k), gate_up, (zeros, zeros))
    h = (jax.nn.silu(acc_g) * acc_u * scale).astype(x_ref.dtype)  # [16, block_i], row 0 real

    def down(j, carry):
        d0 = pl.multiple_of(j * block_d, block_d)
        d_ok = d0 + jnp.arange(block_d) < hidden
        w = plgpu.load(wd.at[(*prefix, pl.ds(i0, block_i), pl.ds(d0, block_d))],
                       mask=col_ok[:, None] & d_ok[None, :], other=0)
        y = jnp.sum(jnp.where(first_row, dot(h, w), 0.0), axis=0)  # [block_d]: row 0 of the [16, block_d] dot
        if residual_ref is not None:  # one program a token: its load is predicated off in the others
            r = plgpu.load(residual_ref.at[token, pl.ds(d0, block_d)], mask=d_ok & adds_residual, other=0)
            y = y + r.astype(jnp.float32)
        plgpu.store(out_ref.at[program, pl.ds(d0, block_d)], y, mask=d_ok)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(hidden, block_d), down, 0)


def _decode_kernel(layer_ref, ids_ref, weights_ref, x_ref, wg_ref, wu_ref, wd_ref, *refs, top_k, num_experts,
                   routed_tiles, shared_tiles, hidden, inter, shared_inter, tiles, with_residual):
    # refs: (shared wg [L, D, S], wu, wd [L, S, D]) when shared_tiles, (residual [T, D]) when
    # with_residual, then out f32[T * P, D].
    out_ref = refs[-1]
    residual_ref = refs[-2] if with_residual else None
    program, layer = pl.program_id(0), layer_ref[0]
    per_token = top_k * routed_tiles + shared_tiles
    token, local = program // per_token, program % per_token
    # a token's first program adds its residual row to its partial
    tile = functools.partial(_expert_tile, x_ref, token=token, out_ref=out_ref, program=program, hidden=hidden,
                             tiles=tiles, residual_ref=residual_ref, adds_residual=local == 0)

    @pl.when(local < top_k * routed_tiles)
    def _():
        slot = token * top_k + local // routed_tiles
        expert = ids_ref[slot]
        # An empty slot (id E: expert parallelism's padding) contributes nothing: weight 0 on expert E - 1.
        scale = jnp.where(expert < num_experts, weights_ref[slot], 0.0)
        tile(wg_ref, wu_ref, wd_ref, (layer, jnp.minimum(expert, num_experts - 1)),
             i0=(local % routed_tiles) * tiles.block_i, scale=scale, inter=inter)

    if shared_tiles:
        @pl.when(local >= top_k * routed_tiles)
        def _():
            tile(*refs[:3], (layer,), i0=(local - top_k * routed_tiles) * tiles.block_i, scale=1.0,
                 inter=shared_inter)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def moe_decode(x, weights, ids, w_gate, w_up, w_down, layer, shared=None, residual=None, *,
               tiles: DecodeTiles = DecodeTiles(), interpret: bool = False):
    """x [T, D] (T <= ``MAX_TOKENS``), weights f32[T, k], ids i32[T, k] (E marks an empty slot), every
    layer's routed experts w_gate / w_up [L, E, D, I] and w_down [L, E, I, D], a (traced) layer index,
    and optionally the shared experts (w_gate, w_up [L, D, S], w_down [L, S, D]) -> [T, D]: the routed
    experts' weighted sum plus the shared experts' MLP, as ``moe_decode_reference``.

    ``residual`` [T, D]: added in f32 by each token's first program to its partial, so the sum, rounded
    once to x's dtype, includes it (the layer's residual add without a launch of its own)."""
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w_gate.shape[1:]
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise ValueError(f"moe_decode: x has {num_tokens} tokens; accepted 1 to {MAX_TOKENS} (decode steps)")
    if x.shape != (num_tokens, hidden) or w_down.shape[1:] != (num_experts, inter, hidden):
        raise ValueError(f"moe_decode: x {x.shape}, w_gate {w_gate.shape}, w_down {w_down.shape} do not match; "
                         "expected x [T, D], w_gate [L, E, D, I], w_down [L, E, I, D]")
    routed_tiles = pl.cdiv(inter, tiles.block_i)
    shared_inter = 0 if shared is None else shared[0].shape[-1]
    shared_tiles = pl.cdiv(shared_inter, tiles.block_i)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"moe_decode: residual {residual.shape}; expected x's shape {x.shape}")
    per_token = top_k * routed_tiles + shared_tiles
    kernel = functools.partial(_decode_kernel, top_k=top_k, num_experts=num_experts, routed_tiles=routed_tiles,
                               shared_tiles=shared_tiles, hidden=hidden, inter=inter, shared_inter=shared_inter,
                               tiles=tiles, with_residual=residual is not None)
    partials = pl.pallas_call(
        kernel,
        grid=(num_tokens * per_token,),
        out_shape=jax.ShapeDtypeStruct((num_tokens * per_token, hidden), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="moe_decode",
    )(jnp.asarray(layer, jnp.int32).reshape(1), ids.reshape(-1).astype(jnp.int32),
      weights.reshape(-1).astype(jnp.float32), x, w_gate, w_up, w_down, *(shared or ()),
      *(() if residual is None else (residual,)))
    return partials.reshape(num_tokens, per_token, hidden).sum(axis=1).astype(x.dtype)


def moe_decode_reference(x, weights, ids, w_gate, w_up, w_down, layer, shared=None, residual=None):
    out = moe_experts_reference(x, weights, ids, w_gate[layer], w_up[layer], w_down[layer]).astype(jnp.float32)
    if shared is not None:
        w_gate_s, w_up_s, w_down_s = (w[layer] for w in shared)
        out = out + jnp.dot(swiglu_reference(x, w_gate_s, w_up_s), w_down_s, preferred_element_type=jnp.float32)
    if residual is not None:
        out = out + residual.astype(jnp.float32)
    return out.astype(x.dtype)
