"""The step kernel's expert phase and the MoE half of a decoder layer, as chains over layers in one
persistent Mosaic GPU kernel (the machinery: ``decode_step_mgpu``; the plan: ``docs/decode_step_kernel.md``).

``moe_chain`` is the expert phase, x_{l+1} = x_l + layer l's experts of x_l, in the GEMV chain's form (a
producer warpgroup streaming 16 KiB boxes through a ring, wgmma products, TMA adds, a grid barrier a layer):
36.9 µs a layer against 43.2 for ``moe_decode_mgpu`` a layer (8 layers, round 23). How a layer's tiles are
dealt to the CTAs is ``expert_plan``'s (``EXPERT_PLAN``). ``moe_block_chain`` is the MoE half of a layer,
x_{l+1} = x_l + experts(RMSNorm(x_l)), with the norm, the router's products (its weights as boxes in the
ring) and the routing (by each CTA's producer) in the kernel: 40.8 µs a layer. ``moe_layer_tail_chain``
puts o_proj in front: 46.6 µs a layer (``bash benchmarks/run_h200.sh step-phases``, ``step-block``;
decode_profile.md round 23). ``moe_layer_chain`` puts the attention phases (``decode_step_attention``) in
front of that: whole decoder layers at one token in one kernel, the engine's one-token steps' MoE stack
with ``dispatch.STEP_KERNEL``: 69.7-72.1 µs a layer, against ~77 for the launches a layer. Its code has to
fit an SM's instruction cache: at 190 KB of machine code (round 25's build) every phase refetched its
instructions each layer and the whole layer took 82-86 µs (decode_profile.md rounds 25-26).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import rms_norm, why_not_hopper
from pallas_kernels.decode_step_attention import (AttentionRefs, AttentionScratch, attention_layer_reference,
                                                  attention_operands, attention_phases)
from pallas_kernels.decode_step_mgpu import (HALF, RING, STEP, TOKEN_N, UNIT_K, _TILING, _arrive_and_wait,
                                             _input_tiles, _issue_box, _norm_tiles, _release, _round_rows, _unit_boxes,
                                             _unit_store, _zero_rows, norm_rows_out, num_sms, proxy_fence,
                                             stores_done, token_tiles)


def moe_supports(hidden: int, inter: int, shared_inter: int, num_layers: int, dtype, *, router: bool = False,
                 num_experts: int = HALF, top_k: int = 1, attention: int = 0) -> str | None:
    """None when ``moe_chain`` (``router``: ``moe_block_chain``, with ``num_experts`` and ``top_k``; and
    ``attention`` A > 0: ``moe_layer_tail_chain``) takes the layers, else why not."""
    if why_not := why_not_hopper():
        return why_not
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return f"weights in {jnp.dtype(dtype).name} (this kernel takes bfloat16)"
    for name, size, block in (("hidden", hidden, 8 * HALF), ("moe intermediate", inter, HALF),
                              ("shared intermediate", shared_inter, HALF)):
        if size % block:
            return f"{name} size {size} is not a multiple of {block}"
    if hidden // HALF > 256:
        return f"hidden size {hidden} is over {256 * HALF} (one TMA box of its rows)"
    if num_layers < 1:
        return f"{num_layers} layers (at least 1)"
    if router and num_experts != HALF:
        return f"{num_experts} routed experts (the in-kernel router takes {HALF})"
    if router and not 1 <= top_k <= ROUTE_SLOTS:
        return f"top-{top_k} routing (the in-kernel router takes 1 to {ROUTE_SLOTS})"
    num_tiles = top_k * (inter // HALF) + shared_inter // HALF
    ctas = min(num_sms(), num_tiles)
    if router and hidden // STEP > ctas:
        return f"hidden size {hidden} needs {hidden // STEP} router CTAs (one a {STEP}-row K step)"
    if attention and not router:
        return "an o_proj phase (attention > 0) comes with the router"
    if attention % UNIT_K:
        return f"attention width {attention} is not a multiple of {UNIT_K} (o_proj's K ranges)"
    if (units := hidden // HALF * (attention // UNIT_K)) > ctas:
        return f"o_proj of {attention} x {hidden} needs {units} CTAs (this kernel runs {ctas})"
    splits = split_parts(num_tiles, ctas) if EXPERT_PLAN == "split" else 0
    if (need := _moe_smem_bytes(hidden, router, splits)) > 227 * 1024:
        return f"hidden size {hidden} needs {need} bytes of shared memory a CTA (at most {227 * 1024})"
    return None


ROUTE_SLOTS = 8  # the routing's ids and weights a layer, in shared memory (top-k at most this)


def _moe_scratch(hidden: int, dtype, router: bool = False, splits: int = 0, num_heads: int = 0) -> list:
    """The kernel's shared memory; ``num_heads`` > 0: the attention phases' too (``moe_layer_chain``), their
    buffers in a union with the tiles where their lifetimes allow."""
    rows = hidden // HALF
    f32, bf16 = jnp.float32, jnp.bfloat16
    compact = _compact_smem(router, num_heads > 0)
    tiles = [*token_tiles(rows, dtype)]  # the input's [8, 64] tiles, and the same bytes as flat rows
    front_scratch = []
    if num_heads:
        tiles += [
            (plgpu.SMEM((3 * HALF, HALF), bf16, transforms=_TILING),  # attention phase 3: the query windows
             plgpu.SMEM((HALF, HALF), bf16, transforms=_TILING)),  # P
            (plgpu.SMEM((32, HALF), f32), plgpu.SMEM((32, HALF), bf16),  # phase 2: the rope rows, rotated
             plgpu.SMEM((2, 32, HALF // 2), f32),  # cos, sin
             plgpu.SMEM((8, HALF), f32), plgpu.SMEM((8, HALF), f32), plgpu.SMEM((8, HALF), bf16))]  # the latent
        front_scratch = [] if compact else [
            plgpu.SMEM((rows, HALF), f32),  # the attention norm's weights
            plgpu.Barrier(num_barriers=1),  # landed
        ]
        front_scratch += [
            plgpu.SMEM((HALF,), bf16),  # a unit's absorbed query columns
            *([] if compact else [plgpu.SMEM((8, HALF), bf16)]),  # bf16 zeros
            plgpu.Barrier(num_arrivals=num_heads + 2, num_barriers=1),  # the rope rows landed
            plgpu.Barrier(num_arrivals=2, num_barriers=1),  # the new latent and its norm's weights landed
        ]
    router_scratch = [
        # the norm's weights (the next layer's fetched during this one; COMPACT_SMEM: the layer's attention
        # norm's and its router norm's in turn)
        plgpu.SMEM((rows, HALF), jnp.float32),
        *([] if compact else [plgpu.SMEM((HALF,), jnp.float32),  # the CTA's partial logits
                              plgpu.SMEM((2 * HALF,), jnp.float32)]),  # the layer's logits
        plgpu.SMEM((ROUTE_SLOTS,), jnp.int32),  # the chosen experts
        plgpu.SMEM((ROUTE_SLOTS,), jnp.float32),  # their weights
        plgpu.Barrier(num_barriers=1),  # the norm's weights landed
        plgpu.Barrier(num_barriers=1),  # the logits landed
        plgpu.Barrier(num_barriers=1),  # the routing is in shared memory (the producer's, for the computing one)
    ] if router else []
    return [
        plgpu.SMEM((RING, 2, HALF, HALF), dtype, transforms=_TILING),  # the ring of boxes
        plgpu.SMEM((rows, HALF), jnp.float32),  # the layer's input rows (f32)
        plgpu.RefUnion(*tiles),
        plgpu.RefUnion(*token_tiles(1, dtype)),  # h as the first row of an [8, 64] tile
        # h as a row (published, or fetched); COMPACT_SMEM: then the partial logits, then the logits
        plgpu.SMEM(((4 if compact else 1) * HALF,), jnp.float32),
        plgpu.SMEM((rows, HALF), jnp.float32),  # the CTA's partial output row
        # zeros for the output rows (COMPACT_SMEM: 4 rows, the same bytes as the bf16 zeros)
        plgpu.RefUnion(plgpu.SMEM((4, HALF), f32), plgpu.SMEM((8, HALF), bf16)) if compact
        else plgpu.SMEM((8, HALF), jnp.float32),
        # a split tile's partial gate and up sums, fetched (COMPACT_SMEM: then the published ones)
        plgpu.SMEM((max(splits, 1) + compact, 2, HALF), jnp.float32),
        *([] if compact else [plgpu.SMEM((2, HALF), jnp.float32)]),  # this CTA's K range's sums, published by TMA
        plgpu.Barrier(num_arrivals=2, num_barriers=RING),  # a box's two halves landed
        plgpu.Barrier(num_barriers=RING),  # a slot's products are done
        plgpu.Barrier(num_barriers=1),  # the input rows landed
        plgpu.Barrier(num_barriers=1),  # a fetched h landed
        *router_scratch,
        *front_scratch,
    ]


def _moe_smem_bytes(hidden: int, router: bool = False, splits: int = 0, num_heads: int = 0) -> int:
    return sum(math.prod(m.shape) * jnp.dtype(m.dtype).itemsize
               for m in _moe_scratch(hidden, jnp.bfloat16, router, splits, num_heads) if hasattr(m, "shape")) + 512


GATE_UP, DOWN = 0, 1  # the kinds of an expert plan's units
PLANS = ("tiles", "dealt", "split")
# How moe_chain deals the layer's units to its CTAs (read at trace time; ``expert_plan``). Measured at
# V2-Lite's 176 tiles, 8 layers (round 23): the expert phase 43.7 µs a layer whole ("tiles"), 38.1 "dealt",
# 36.9 "split"; the MoE half 47.4, 43.1 and 40.8; the layer tail (o_proj in front) 47.8 dealt, 46.6 split.
EXPERT_PLAN = "split"
# A diagnostic (round 41, timing only, the values wrong): the producer computes each layer's picks, then takes
# experts 0 .. k - 1 instead (the same work), so that a probe which deletes work (``PROBE_NO_WAIT``,
# ``decode_step_attention.PROBE_PHASE_CUT``) cannot change which experts, and how many bytes, a layer reads.
PROBE_FIXED_ROUTING = False
# The producer picks a layer's experts by rank (``_rank_picks``: each thread counts the experts ahead of its
# own, the picks come out of ceil(k / 5) packed sums); the computing warpgroup weighs them (``route_weights``),
# off the routed boxes' path. H200, batch-1 compiled step (decode_profile.md round 30): 1.7443 ms against
# 1.7648 with the producer's k rounds of a max and an arg-min then the weights (2 + 2k cross-warp reductions
# before the routed boxes; code at 18c18c3, with ROUTE_KNOCKOUT, which measured the routing's hold on them).
# The routing's sums as loops of scalar shared-memory loads instead of cross-warp reductions (326 ops fewer)
# were slower: 1.7876 ms against 1.7294 (round 30, code at d5793ab).
_ID_BITS = 6  # an expert id in a packed sum (the in-kernel router takes 64 experts)
# The whole layers' kernel in less shared memory: its attention norm's weights and its router norm's share one
# buffer (f32 [D / 64, 64], 8 KiB at V2-Lite), each fetched once the other's norm has read it (phase 1 fetches the
# layer's router norm's, the routing the next layer's attention norm's); and small buffers, which Mosaic GPU
# aligns to 1 KiB each, are packed (h's row, the partial logits and the logits in one; the split sums and the
# published ones in one) or share zeros (f32 [4, 64] and bf16 [8, 64] in the same 1 KiB): 13 KiB in all, room for
# a tenth ring slot (``RING = 10`` in decode_step_mgpu, decode_step_attention and this module: 231 656 bytes of
# the 232 448 a block may have at V2-Lite; 244 960 without). H100, batch-1 compiled step, 2 rounds in turns
# (decode_profile.md round 48): -5 µs a step at RING = 9 in two calls (2.0885 / 2.0884 ms against 2.0934 /
# 2.0936); in a third, -2 in round 1 and +27 in round 0 (the fresh card's first timing, 2.1195: an outlier by
# the other rounds' 2.088-2.095); the tenth slot on top +4 (2.0923 / 2.0916), so RING stays 9. False: a buffer
# each (the layout before). The producer's TMA prefetch of the next layer's phase-1 boxes into L2 ahead of the
# ring was +26 / +43 µs a step on an H100 issued at a layer's last / 8th-last MoE box (round 48) and +37 / +69 on
# the H200 (round 51); removed (code at 4b2bbe7, PREFETCH_P1). Read at trace time.
COMPACT_SMEM = True


def _compact_smem(router: bool, front: bool) -> bool:
    """Whether the kernel's shared memory is COMPACT_SMEM's layout: the whole layers' (a router and the attention
    phases) only. ``_moe_scratch`` lays it out and ``_moe_body`` unpacks it by this one answer."""
    return bool(COMPACT_SMEM and router and front)


# A diagnostic (round 47, timing only; the values stay right): at each layer's end the producer's last warp (or
# last PROBE_CODE_PAD_WARPS) runs this many instructions of padding (``_code_pad``: multiply-adds in 8 chains, 16
# bytes of machine code each), straight-line, or with PROBE_CODE_PAD_LOOPED as 16 turns of a loop of a sixteenth
# of them: the same work in a sixteenth of the code. The other warps do not wait out the padding's work, but the
# producer's next box does: every TMA issue of a warpgroup starts with a warpgroup barrier (Mosaic GPU's automatic
# ones). So straight against looped prices the padding's own instruction fetches plus what its footprint costs
# the layer's other code (decode_profile.md round 47). Read at trace time.
PROBE_CODE_PAD = 0
PROBE_CODE_PAD_LOOPED = False
PROBE_CODE_PAD_WARPS = 1  # the producer's last this many warps run the padding (warp 0 issues the boxes)


def _code_pad(instructions: int, looped: bool):
    """``PROBE_CODE_PAD``'s padding, run by the warpgroup's last ``PROBE_CODE_PAD_WARPS`` warps (one inline PTX
    block): ``instructions`` multiply-adds by the clock in 8 chains, their sum stored only where %nsmid is 0
    (never, but ptxas cannot know, so it keeps them)."""
    if instructions % (16 * 8):
        raise ValueError(f"PROBE_CODE_PAD {instructions}; accepted: a multiple of 128")
    count = instructions // 16 if looped else instructions
    body = [f"mad.lo.u32 a{i % 8}, a{i % 8}, m, {i + 1};" for i in range(count)]
    if looped:
        body = ["mov.u32 t, 0;", "pad_loop:", '.pragma "nounroll";', *body, "add.u32 t, t, 1;", "setp.lt.u32 p, t, 16;",
                "@p bra pad_loop;"]
    lines = [".reg .pred p;", ".reg .b32 t, m, a<8>;", "mov.u32 t, %tid.x;", "and.b32 t, t, 127;",
             f"setp.lt.u32 p, t, {32 * (4 - PROBE_CODE_PAD_WARPS)};", "@p bra pad_skip;", "mov.u32 m, %clock;",
             *[f"add.u32 a{i}, m, {i};" for i in range(8)], *body, *[f"xor.b32 a0, a0, a{i};" for i in range(1, 8)],
             "mov.u32 t, %nsmid;", "setp.eq.u32 p, t, 0;", "mov.u32 m, 0;", "@p st.shared.u32 [m], a0;", "pad_skip:"]
    plgpu.inline_mgpu()(lambda _: mgpu_utils.inline_ptx("{\n" + "\n".join(lines) + "\n}", has_side_effects=True))()


def split_parts(num_tiles: int, num_ctas: int) -> int:
    """How many K ranges the split plan cuts each of the tiles past the first C into (0: no split plan)."""
    extra = num_tiles - num_ctas
    return num_ctas // extra if 0 < extra and num_ctas // extra >= 2 else 0


def expert_plan(num_tiles: int, num_ctas: int, gate_steps: int, down_steps: int, kind: str,
                shared_from: int | None = None) -> np.ndarray:
    """Each CTA's units of an expert layer, in order: int32[C, U, 5] rows (kind, tile, first box, end box,
    part), kind -1 after a CTA's last. A GATE_UP unit is gate and up boxes [first, end) of a tile (2 a K
    step: whole, [0, 2 * gate_steps), or one part of the tile's K steps); a DOWN unit is boxes [first, end) of
    its down rows (it needs h: from the GATE_UP unit just before it, or from global memory).

    "tiles": CTA c takes tiles c, c + C, ... whole. Past C tiles (C < tiles <= 2C):

    - "dealt": every CTA takes tile c's gate / up, CTAs c < tiles - C the gate / up of tile C + c as well
      (publishing h), the others their own tile's down and, in halves, the downs of the two-tile CTAs'
      tiles, first-published first, each to the least-loaded CTA. V2-Lite's 176 tiles on 132 CTAs give
      every CTA 64 boxes, but a half down waits for an h its owner computes last.
    - "split" (``split_parts`` P >= 2): CTA c takes its own tile c whole (gate / up, then down) and, for
      c < P (tiles - C), first the gate / up of part c % P of tile C + c // P's K steps (publishing the
      partial gate and up sums), last a part of that tile's down rows, sized so that every CTA streams
      the same boxes (V2-Lite: 12 + 4, 10 + 6, 10 + 6 on top of 48). No CTA waits for a tile's sums until
      its own tile is done, and the tiles past C (the shared experts' when ``shared_from`` is C) stream first.
    Otherwise whole tiles.

    ``shared_from`` (the first shared expert's tile): each CTA's shared tiles first (their boxes need no
    routing, so they stream while it is computed), a tile's gate / up still before its own down."""
    if kind not in PLANS:
        raise ValueError(f"expert plan {kind!r}; accepted: {', '.join(PLANS)}")
    gate_up = 2 * gate_steps
    plans = [[] for _ in range(num_ctas)]
    parts = split_parts(num_tiles, num_ctas)
    if kind == "split" and parts:
        steps = np.array_split(np.arange(gate_steps), parts)  # each part's K steps of the tile's gate / up
        per_tile = gate_up + down_steps
        targets = [per_tile // parts + (j < per_tile % parts) for j in range(parts)]
        downs = [max(0, t - 2 * len(k)) for t, k in zip(targets, steps)]  # its down boxes: the boxes even
        downs[-1] = down_steps - sum(downs[:-1])
        bounds = np.cumsum([0] + downs)
        for c in range(parts * (num_tiles - num_ctas)):
            plans[c].append((GATE_UP, num_ctas + c // parts, 2 * int(steps[c % parts][0]),
                             2 * int(steps[c % parts][-1]) + 2, c % parts))
        for c in range(num_ctas):
            plans[c] += [(GATE_UP, c, 0, gate_up, 0), (DOWN, c, 0, down_steps, 0)]
        for c in range(parts * (num_tiles - num_ctas)):
            if downs[c % parts]:
                plans[c].append((DOWN, num_ctas + c // parts, int(bounds[c % parts]), int(bounds[c % parts + 1]), 0))
    elif kind == "dealt" and num_ctas < num_tiles <= 2 * num_ctas:
        extra = num_tiles - num_ctas
        load = [gate_up] * num_ctas
        for c in range(num_ctas):
            plans[c].append((GATE_UP, c, 0, gate_up, 0))
        for c in range(extra):
            plans[c].append((GATE_UP, num_ctas + c, 0, gate_up, 0))
            load[c] += gate_up
            if shared_from is not None and num_ctas + c >= shared_from > c:
                plans[c].reverse()  # the shared tile's gate / up first
        for c in range(extra, num_ctas):
            plans[c].append((DOWN, c, 0, down_steps, 0))
            load[c] += down_steps
        half = max(1, down_steps // 2)
        published = [plans[c][i][1] for i in range(2) for c in range(extra)]  # the order the h's come in
        for t in published:
            for first in range(0, down_steps, half):
                c = min(range(num_ctas), key=lambda c: (load[c], -c))
                plans[c].append((DOWN, t, first, min(first + half, down_steps), 0))
                load[c] += min(first + half, down_steps) - first
    else:
        for t in range(num_tiles):
            plans[t % num_ctas] += [(GATE_UP, t, 0, gate_up, 0), (DOWN, t, 0, down_steps, 0)]
        if shared_from is not None:
            for c, plan in enumerate(plans):  # whole tiles: (gate / up, down) pairs, the shared ones first
                pairs = [plan[i:i + 2] for i in range(0, len(plan), 2)]
                plans[c] = [u for pair in sorted(pairs, key=lambda pair: pair[0][1] < shared_from) for u in pair]
    units = max(len(p) for p in plans)
    table = np.full((num_ctas, units, 5), -1, np.int32)
    for c, plan in enumerate(plans):
        if plan:
            table[c, :len(plan)] = plan
    return table


def _rank_picks(logits, iota, logits_smem, num_experts: int, top_k: int):
    """The greedy top-k of a warpgroup's logits (one a thread, ``iota`` its id, -inf past ``num_experts``; the
    same values in ``logits_smem``) in lax.top_k's order: value descending, ties to the lower id. Each thread
    counts the experts ahead of its own (an expert is ahead when larger, or equal with a lower id: a
    permutation's ranks); the ids of ranks 0 .. k - 1 are summed into int32 fields of ``_ID_BITS`` bits, 5 a
    sum. -> the k picked ids, scalars."""
    if num_experts > 1 << _ID_BITS or num_experts % 8:
        raise ValueError(f"_rank_picks: {num_experts} experts; accepted a multiple of 8 up to {1 << _ID_BITS}")

    def ahead(j8, count):  # 8 experts an iteration: their loads in flight together, the code still small
        for i in range(8):
            j = j8 * 8 + i
            v = logits_smem[j]
            count = count + jnp.where((v > logits) | ((v == logits) & (j < iota)), 1, 0)
        return count

    rank = lax.fori_loop(0, num_experts // 8, ahead, iota * 0)
    per_sum = 32 // _ID_BITS
    picks = []
    for first in range(0, top_k, per_sum):
        field = (rank >= first) & (rank < min(first + per_sum, top_k))
        shift = jnp.where(field, (rank - first) * _ID_BITS, 0)
        packed = jnp.sum(jnp.where(field, iota << shift, 0))  # disjoint bit fields: the sum is exact
        picks += [(packed >> ((k - first) * _ID_BITS)) & ((1 << _ID_BITS) - 1)
                  for k in range(first, min(first + per_sum, top_k))]
    return picks


class RouterSpec(NamedTuple):
    """moe_chain's in-kernel router (static): RMSNorm's eps, then softmax scores, greedy top-k."""

    eps: float
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


def _moe_body(*refs, num_layers: int, top_k: int, num_experts: int, routed_tiles: int, num_tiles: int, num_ctas: int,
              units: int, router: RouterSpec | None, publishes: bool, splits: int, attention: int = 0,
              front: dict | None = None, final_eps: float | None = None, pdl: bool = False):
    # plan_ref i32[C * U * 5] (``expert_plan``); ``publishes``: whole gate / up units publish h (some CTA takes
    # their down rows); ``splits``: tiles num_ctas and on are cut into this many K ranges (the split plan).
    # Without a router: ids_ref i32[L * k], weights_ref f32[L * k];
    # x_ref f32[D / 64, 64]; routed experts [L, E, D, I] x 2 and [L, E, I, D]; shared [L, D, S] x 2 and [L, S,
    # D]; with a router: its norm's weights g_ref f32[L, D / 64, 64] and weights wr_ref bf16[L, P, D, E], P parts
    # (f32 weights as hi + lo, ``moe_block_chain``) whose sum is the router. Outputs:
    # out_ref f32[L, D / 64, 64]: layer l's output rows, x_l + the TMA adds of every CTA's partial rows; hs_ref
    # f32[L, T, max(splits, 1), 2, 64]: each tile's h ([.., 0, 0]) or its K ranges' partial gate and up sums,
    # published for the CTAs that take its down rows; with a router: the logits
    # f32[L, 8, E] (row 0, summed by TMA adds), the chosen ids i32[L, 8] and weights f32[L, 8] (first k).
    # ``attention`` (A > 0, with a router): an o_proj phase first, inputs attn_ref f32[L, A / 64, 64] (each
    # layer's attention output rows) and wo_ref bf16[L, A, D], output mid_ref f32[L, D / 64, 64] (x_l + attn_l @
    # W_o, the MoE half's input).
    # ``front`` (with ``attention``: the whole layer, ``moe_layer_chain``): the attention phases first
    # (``decode_step_attention.attention_phases``, its constants), their AttentionRefs' 11 inputs after wo_ref in
    # place of attn_ref, their 7 outputs after mid_ref; o_proj reads their v_ctx.
    # ``final_eps`` (with a router): the last input gf_ref f32[D / 64, 64] is a final RMSNorm's weights, and the
    # last output normed_ref bf16[D / 64, 64] is x_L normed by it (CTA 0, after the last layer).
    # ``pdl``: launched as a programmatic dependent of the launch before it, every thread waits for that launch's
    # completion (and its writes) before anything else: the CTAs' launch and set-up overlap its tail, nothing more
    # (no read or write of global memory before the wait, so no buffer XLA hands on between the two is touched).
    if pdl:
        plgpu.griddepcontrol_wait()
    compact = _compact_smem(router is not None, bool(front))  # the layout _moe_scratch gave
    if router:
        final = final_eps is not None
        num_in = 10 + ((1 + 11) if front else 2 if attention else 0) + final
        num_out = 5 + (8 if front else 1 if attention else 0) + final
        (plan_ref, x_ref, wg_ref, wu_ref, wd_ref, sg_ref, su_ref, sd_ref, g_ref, wr_ref, *attention_in) = refs[:num_in]
        (out_ref, hs_ref, logits_ref, ids_out, weights_out, *attention_out) = refs[num_in:num_in + num_out]
        if final:
            gf_ref, normed_ref = attention_in.pop(), attention_out.pop()
        if compact:
            (ring, xin_smem, tiles_union, h_union, small, row_smem, (zero_smem, zero16_smem), sums_smem, full, free,
             xin_bar, hin_bar, g_smem, rid_smem, rw_smem, g_bar, logits_bar, route_bar,
             *front_smem) = refs[num_in + num_out:]
            hin_smem, part_smem, logits_smem = (small.at[pl.ds(at * HALF, n * HALF)]
                                                for at, n in ((0, 1), (1, 1), (2, 2)))
            split_rows = sums_smem.shape[0] - 1
            sums_smem, pub_smem = sums_smem.at[pl.ds(0, split_rows)], sums_smem.at[split_rows]
            qrow_smem, *front_bars = front_smem  # the attention phases' scratch as built lays it out: the shared
            front_smem = [g_smem, g_bar, qrow_smem, zero16_smem, *front_bars]  # norm buffer and zeros in their places
        else:
            (ring, xin_smem, tiles_union, h_union, hin_smem, row_smem, zero_smem, sums_smem, pub_smem, full, free,
             xin_bar, hin_bar, g_smem, part_smem, logits_smem, rid_smem, rw_smem, g_bar, logits_bar, route_bar,
             *front_smem) = refs[num_in + num_out:]
        tiles_smem, flat_smem, *front_buffers = tiles_union
        if front:
            wo_ref, front_in = attention_in[0], attention_in[1:]
            mid_ref, front_out = attention_out[0], attention_out[1:]
            front_refs = AttentionRefs(*front_in, *front_out)
            attn_ref = front_refs.vctx  # o_proj's input: the heads' outputs after W_UV
            g_attn, g_attn_bar, qrow_smem, zero16_smem, rope_bar, lat_bar = front_smem
            (q_win, p_smem), rope_buffers = front_buffers
            front_scratch = AttentionScratch(
                xin_smem, g_attn, g_attn_bar, tiles_smem, flat_smem, row_smem, q_win, p_smem, row_smem.at[pl.ds(0, 2)],
                tiles_smem.at[pl.ds(0, HALF)], *rope_buffers, pub_smem, qrow_smem, zero_smem, zero16_smem, rope_bar,
                lat_bar)
        elif attention:
            (attn_ref, wo_ref), (mid_ref,) = attention_in, attention_out
    else:
        (plan_ref, ids_ref, weights_ref, x_ref, wg_ref, wu_ref, wd_ref, sg_ref, su_ref, sd_ref, out_ref, hs_ref, ring,
         xin_smem, tiles_union, h_union, hin_smem, row_smem, zero_smem, sums_smem, pub_smem, full, free, xin_bar,
         hin_bar) = refs
        tiles_smem, flat_smem = tiles_union
    h_smem, h_flat = h_union
    c = lax.axis_index("c")
    rows = xin_smem.shape[0]
    hidden = rows * HALF
    gate_steps = hidden // STEP
    gate_boxes = 2 * gate_steps
    routers = gate_steps  # router CTAs: c < routers, K step c of the router's rows each
    parts = wr_ref.shape[1] if router else 0  # the router's boxes a router CTA takes a layer
    router_boxes = jnp.where(c < routers, parts, 0)
    # o_proj's units: CTA c < o_units takes column tile c // o_ranges, K range c % o_ranges (UNIT_K rows)
    o_ranges = attention // UNIT_K
    o_units = (hidden // HALF) * o_ranges
    o_tile, o_kq = lax.div(c, max(o_ranges, 1)), lax.rem(c, max(o_ranges, 1))
    o_boxes = jnp.where(c < o_units, UNIT_K // STEP, 0)
    # grid barriers a layer: (the attention phases' 4,) (o_proj's sums,) the experts' sums
    per_layer = 6 if front else 2 if attention else 1
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR(()))  # the grid barrier after each phase's sums
    if front:
        front_zero, front_loads, front_compute = attention_phases(
            front_refs, front_scratch, ring, full, free, sem, num_layers=num_layers, num_ctas=num_ctas,
            barrier_count=lambda layer, phase: 1 + per_layer * layer + phase,
            next_norm=(lambda layer: plgpu.copy_gmem_to_smem(g_ref.at[layer], g_smem, g_bar.at[0])) if compact
            else None, **front)
    if router:  # the router CTAs' logits added (each once a layer)
        routed_sem = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
    # tile t's h published (once a layer), or its K ranges' sums (``splits`` times a layer)
    flags = pl.get_global(plgpu.SemaphoreType.REGULAR((num_tiles,)))

    def unit(u):
        """Unit u of this CTA's plan: (kind, tile, first box, end box, part) as boxes of its tile's stream
        (gate / up boxes 0 .. 2 * gate_steps - 1, then the down boxes)."""
        at = (c * units + u) * 5
        kind, tile = plan_ref[at], plan_ref[at + 1]
        offset = jnp.where(kind == DOWN, gate_boxes, 0)
        return kind, jnp.maximum(tile, 0), offset + plan_ref[at + 2], offset + plan_ref[at + 3], plan_ref[at + 4]

    num_units = sum(jnp.where(plan_ref[(c * units + u) * 5] >= 0, 1, 0) for u in range(units))

    def tile_of(layer, t):
        """Tile t at ``layer``: (routed?, expert, routing weight, first intermediate column)."""
        is_routed = t < top_k * routed_tiles
        slot_k = jnp.minimum(lax.div(t, jnp.int32(routed_tiles)), top_k - 1)
        if router:  # this layer's routing, in shared memory
            picked, weight = rid_smem[slot_k], rw_smem[slot_k]
        else:
            picked, weight = ids_ref[layer * top_k + slot_k], weights_ref[layer * top_k + slot_k]
        expert = jnp.minimum(picked, num_experts - 1)
        scale = jnp.where(is_routed, jnp.where(picked >= num_experts, 0.0, weight), 1.0)
        i0 = jnp.where(is_routed, lax.rem(t, jnp.int32(routed_tiles)), t - top_k * routed_tiles) * HALF
        return is_routed, expert, scale, i0

    def await_routing(tile, routed, layer, producer: bool):
        """Once a layer, before the first routed tile's unit (``routed``: done already this layer; ``tile``
        None: at the layer's end, if no unit needed it): the producer routes the layer, the computing warpgroup
        waits for that on ``route_bar`` and weighs the picks. -> routed."""
        first = jnp.logical_not(routed) if tile is None else (tile < top_k * routed_tiles) & jnp.logical_not(routed)
        if producer:
            pl.when(first)(lambda: route_layer(layer))
        else:
            @pl.when(first)
            def _():
                plgpu.barrier_wait(route_bar.at[0])
                route_weights(layer)
        return routed | first

    def loads():
        """Warpgroup 1: every box of every unit of every layer, each once its slot is free (with a router, it
        routes each layer before the layer's first routed box: ``await_routing``)."""
        def issue(n, halves):
            """The box at ring position n, its two [64, 64] halves ``halves(h)`` in global memory."""
            _issue_box(ring, full, free, n, lambda h: [(halves(h), True)])

        def unit_loads(layer, u, carry):
            count, routed = carry
            _, tile, first, end, _ = unit(u)
            if router:
                routed = await_routing(tile, routed, layer, True)
            is_routed, expert, _, i0 = tile_of(layer, tile)

            def box(n, count):
                k, jd = lax.div(n, 2), n - gate_boxes
                kinds = ((n < gate_boxes) & (lax.rem(n, 2) == 0), (n < gate_boxes) & (lax.rem(n, 2) == 1),
                         n >= gate_boxes)  # gate, up, down

                def copies(h):  # the routed expert's or the shared experts' box of this kind
                    gate_up = (pl.ds(k * STEP + h * HALF, HALF), pl.ds(i0, HALF))
                    down = (pl.ds(i0, HALF), pl.ds(jd * STEP + h * HALF, HALF))
                    sources = (((layer, expert), is_routed, (wg_ref, wu_ref, wd_ref)),
                               ((layer,), jnp.logical_not(is_routed), (sg_ref, su_ref, sd_ref)))
                    return [(ref.at[(*prefix, *index)], which & kind_is) for prefix, which, refs in sources
                            for ref, index, kind_is in zip(refs, (gate_up, gate_up, down), kinds)]

                _issue_box(ring, full, free, count, copies)
                return count + 1

            return lax.fori_loop(first, end, box, count), routed

        def layer_loads(layer, count):
            if front:  # the attention phases' boxes first
                count = front_loads(layer, count)
            if attention:  # an o_proj unit's boxes first

                pl.when(c < o_units)(lambda: _unit_boxes(ring, full, free, count, wo_ref.at[layer], o_tile, o_kq))
                count = count + o_boxes
            if router:  # a router CTA's K step of the router, each part a box, before the layer's units

                @pl.when(c < routers)
                def _():
                    for p in range(parts):
                        issue(count + p, lambda h, p=p: wr_ref.at[layer, p, pl.ds(c * STEP + h * HALF, HALF)])
                count = count + router_boxes
            count, routed = lax.fori_loop(0, num_units, lambda u, carry: unit_loads(layer, u, carry), (count, False))
            if router:
                await_routing(None, routed, layer, True)
            if PROBE_CODE_PAD:
                _code_pad(PROBE_CODE_PAD, PROBE_CODE_PAD_LOOPED)
            return count

        lax.fori_loop(0, num_layers, layer_loads, jnp.int32(0))
        if router:
            plgpu.wait_smem_to_gmem(0)  # CTA 0's copies of the last layer's routing

    def input_tiles(source):
        if router:  # the rows only (the tiles are of the normed rows, ``route``), rounded to bf16 as the model's
            with jax.named_scope("input"):  # residual stream is: the norm and the residual add take them so
                plgpu.copy_gmem_to_smem(source, xin_smem, xin_bar.at[0])
                plgpu.barrier_wait(xin_bar.at[0])
                _round_rows(xin_smem)
        else:
            _input_tiles(source, xin_smem, flat_smem, xin_bar.at[0])

    def route(layer, count):
        """RMSNorm of the layer's rows into the tiles; a router CTA multiplies the tiles of its K step by its
        router boxes (``parts`` of them, two wgmma chains), adds its partial logits by TMA and counts them on
        ``routed_sem`` (the producer's ``route_layer`` takes it from there). -> the ring's count after the router
        boxes."""
        plgpu.barrier_wait(g_bar.at[0])  # the norm's weights (fetched during the layer before)
        with jax.named_scope("norm"):  # the rows as one array (16 elements a thread), normed into the tiles
            _norm_tiles(xin_smem, g_smem, flat_smem, router.eps)

        @pl.when(c < routers)
        @jax.named_scope("router")
        def _():
            def products(accs):
                for p in range(parts):
                    slot = lax.rem(count + p, RING)
                    plgpu.barrier_wait(full.at[slot])
                    for h in range(2):
                        token = tiles_smem.at[pl.ds((2 * c + h) * TOKEN_N, TOKEN_N)].transpose((1, 0))
                        plgpu.wgmma(accs[h], ring.at[slot, h].transpose((1, 0)), token)

            zeros = plgpu.layout_cast(jnp.zeros((HALF, TOKEN_N), jnp.float32), plgpu.Layout.WGMMA)
            a0, a1 = pl.run_state(products)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
            for p in range(parts):
                plgpu.barrier_arrive(free.at[lax.rem(count + p, RING)])
            part_smem[...] = jnp.sum(a0 + a1, axis=1)  # the token's column: the partial logits
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(part_smem, logits_ref.at[layer, 0], reduction_op="add")

        @pl.when(layer + 1 < num_layers)
        def _():  # the next layer's (attention) norm weights, while this one routes and runs its experts
            plgpu.copy_gmem_to_smem((front_refs.g if compact else g_ref).at[layer + 1], g_smem, g_bar.at[0])

        @pl.when(c < routers)
        @jax.named_scope("stores_out")
        def _():
            stores_done()
            plgpu.semaphore_signal(routed_sem, 1, memory_scope="gpu")

        row_smem[...] = jnp.zeros(row_smem.shape, jnp.float32)  # the CTA's partial output rows
        return count + router_boxes

    def logits_row():
        """The layer's logits in shared memory as a warpgroup's row, one a thread (-inf past the experts) ->
        (each thread's expert id, its logit)."""
        strided = plgpu.Layout.WG_STRIDED((2 * HALF,), vec_size=1)
        iota = plgpu.broadcasted_iota(jnp.int32, (2 * HALF,), 0, layout=strided)
        return iota, jnp.where(iota < num_experts, plgpu.load(logits_smem, layout=strided), -jnp.inf)

    def route_layer(layer):
        """The producer, before the layer's first routed box: once every router CTA has counted its add on
        ``routed_sem``, the layer's logits and its greedy top-k ids into shared memory; ``route_bar`` tells the
        computing warpgroup, which runs the shared tiles' products meanwhile (then weighs the picks). The ids
        overwrite the layer before's only after routed_sem counts this layer's router products, which follow the
        grid barrier that this CTA's computing warpgroup reaches after its units (the last readers of the layer
        before's)."""
        with jax.named_scope("logits"):  # every router CTA's add, then the sums
            plgpu.semaphore_wait(routed_sem, routers * (layer + 1), decrement=False, memory_scope="gpu")
            proxy_fence()
            plgpu.copy_gmem_to_smem(logits_ref.at[layer, 0], logits_smem.at[pl.ds(0, HALF)], logits_bar.at[0])
            plgpu.barrier_wait(logits_bar.at[0])
        with jax.named_scope("routing"):
            iota, logits = logits_row()
            picks = _rank_picks(logits, iota, logits_smem, num_experts, top_k)
            plgpu.wait_smem_to_gmem(0)  # the layer before's ids out of shared memory (CTA 0's copy)
            for k, pick in enumerate(picks):
                # the fixed pick still depends on the computed one (never negative), which keeps its work
                rid_smem[k] = jnp.where(pick < 0, pick, jnp.int32(k)) if PROBE_FIXED_ROUTING else pick
            plgpu.commit_smem()
            plgpu.barrier_arrive(route_bar.at[0])
            pl.when(c == 0)(lambda: plgpu.copy_smem_to_gmem(rid_smem, ids_out.at[layer]))

    def route_weights(layer):
        """The computing warpgroup, once the producer's picks are in: their softmax scores from the logits in
        shared memory (the chosen scores' sum in pick order, plus route_reference's 1e-20, for norm_topk_prob),
        scaled, into ``rw_smem``; CTA 0 stores them for the caller. Off the routed boxes' path: they are needed
        only when a routed tile's gate / up products end."""
        _, logits = logits_row()
        top = logits_smem[rid_smem[0]]  # the first pick's logit is the largest
        total_exp = jnp.sum(jnp.exp(logits - top))
        scores, total = [], jnp.float32(1e-20)
        for k in range(top_k):
            scores.append(jnp.exp(logits_smem[rid_smem[k]] - top) / total_exp)
            total = total + scores[-1]
        scale = router.routed_scaling_factor / (total if router.norm_topk_prob else 1.0)
        for k, score in enumerate(scores):
            rw_smem[k] = score * scale

            @pl.when(c == 0)
            def _():
                weights_out[layer, k] = score * scale

    def compute():
        _zero_rows(zero_smem, out_ref, c, num_ctas)  # every layer's output rows, then the first barrier
        if router:
            _zero_rows(zero_smem, logits_ref, c, num_ctas)
            if not compact:  # the first layer's norm weights (compact: front_zero fetches its attention norm's)
                plgpu.copy_gmem_to_smem(g_ref.at[0], g_smem, g_bar.at[0])
        if attention:
            _zero_rows(zero_smem, mid_ref, c, num_ctas)
        if front:
            front_zero()
        input_tiles(x_ref)
        _arrive_and_wait(sem, num_ctas, 1)
        zeros = plgpu.layout_cast(jnp.zeros((HALF, TOKEN_N), jnp.float32), plgpu.Layout.WGMMA)
        h_flat[...] = jnp.zeros(h_flat.shape, h_flat.dtype)  # h's tile: its rows below the first stay zeros
        plgpu.commit_smem()

        def h_tile(h_row):
            """h [64] (reduced WGMMA layout) as the first row of h's [8, 64] tile."""
            h_flat.at[0, pl.ds(0, HALF)][...] = h_row.astype(h_flat.dtype)
            plgpu.commit_smem()

        def gate_up_unit(layer, tile, first, end, part, base):
            """Gate and up boxes [first, end) of ``tile``: the whole tile's give h (in h_smem; published when
            ``publishes``), a K range's give its partial gate and up sums, published."""
            _, _, scale, _ = tile_of(layer, tile)
            k0 = lax.div(first, 2)

            def gate_up(accs):  # accumulators: gate half 0, gate half 1, up half 0, up half 1
                def step(j, _):
                    k = k0 + j
                    g_slot, u_slot = lax.rem(base + 2 * j, RING), lax.rem(base + 2 * j + 1, RING)
                    plgpu.barrier_wait(full.at[g_slot])
                    plgpu.barrier_wait(full.at[u_slot])
                    for h in range(2):
                        token = tiles_smem.at[pl.ds((2 * k + h) * TOKEN_N, TOKEN_N)].transpose((1, 0))
                        plgpu.wgmma(accs[h], ring.at[g_slot, h].transpose((1, 0)), token)
                        plgpu.wgmma(accs[2 + h], ring.at[u_slot, h].transpose((1, 0)), token)

                    @pl.when(j > 0)
                    def _():  # the previous step's products are done (this step's may run on): free its slots
                        plgpu.wgmma_wait(4)
                        plgpu.barrier_arrive(free.at[lax.rem(base + 2 * j - 2, RING)])
                        plgpu.barrier_arrive(free.at[lax.rem(base + 2 * j - 1, RING)])
                    return ()

                lax.fori_loop(0, lax.div(end - first, 2), step, ())

            with jax.named_scope("gate_up"):
                g0, g1, u0, u1 = pl.run_state(gate_up)(tuple(plgpu.ACC.init(zeros) for _ in range(4)))
                plgpu.barrier_arrive(free.at[lax.rem(base + end - first - 2, RING)])
                plgpu.barrier_arrive(free.at[lax.rem(base + end - first - 1, RING)])
            g, u = g0 + g1, u0 + u1

            @pl.when((first == 0) & (end == gate_boxes))
            def _():
                hin_smem[...] = jnp.sum(g * jax.nn.sigmoid(g) * u * scale, axis=1)  # the token's column, a row
                plgpu.commit_smem()  # (h's tile: built from hin_smem at the down unit)
                if publishes:  # for the CTAs that take this tile's down rows (a plan with no such CTA: none)
                    with jax.named_scope("publish"):
                        hs_ref.at[layer, tile, 0, 0][...] = plgpu.load(hin_smem, layout=plgpu.Layout.WGMMA.reduce(0))
                        plgpu.semaphore_signal(flags.at[tile], 1, memory_scope="gpu")

            if splits:
                @pl.when((first != 0) | (end != gate_boxes))
                @jax.named_scope("publish")
                def _():  # a K range of the tile: its partial sums, for the CTAs that take the tile's down rows,
                    for i, acc in enumerate((g, u)):  # stored by TMA; ``signal`` counts them once surely out
                        pub_smem.at[i][...] = jnp.sum(acc, axis=1)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(pub_smem, hs_ref.at[layer, tile, part])

        @jax.named_scope("signal")
        def signal(tile):
            """Counts a K range's sums on the tile's flag, a unit after their TMA store was issued: a release
            right behind a store waits out its round trip, 4-6 µs while the SM's stream is in flight (the
            "publish" of round 22's traces; round 29 saw no time change with every store wait left out)."""
            stores_done()
            plgpu.semaphore_signal(flags.at[tile], 1, memory_scope="gpu")

        def down_unit(layer, tile, first, end, base, local):
            split = (tile >= num_ctas) if splits else False  # its h from its K ranges' partial sums

            @pl.when(jnp.logical_not(local) & jnp.logical_not(split))
            @jax.named_scope("fetch_h")
            def _():  # another CTA's tile: its h once published
                plgpu.semaphore_wait(flags.at[tile], layer + 1, decrement=False, memory_scope="gpu")
                proxy_fence()
                plgpu.copy_gmem_to_smem(hs_ref.at[layer, tile, 0, 0], hin_smem, hin_bar.at[0])
                plgpu.barrier_wait(hin_bar.at[0])

            if splits:
                @pl.when(jnp.logical_not(local) & split)
                @jax.named_scope("fetch_h")
                def _():  # a split tile: h from the sums of its K ranges, once all are published
                    # (fetched by the producer a ring ahead instead: slower, round 29, code at 99814d1)
                    plgpu.semaphore_wait(flags.at[tile], splits * (layer + 1), decrement=False, memory_scope="gpu")
                    proxy_fence()
                    plgpu.copy_gmem_to_smem(hs_ref.at[layer, tile], sums_smem, hin_bar.at[0])
                    plgpu.barrier_wait(hin_bar.at[0])
                    part = lambda p, i: plgpu.load(sums_smem.at[p, i], layout=plgpu.Layout.WGMMA.reduce(0))
                    g, u = lax.fori_loop(1, splits, lambda p, gu: (gu[0] + part(p, 0), gu[1] + part(p, 1)),
                                         (part(0, 0), part(0, 1)))
                    h = g * jax.nn.sigmoid(g) * u * tile_of(layer, tile)[2]
                    hin_smem[...] = h
                    plgpu.commit_smem()

            # h in hin_smem (this CTA's own tile's, fetched, or summed), as h's tile in one place
            h_tile(plgpu.load(hin_smem, layout=plgpu.Layout.WGMMA.reduce(0)))

            h_t = h_smem.at[pl.ds(0, TOKEN_N)].transpose((1, 0))

            def down(n, _):
                slot = lax.rem(base + n - first, RING)
                plgpu.barrier_wait(full.at[slot])

                def products(accs):
                    for half, acc in enumerate(accs):
                        plgpu.wgmma(acc, ring.at[slot, half].transpose((1, 0)), h_t)

                accs = pl.run_state(products)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
                plgpu.barrier_arrive(free.at[slot])
                jd = n - gate_boxes
                for half in range(2):
                    out_row = row_smem.at[2 * jd + half]
                    out_row[...] = out_row[...] + jnp.sum(accs[half], axis=1)
                return ()

            with jax.named_scope("down"):
                lax.fori_loop(first, end, down, ())

        def o_proj(layer, count):
            """x_mid = x_l + attn_l @ W_o: CTA c < o_units multiplies its unit (the attention rows' K range as
            tiles, in the first of the tiles and rows the norm fills later) and adds its 64 partial sums by
            TMA, CTA 0 adds x_l once; after the barrier x_mid's rows are the MoE half's input (xin_smem).
            -> the ring's count after the unit's boxes."""
            @pl.when(c < o_units)
            @jax.named_scope("o_proj")
            def _():
                chunks = UNIT_K // HALF
                _input_tiles(attn_ref.at[layer, pl.ds(o_kq * chunks, chunks)], row_smem.at[pl.ds(0, chunks)],
                             flat_smem, xin_bar.at[0])

                _unit_store(ring, full, free, tiles_smem, count, zeros, part_smem, mid_ref.at[layer, o_tile])

            pl.when(c == 0)(lambda: plgpu.copy_smem_to_gmem(xin_smem, mid_ref.at[layer], reduction_op="add"))
            _arrive_and_wait(sem, num_ctas, 1 + per_layer * layer + (5 if front else 1), "o_proj")
            input_tiles(mid_ref.at[layer])
            return count + o_boxes

        def layer_body(layer, count):
            if front:
                count = front_compute(layer, count)
            if attention:
                count = o_proj(layer, count)

            @pl.when(c == 0)
            def _():  # the residual: the layer's input rows once
                plgpu.copy_smem_to_gmem(xin_smem, out_ref.at[layer], reduction_op="add")

            if router:
                count = route(layer, count)
            else:
                row_smem[...] = jnp.zeros(row_smem.shape, jnp.float32)

            def one(u, carry):
                # the last whole tile's gate / up (its h is in h_smem); the tile whose K range's sums are
                # stored and not yet counted (-1: none), counted before this CTA's first down unit after them;
                # whether the layer's routing is in (waited for before the first routed tile's unit)
                count, last_gate_up, pending, routed = carry
                kind, tile, first, end, part = unit(u)
                if router:
                    routed = await_routing(tile, routed, layer, False)
                pl.when((kind == DOWN) & (pending >= 0))(lambda: signal(pending))
                pending = jnp.where(kind == DOWN, -1, pending)
                pl.when(kind == GATE_UP)(lambda: gate_up_unit(layer, tile, first, end, part, count))
                pl.when(kind == DOWN)(lambda: down_unit(layer, tile, first, end, count, tile == last_gate_up))
                whole = (kind == GATE_UP) & (first == 0) & (end == gate_boxes)
                pending = jnp.where((kind == GATE_UP) & jnp.logical_not(whole), tile, pending)
                return count + end - first, jnp.where(whole, tile, last_gate_up), pending, routed

            count, _, pending, routed = lax.fori_loop(0, num_units, one,
                                                      (count, jnp.int32(-1), jnp.int32(-1), jnp.bool_(False)))
            if router:
                await_routing(None, routed, layer, False)
            pl.when(pending >= 0)(lambda: signal(pending))  # before the barrier: readers of this layer wait on it
            with jax.named_scope("store"):
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(row_smem, out_ref.at[layer], reduction_op="add")
            _arrive_and_wait(sem, num_ctas, 1 + per_layer * (layer + 1), "layer")  # the kernel's first, then a phase's

            @pl.when(layer + 1 < num_layers)
            def _():
                input_tiles(out_ref.at[layer])
            return count

        lax.fori_loop(0, num_layers, layer_body, jnp.int32(0))
        if router and final_eps is not None:  # x_L final-normed (the model's final norm)
            pl.when(c == 0)(jax.named_scope("final_norm")(
                lambda: norm_rows_out(out_ref.at[num_layers - 1], gf_ref, normed_ref, final_eps)))

        def reset(u, _):  # every reader of this CTA's tiles has passed the last barrier: take its signals back
            kind, tile, first, end, _ = unit(u)
            whole = (first == 0) & (end == gate_boxes)
            signalled = (kind == GATE_UP) & ((whole & publishes) | (jnp.logical_not(whole) & (splits > 0)))
            pl.when(signalled)(lambda: plgpu.semaphore_wait(flags.at[tile], num_layers, decrement=True,
                                                            memory_scope="gpu"))
            return ()

        if publishes or splits:
            lax.fori_loop(0, num_units, reset, ())
        if router:  # every CTA has passed its last wait on routed_sem (it arrived at the last barrier since)
            pl.when(c == 0)(lambda: plgpu.semaphore_wait(routed_sem, routers * num_layers, decrement=True,
                                                         memory_scope="gpu"))
        _release(sem, c, num_ctas, 1 + per_layer * num_layers)

    wg = lax.axis_index("wg")
    pl.when(wg == 0)(compute)
    pl.when(wg == 1)(loads)


def moe_chain(x, weights, ids, w_gate, w_up, w_down, shared, profile_dir: str | None = None):
    """x [D] bf16, weights f32[L, k] / ids i32[L, k] (each layer's routing; E marks an empty slot), every
    layer's routed experts (w_gate, w_up [L, E, D, I], w_down [L, E, I, D]) and shared experts (w_gate, w_up
    [L, D, S], w_down [L, S, D]) -> x_L [D] bf16 with x_{l+1} = bf16(x_l + layer l's experts of x_l): the
    expert phase of the step kernel, L of them in one persistent kernel. The layer's (expert, 64 intermediate
    columns) tiles, as the one-token launch has them (``moe_decode_mgpu``), are dealt to the CTAs (one an SM)
    as ``expert_plan`` says; a producer warpgroup streams each CTA's boxes across units and layers; a tile's h
    goes to the CTAs with its down rows through global memory and a flag; each CTA's partial output rows are
    added to the layer's f32 output by TMA, the residual once, and a grid barrier orders the layer's sums
    before the next layer reads them. Shapes must pass ``moe_supports``."""
    num_layers, top_k = ids.shape
    if weights.shape != ids.shape or num_layers != w_gate.shape[0]:
        raise ValueError(f"moe_chain: weights {weights.shape}, ids {ids.shape}, w_gate {w_gate.shape}; expected "
                         f"weights and ids [L={w_gate.shape[0]}, k]")
    out, _, _, _ = _moe_call(x, (ids.reshape(-1).astype(jnp.int32), weights.reshape(-1).astype(jnp.float32)), None,
                          top_k, (w_gate, w_up, w_down), shared, profile_dir)
    return out


def moe_block_chain(x, norm, router, spec: RouterSpec, top_k: int, w_gate, w_up, w_down, shared,
                    profile_dir: str | None = None):
    """The MoE half of a decoder layer, L of them in one persistent kernel: x_{l+1} = bf16(x_l + experts of
    RMSNorm_l(x_l), routed by the layer's router). x [D] bf16, norm [L, D] (the norm's weights: bf16, or f32
    taken as is), router [L, D, E] (E = 64; bf16, or f32 taken as the sum of two bf16 parts, hi + lo: relative
    error ~2^-17 a weight, against the model's f32 products of bf16 activations; or those parts,
    ``router_parts``), ``spec`` (eps, softmax scores, greedy top-k of ``top_k``), the experts as ``moe_chain``
    -> (x_L [D] bf16, ids i32[L, k], weights f32[L, k]: each layer's routing).

    In the kernel, every CTA norms the rows into its tiles; D / 128 router CTAs multiply the tiles of their K
    step by the router's boxes (streamed by the producer ahead of the layer, like any weights), add their
    partial logits by TMA and count them on a semaphore; once all have, the producer of every CTA routes the
    layer and issues the routed tiles' boxes, while the computing warpgroup runs its shared tiles' products
    (they come first in its plan). Shapes must pass ``moe_supports(..., router=True)``."""
    return _block_call(x, norm, router, spec, top_k, (w_gate, w_up, w_down), shared, profile_dir)


def moe_layer_tail_chain(x, attn, o_proj, norm, router, spec: RouterSpec, top_k: int, w_gate, w_up, w_down, shared,
                         profile_dir: str | None = None):
    """A decoder layer from its attention output on, L of them in one persistent kernel: x_mid = x_l + attn_l @
    o_proj_l, then x_{l+1} = x_mid + experts(RMSNorm_l(x_mid)) as ``moe_block_chain``. attn bf16[L, A] (each
    layer's attention output over its heads, given: the attention phases are not in the kernel yet), o_proj
    bf16[L, A, D]; the rest as ``moe_block_chain`` -> (x_L, ids, weights). The o_proj phase is a GEMV phase
    (``gemv_chain``'s units: 64-column tile x 512-row K range, a CTA each, its sums added by TMA, CTA 0 adding
    x_l) with a grid barrier before the MoE half reads x_mid. Shapes must pass ``moe_supports(...,
    router=True, attention=A)``."""
    num_layers = norm.shape[0]
    if attn.ndim != 2 or o_proj.shape != (num_layers, attn.shape[-1], x.shape[0]) or attn.shape[0] != num_layers:
        raise ValueError(f"moe_layer_tail_chain: attn {attn.shape}, o_proj {o_proj.shape}; expected [L={num_layers}, "
                         f"A] and [L, A, D={x.shape[0]}]")
    return _block_call(x, norm, router, spec, top_k, (w_gate, w_up, w_down), shared, profile_dir, (attn, o_proj))


def moe_layer_chain(x, position, block_table, c_kv, k_pe, attention, attention_spec, norm, router, spec: RouterSpec,
                    top_k: int, w_gate, w_up, w_down, shared, profile_dir: str | None = None, final_norm=None,
                    pdl: bool = False):
    """Whole decoder layers at one token, L of them in one persistent kernel: x_mid = x_l + attention_l(x_l) over
    the paged context, then x_{l+1} = x_mid + experts(RMSNorm_l(x_mid)). The attention's phases are
    ``decode_step_attention.attention_phases`` (position, block_table, c_kv / k_pe [L, N, bs, ...] with the
    tokens before it, ``attention`` the stacked AttentionWeights, rope columns permuted, ``attention_spec``);
    o_proj (``attention.o_proj``) and the MoE half are ``moe_layer_tail_chain``'s; the rest as
    ``moe_block_chain`` -> (x_L, ids, weights, kv [L, 576]: each layer's new latent and rope key, for the
    caller to write into the cache). ``final_norm`` (weights [D], eps): x_L comes back RMSNorm'd by it (the
    model's final norm, done by CTA 0 after the last layer). x [D] comes in the weights' dtype, or in f32 as a
    launch's unrounded sum, which the kernel rounds to the weights' dtype as it reads it (the residual stream's
    rounding; ``dispatch.DENSE_MLP_IN_PLACE``). ``pdl``: the kernel is launched as a programmatic dependent of
    the launch before it (``griddepcontrol.wait`` first thing, so its CTAs may be set up while that launch
    finishes; ``dispatch.STEP_KERNEL_PDL``). Shapes must pass ``moe_supports(..., router=True, attention=H *
    128)`` and ``attention_supports``."""
    num_layers, hidden = norm.shape
    o_proj = attention.o_proj.reshape(num_layers, -1, hidden)
    if attention.norm.shape != (num_layers, hidden):
        raise ValueError(f"moe_layer_chain: the attention norm {attention.norm.shape}; expected [L={num_layers}, "
                         f"D={hidden}]")
    front = attention_operands(position, block_table, c_kv, k_pe, attention, attention_spec)
    return _block_call(x, norm, router, spec, top_k, (w_gate, w_up, w_down), shared, profile_dir, (None, o_proj),
                       front, final_norm, pdl)


def router_parts(router):
    """The router's weights [L, D, E] as the kernel's boxes take them: bf16 [L, parts, D, E], an f32 router as
    two bf16 parts (hi, the rest) whose sum keeps 16 of its mantissa bits, a bf16 router as one. A caller that
    steps many times prepares them once (``DeepseekForCausalLM.prepare_step_kernel``)."""
    if router.ndim != 3 or router.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"router_parts: router {router.dtype}{list(router.shape)}; accepted: [L, D, E] in "
                         "bfloat16 or float32")
    hi = router.astype(jnp.bfloat16)
    parts = (hi,) if router.dtype == jnp.bfloat16 else (hi, (router - hi.astype(jnp.float32)).astype(jnp.bfloat16))
    return jnp.stack(parts, axis=1)


def _block_call(x, norm, router, spec: RouterSpec, top_k: int, routed, shared, profile_dir, attention=(), front=None,
                final_norm=None, pdl: bool = False):
    num_layers, hidden = norm.shape
    if router.ndim == 3:  # the weights themselves: their parts, each call
        router = router_parts(router)
    if router.ndim != 4 or router.shape[0] != num_layers or router.shape[2] != hidden \
            or router.shape[1] not in (1, 2) or router.dtype != jnp.bfloat16:
        raise ValueError(f"moe_block_chain: norm {norm.shape}, router {router.dtype}{list(router.shape)}; "
                         "accepted: the router [L, D, E] in bfloat16 or float32, or its router_parts, bfloat16 "
                         "[L, 1 or 2, D, E]")
    rows = hidden // HALF
    out, (ids, weights), _, front_out = _moe_call(
        x, (norm.astype(jnp.float32).reshape(num_layers, rows, HALF), router), spec, top_k, routed,
        shared, profile_dir, attention, front, final_norm, pdl)
    if front:  # the new cache rows a layer (the attention phases' fourth output)
        return out, ids[:, :top_k], weights[:, :top_k], front_out[3].reshape(num_layers, -1)
    return out, ids[:, :top_k], weights[:, :top_k]


def _fetches_h(plan: np.ndarray, gate_boxes: int) -> bool:
    """Whether some CTA of ``plan`` takes down rows of a tile whose whole gate / up it did not just compute,
    and that is not split by K ranges (so that tile's h must go through global memory): the kernel's own
    test of a local down unit."""
    split = {tile for units in plan for kind, tile, first, end, _ in units
             if kind == GATE_UP and (first, end) != (0, gate_boxes)}
    for units in plan:
        last = -1
        for kind, tile, first, end, _ in units:
            if kind == GATE_UP and (first, end) == (0, gate_boxes):
                last = tile
            elif kind == DOWN and tile != last and tile not in split:
                return True
    return False


def _moe_call(x, extra, router: RouterSpec | None, top_k: int, routed, shared, profile_dir, attention=(), front=None,
              final_norm=None, pdl: bool = False):
    """moe_chain / moe_block_chain / moe_layer_tail_chain / moe_layer_chain's kernel: ``extra`` the routing (ids,
    weights flattened) or, with ``router``, the norm's rows and the router's weights; ``attention`` (with a
    router): each layer's attention output attn [L, A] (None with ``front``) and o_proj [L, A, D] for an o_proj
    phase first; ``front``: ``attention_operands``' (inputs, output types, constants) for the attention phases
    before it; ``final_norm`` (weights [D], eps; with a router): x_L comes back normed by it. -> (x_L, the routing
    or None, x_mid's rows or None, the attention phases' outputs or None)."""
    w_gate, w_up, w_down = routed
    dtype = w_gate.dtype  # the model's (x may come in f32: see moe_layer_chain)
    num_experts, hidden, inter = w_gate.shape[1:]
    num_layers = w_gate.shape[0]
    shared_inter = shared[0].shape[-1]
    if x.shape != (hidden,):
        raise ValueError(f"moe_chain: x {x.shape}, w_gate {w_gate.shape}; expected x [D={hidden}]")
    if EXPERT_PLAN not in PLANS:
        raise ValueError(f"EXPERT_PLAN={EXPERT_PLAN!r}; accepted: {', '.join(PLANS)}")
    if final_norm is not None and (router is None or final_norm[0].shape != (hidden,)):
        raise ValueError(f"moe_chain: final_norm weights {final_norm[0].shape} without a router or not [D={hidden}]; "
                         "accepted: the in-kernel router's chains with the final norm's weights [D]")
    if router is not None and extra[1].shape[-1] != HALF:
        raise ValueError(f"moe_block_chain: {extra[1].shape[-1]} experts; the in-kernel router takes {HALF}")
    routed_tiles = inter // HALF
    num_tiles = top_k * routed_tiles + shared_inter // HALF
    num_ctas = min(num_sms(), num_tiles)
    rows = hidden // HALF
    plan = expert_plan(num_tiles, num_ctas, hidden // STEP, hidden // STEP, EXPERT_PLAN,
                       shared_from=top_k * routed_tiles if router is not None else None)
    splits = split_parts(num_tiles, num_ctas) if EXPERT_PLAN == "split" else 0
    attention_dim = attention[1].shape[1] if attention else 0
    kernel = functools.partial(_moe_body, num_layers=num_layers, top_k=top_k, num_experts=num_experts,
                               routed_tiles=routed_tiles, num_tiles=num_tiles, num_ctas=num_ctas, units=plan.shape[1],
                               router=router, publishes=_fetches_h(plan, 2 * (hidden // STEP)), splits=splits,
                               attention=attention_dim, front=front[2] if front else None,
                               final_eps=None if final_norm is None else float(final_norm[1]), pdl=pdl)
    f32 = jnp.float32
    out_type = [jax.ShapeDtypeStruct((num_layers, rows, HALF), f32),
                jax.ShapeDtypeStruct((num_layers, num_tiles, max(splits, 1), 2, HALF), f32)]
    if router is not None:
        out_type += [jax.ShapeDtypeStruct((num_layers, 8, HALF), f32),
                     jax.ShapeDtypeStruct((num_layers, ROUTE_SLOTS), jnp.int32),
                     jax.ShapeDtypeStruct((num_layers, ROUTE_SLOTS), f32)]
    x_rows = x.astype(f32).reshape(rows, HALF)
    inputs = ((*extra[:2], x_rows, *routed, *shared) if router is None else (x_rows, *routed, *shared, *extra))
    if front:
        inputs += (attention[1], *front[0])
        out_type += [jax.ShapeDtypeStruct((num_layers, rows, HALF), f32), *front[1]]  # x_mid's rows, the phases'
    elif attention:
        attn, o_proj = attention
        inputs += (attn.astype(f32).reshape(num_layers, attention_dim // HALF, HALF), o_proj)
        out_type.append(jax.ShapeDtypeStruct((num_layers, rows, HALF), f32))  # x_mid's rows
    if final_norm is not None:  # the final norm's weights in, x_L normed out (last of each)
        inputs += (final_norm[0].astype(f32).reshape(rows, HALF),)
        out_type.append(jax.ShapeDtypeStruct((rows, HALF), dtype))
    outs = plgpu.kernel(
        kernel,
        out_type=tuple(out_type),
        scratch_types=_moe_scratch(hidden, dtype, router is not None, splits,
                                   front[2]["num_heads"] if front else 0),
        grid=(num_ctas,),
        grid_names=("c",),
        num_threads=2,  # computing, producer
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            # the trace's buffer is shared memory: 1024 entries overflow the MoE half's (round 22), and 512 its
            # then three warpgroups' (384 hold 8 layers' ~15 scopes a warpgroup); 384 overflow the whole layer's
            # by 5.2 KiB (round 24), 256 hold 2 layers; bounds-checked, a longer chain's trace (the engine's 26
            # layers) stops when full instead of writing past it (an illegal access, session 44)
            approx_math=True, **({"profile_space": 256 if front else 384, "profile_dir": profile_dir,
                                  "profile_bounds_check": True} if profile_dir else {})),
    )(jnp.asarray(plan.reshape(-1)), *inputs)
    result = outs[0][-1].reshape(hidden).astype(dtype) if final_norm is None else outs[-1].reshape(hidden)
    return (result, (outs[3], outs[4]) if router is not None else None, outs[5] if attention else None,
            outs[6:6 + len(front[1])] if front else None)


def moe_chain_reference(x, weights, ids, w_gate, w_up, w_down, shared):
    """The same chain with ``moe_decode_reference`` a layer (f32 sums, the residual added before rounding)."""
    from pallas_kernels.moe_decode import moe_decode_reference

    for layer in range(ids.shape[0]):
        x = moe_decode_reference(x[None], weights[layer][None], ids[layer][None], w_gate, w_up, w_down, layer,
                                 shared, residual=x[None])[0]
    return x


def moe_block_chain_reference(x, norm, router, spec: RouterSpec, top_k: int, w_gate, w_up, w_down, shared):
    """The same chain in jnp: the model's RMSNorm, the router's f32 products (at full f32 precision; the router
    [L, D, E], or its ``router_parts``), ``route_reference`` (softmax, greedy), ``moe_decode_reference`` with the
    residual -> (x_L, ids, weights)."""
    from pallas_kernels.moe_decode import moe_decode_reference
    from pallas_kernels.moe_routing import RoutingSpec, route_reference

    routing = RoutingSpec(top_k=top_k, norm_topk_prob=spec.norm_topk_prob,
                          routed_scaling_factor=spec.routed_scaling_factor)
    if router.ndim == 4:  # router_parts: their f32 sum
        router = router.astype(jnp.float32).sum(axis=1)
    all_ids, all_weights = [], []
    for layer in range(norm.shape[0]):
        normed = rms_norm(x[None], norm[layer], spec.eps)
        logits = jnp.dot(normed.astype(jnp.float32), router[layer], precision=lax.Precision.HIGHEST)
        weights, ids = route_reference(logits, None, routing)
        x = moe_decode_reference(normed, weights, ids, w_gate, w_up, w_down, layer, shared, residual=x[None])[0]
        all_ids.append(ids[0])
        all_weights.append(weights[0])
    return x, jnp.stack(all_ids), jnp.stack(all_weights)


def moe_layer_tail_chain_reference(x, attn, o_proj, norm, router, spec: RouterSpec, top_k: int, w_gate, w_up, w_down,
                                   shared):
    """The same chain in jnp: x_mid = bf16(x_l + attn_l @ o_proj_l) (f32 products), then
    ``moe_block_chain_reference``'s layer -> (x_L, ids, weights)."""
    all_ids, all_weights = [], []
    for layer in range(norm.shape[0]):
        x = (x.astype(jnp.float32) + jnp.dot(attn[layer].astype(jnp.float32), o_proj[layer].astype(jnp.float32),
                                             precision=lax.Precision.HIGHEST)).astype(x.dtype)
        one = lambda a: a[layer:layer + 1]
        x, ids, weights = moe_block_chain_reference(x, one(norm), one(router), spec, top_k, one(w_gate), one(w_up),
                                                    one(w_down), tuple(one(w) for w in shared))
        all_ids.append(ids[0])
        all_weights.append(weights[0])
    return x, jnp.stack(all_ids), jnp.stack(all_weights)


def moe_layer_chain_reference(x, position, block_table, c_kv, k_pe, attention, attention_spec, norm, router,
                              spec: RouterSpec, top_k: int, w_gate, w_up, w_down, shared, final_norm=None):
    """The same layers in jnp: ``attention_half_reference`` (the model's attention, the cache written), then
    ``moe_block_chain_reference``'s layer -> (x_L, ids, weights, kv [L, 576]), x_L RMSNorm'd by ``final_norm``
    (weights [D], eps) when given. An f32 x is rounded to the weights' dtype first, as the kernel reads it."""
    x = x.astype(w_gate.dtype)
    all_ids, all_weights, rows = [], [], []
    for layer in range(norm.shape[0]):
        one = lambda a: a[layer:layer + 1]
        x, row = attention_layer_reference(x, position, block_table, c_kv, k_pe, attention, attention_spec, layer)
        rows.append(row)
        x, ids, weights = moe_block_chain_reference(x, one(norm), one(router), spec, top_k, one(w_gate), one(w_up),
                                                    one(w_down), tuple(one(w) for w in shared))
        all_ids.append(ids[0])
        all_weights.append(weights[0])
    if final_norm is not None:
        x = rms_norm(x, final_norm[0].astype(x.dtype), final_norm[1])
    return x, jnp.stack(all_ids), jnp.stack(all_weights), jnp.stack(rows)
