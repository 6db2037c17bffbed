"""Mixture-of-experts routing: router logits -> top-k expert ids and weights (``moe_sort`` then orders
the assignments by expert for the grouped expert GEMMs).

Covers DeepSeek-V2 (softmax, greedy or group-limited greedy) and DeepSeek-V3 (sigmoid scores,
e_score_correction_bias for the choice only, group-limited top-k by the sum of each group's top two,
weights from the unbiased scores, optional renormalization, routed_scaling_factor).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import inv_rms, scale_rows


class RoutingSpec(NamedTuple):
    """Static routing choices (hashable, so it can be a jit static argument)."""

    top_k: int
    scoring_func: str = "softmax"  # softmax | sigmoid
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


def route_reference(logits, bias, spec: RoutingSpec):
    """logits f32[T, E], bias f32[E] or None -> (weights f32[T, k], expert ids i32[T, k]).

    Ties go to the lower expert id (``lax.top_k`` order), for groups and experts alike.
    """
    logits = logits.astype(jnp.float32)
    num_tokens, num_experts = logits.shape
    if spec.scoring_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)

    if spec.topk_method == "noaux_tc":
        choice = scores + bias.astype(jnp.float32) if bias is not None else scores
        grouped = choice.reshape(num_tokens, spec.n_group, num_experts // spec.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1) if grouped.shape[-1] > 1 else grouped[..., 0]
        masked_value = -jnp.inf
    elif spec.topk_method == "group_limited_greedy":
        choice = scores
        group_scores = choice.reshape(num_tokens, spec.n_group, -1).max(-1)
        masked_value = 0.0  # as transformers' DeepseekV2 does
    else:
        choice, group_scores, masked_value = scores, None, None

    if group_scores is not None:
        _, top_groups = jax.lax.top_k(group_scores, spec.topk_group)  # [T, topk_group]
        group_mask = jnp.zeros((num_tokens, spec.n_group), bool).at[
            jnp.arange(num_tokens)[:, None], top_groups].set(True)
        expert_mask = jnp.repeat(group_mask, num_experts // spec.n_group, axis=1)
        choice = jnp.where(expert_mask, choice, masked_value)

    _, ids = jax.lax.top_k(choice, spec.top_k)
    # Weights come from the unbiased scores (V3); for V2 group-limited they are the masked scores.
    weight_source = scores if spec.topk_method == "noaux_tc" else choice
    weights = jnp.take_along_axis(weight_source, ids, axis=-1)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------
# Pallas routing kernel
# ----------------------------------------------------------------------------------------------------

# Tokens per program and warps, keyed by the padded expert count: a program keeps a few
# [block_tokens, E] tiles live in registers, so wider routers take fewer tokens.
_ROUTE_BLOCKS = {64: (64, 4), 128: (32, 4), 256: (32, 8), 512: (16, 8)}
_MIN_PROGRAMS = 64  # about half the SMs of an H100/H200: below this a route is launch- and latency-bound
_NEG_INF = float("-inf")
_TAKEN = jnp.iinfo(jnp.int32).min  # below every ordered key, -inf's included


class NormRows(NamedTuple):
    """The MoE sublayer's RMSNorm finished in the routing kernel (``route(..., norm_rows=...)``): the
    router's products came from rows x * g (``stacked_gemvs`` partials), so the logits still lack each
    row's 1 / rms, and the experts still need the normed rows."""

    x: jax.Array  # the raw rows [T, D]
    norm: jax.Array  # every layer's RMSNorm weights g [L, D]
    layer: jax.Array  # i32 scalar: the layer of ``norm``


def route_norm_reference(logits, bias, spec: RoutingSpec, rows: NormRows, eps: float):
    """``route`` with ``norm_rows``: logits f32[T, E + 1] (the router's products of x * g, then each row's
    sum of squares of x) -> (weights, ids, normed rows [T, D] in x's dtype), as ``stacked_gemvs``
    scales its normed products and rows."""
    scale = inv_rms(logits[:, -1], rows.x.shape[-1], eps)[:, None]
    weights, ids = route_reference(logits[:, :-1] * scale, bias, spec)
    g = jax.lax.dynamic_index_in_dim(rows.norm, rows.layer, keepdims=False)
    return weights, ids, scale_rows(rows.x, g, scale)


def _ordered_key(values):
    """f32 -> i32 with the same order (-inf above _TAKEN); +-0 made equal first, as the compare is."""
    bits = jax.lax.bitcast_convert_type(values + 0.0, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_value(keys):
    return jax.lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ 0x7FFFFFFF, keys), jnp.float32)


def _first_index(hit, index, sentinel):
    """Lowest index where hit is set (lax.top_k's tie order); sentinel where nothing is."""
    return jnp.min(jnp.where(hit, index, sentinel), axis=-1)


def _top_groups(group_scores, topk_group):
    """group_scores f32[bt, G] (finite) -> bool[bt, G], the topk_group best groups, ties to lower ids."""
    group = jax.lax.broadcasted_iota(jnp.int32, group_scores.shape, 1)
    chosen = jnp.zeros(group_scores.shape, jnp.bool_)
    for _ in range(topk_group):
        best = jnp.max(group_scores, axis=-1, keepdims=True)
        hit = group == _first_index(group_scores == best, group, group_scores.shape[1])[:, None]
        chosen = chosen | hit
        group_scores = jnp.where(hit, _NEG_INF, group_scores)
    return chosen


def _allowed_experts(choice, col, spec: RoutingSpec, num_experts: int):
    """bool[bt, Ep]: experts inside each token's topk_group best groups."""
    block_tokens, padded_experts = choice.shape
    group_size = num_experts // spec.n_group
    two_best = spec.topk_method == "noaux_tc" and group_size > 1  # V3 ranks groups by top-2 sum
    if padded_experts == num_experts and group_size == pl.next_power_of_2(group_size):
        # Power-of-two groups (V3: 8 x 32): view the row as [G, group] and reduce all groups at once.
        grouped = choice.reshape(block_tokens, spec.n_group, group_size)
        best = jnp.max(grouped, axis=-1)  # [bt, G]
        if two_best:
            member = jax.lax.broadcasted_iota(jnp.int32, grouped.shape, 2)
            first = _first_index(grouped == best[..., None], member, group_size)
            best = best + jnp.max(jnp.where(member == first[..., None], _NEG_INF, grouped), axis=-1)
        chosen = _top_groups(best, spec.topk_group)
        return jnp.broadcast_to(chosen[..., None], grouped.shape).reshape(choice.shape)
    # Other group sizes (V2: 8 x 20): one masked reduction per group; [bt, G] assembled by column.
    expert_group = col // group_size  # padding columns land past the last group
    padded_groups = pl.next_power_of_2(spec.n_group)
    group = jax.lax.broadcasted_iota(jnp.int32, (block_tokens, padded_groups), 1)
    group_scores = jnp.full((block_tokens, padded_groups), _NEG_INF, jnp.float32)
    for g in range(spec.n_group):
        member = expert_group == g
        best = jnp.max(jnp.where(member, choice, _NEG_INF), axis=-1)
        if two_best:
            first = _first_index(member & (choice == best[:, None]), col, padded_experts)
            best = best + jnp.max(jnp.where(member & (col != first[:, None]), choice, _NEG_INF),
                                  axis=-1)
        group_scores = jnp.where(group == g, best[:, None], group_scores)
    chosen = _top_groups(group_scores, spec.topk_group)
    chosen = chosen.astype(jnp.int32)  # Triton reduces no bools
    allowed = jnp.zeros(choice.shape, jnp.bool_)
    for g in range(spec.n_group):
        chosen_g = jnp.max(jnp.where(group == g, chosen, 0), axis=-1) > 0  # column g, [bt]
        allowed = allowed | ((expert_group == g) & chosen_g[:, None])
    return allowed


def _route_kernel(*refs, spec: RoutingSpec, num_tokens: int, num_experts: int, block_tokens: int,
                  has_bias: bool, norm_eps: float | None, depth: int, block_d: int, rows_programs: int):
    refs = list(refs)
    logits_ref = refs.pop(0)
    bias_ref = refs.pop(0) if has_bias else None
    x_ref, norm_ref, layer_ref = (refs.pop(0) for _ in range(3)) if norm_eps is not None else (None,) * 3
    weights_ref, ids_ref, *normed_ref = refs
    # logits_ref [T, E] (whole array; with norm_eps [T, E + 1], the rows' sums of squares last), bias_ref
    # f32[E]; with norm_eps x_ref [T, D], norm_ref [L, D], layer_ref i32[1]; weights_ref f32[T, k], ids_ref
    # i32[T, k], with norm_eps normed_ref [T, D]. With rows_programs, program (i, 0) routes token block i
    # and programs (i, 1..rows_programs) write depth / rows_programs columns each of its normed rows.
    padded_experts = pl.next_power_of_2(num_experts)
    padded_k = pl.next_power_of_2(spec.top_k)
    token0 = pl.program_id(0) * block_tokens
    rows = token0 + jnp.arange(block_tokens)[:, None]  # [bt, 1]
    token_ok = rows < num_tokens
    col = jnp.arange(padded_experts)[None, :]  # [1, Ep]
    col_ok = col < num_experts

    # Padding experts read -inf, which softmax and sigmoid both send to a score of 0.
    logits = plgpu.load(logits_ref.at[pl.ds(token0, block_tokens), pl.ds(0, padded_experts)],
                        mask=token_ok & col_ok, other=jnp.where(col_ok, 0.0, _NEG_INF))
    logits = logits.astype(jnp.float32)  # [bt, Ep]
    scale = None
    if norm_eps is not None:  # the RMSNorm's 1 / rms on the logits, and the normed rows for the experts
        token_rows = pl.ds(token0, block_tokens)
        squares = plgpu.load(logits_ref.at[token_rows, pl.ds(num_experts, 1)], mask=token_ok, other=0.0)
        scale = inv_rms(squares.astype(jnp.float32), depth, norm_eps)  # [bt, 1]
        logits = logits * scale  # the padding experts' -inf stays -inf
        layer = layer_ref[0]

        def write_rows(first, columns: int):  # columns [first, first + columns); block_d divides both
            for start in range(0, columns, block_d):
                cols = pl.ds(first + start, block_d)
                x = plgpu.load(x_ref.at[token_rows, cols], mask=token_ok, other=0.0)
                g = plgpu.load(norm_ref.at[layer, cols])[None, :]
                scaled = (x.astype(jnp.float32) * scale).astype(x_ref.dtype).astype(jnp.float32)
                plgpu.store(normed_ref[0].at[token_rows, cols],
                            (g.astype(jnp.float32) * scaled).astype(normed_ref[0].dtype), mask=token_ok)

        if not rows_programs:
            write_rows(0, depth)
        else:
            part, columns = pl.program_id(1), depth // rows_programs

            @pl.when(part > 0)
            def _():
                write_rows(pl.multiple_of((part - 1) * columns, block_d), columns)

    route_block = functools.partial(
        _route_block, logits, scale, logits_ref, bias_ref, weights_ref, ids_ref, rows=rows, token0=token0,
        token_ok=token_ok, col=col, col_ok=col_ok, spec=spec, num_tokens=num_tokens, num_experts=num_experts,
        block_tokens=block_tokens, padded_experts=padded_experts, padded_k=padded_k)
    if rows_programs:
        pl.when(pl.program_id(1) == 0)(route_block)
    else:
        route_block()


def _route_block(logits, scale, logits_ref, bias_ref, weights_ref, ids_ref, *, rows, token0, token_ok, col, col_ok,
                 spec: RoutingSpec, num_tokens: int, num_experts: int, block_tokens: int, padded_experts: int,
                 padded_k: int):
    """Scores, top-k and weights of one token block's logits [bt, Ep] (already times 1 / rms with a
    ``scale``) into weights_ref / ids_ref."""
    has_bias = bias_ref is not None
    if spec.scoring_func == "softmax":
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        row_sum = jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True)
        score_of = lambda l: jnp.exp(l - row_max) / row_sum  # as jax.nn.softmax computes it
    else:
        score_of = lambda l: 1.0 / (1.0 + jnp.exp(-l))  # as lax.logistic lowers
    scores = score_of(logits)
    choice = scores
    if has_bias:
        bias = plgpu.load(bias_ref.at[pl.ds(0, padded_experts)], mask=col_ok[0], other=0.0)
        choice = scores + bias.astype(jnp.float32)[None, :]
    if spec.topk_method != "greedy":
        masked_value = _NEG_INF if spec.topk_method == "noaux_tc" else 0.0
        choice = jnp.where(_allowed_experts(choice, col, spec, num_experts), choice, masked_value)

    # k rounds of argmax on order-preserving int keys: a picked expert drops to _TAKEN, below even
    # -inf, so masked (-inf) experts stay pickable in the reference's order.
    keys = jnp.where(col_ok, _ordered_key(choice), _TAKEN)
    slot = jnp.arange(padded_k)[None, :]  # [1, k_pad]
    ids = jnp.zeros((block_tokens, padded_k), jnp.int32)
    weights = jnp.zeros((block_tokens, padded_k), jnp.float32)
    for j in range(spec.top_k):
        best = jnp.max(keys, axis=-1, keepdims=True)
        expert = _first_index(keys == best, col, padded_experts)[:, None]  # [bt, 1]
        keys = jnp.where(col == expert, _TAKEN, keys)
        ids = jnp.where(slot == j, expert, ids)
        weights = jnp.where(slot == j, _key_value(best), weights)
    if spec.topk_method == "noaux_tc":
        # Weights come from the unbiased scores: recompute them from the k picked logits (an L2 hit).
        picked = plgpu.load(logits_ref.at[jnp.minimum(rows, num_tokens - 1), ids]).astype(jnp.float32)
        if scale is not None:
            picked = picked * scale
        weights = jnp.where(slot < spec.top_k, score_of(picked), 0.0)
    if spec.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * spec.routed_scaling_factor
    # Stored straight into [T, k] (the padding slots masked off): a [T, k_pad] output would need an
    # XLA slice copy for each consumer kernel.
    out_tile = (pl.ds(token0, block_tokens), pl.ds(0, padded_k))
    out_ok = token_ok & (slot < spec.top_k)
    plgpu.store(weights_ref.at[out_tile], weights, mask=out_ok)
    plgpu.store(ids_ref.at[out_tile], ids, mask=out_ok)


def _check_spec(spec: RoutingSpec, num_experts: int):
    if spec.scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func={spec.scoring_func!r}; expected 'softmax' or 'sigmoid'")
    if spec.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"topk_method={spec.topk_method!r}; expected greedy, group_limited_greedy "
                         "or noaux_tc")
    if not 1 <= spec.top_k <= num_experts:
        raise ValueError(f"top_k={spec.top_k} must be in [1, num_experts={num_experts}]")
    if spec.topk_method != "greedy":
        if num_experts % spec.n_group:
            raise ValueError(f"n_group={spec.n_group} must divide num_experts={num_experts}")
        if not 1 <= spec.topk_group <= spec.n_group:
            raise ValueError(f"topk_group={spec.topk_group} must be in [1, n_group={spec.n_group}]")


NORM_BLOCK_D = 512  # columns of the normed rows a step writes at most (route's norm_rows; a divisor of D)


@functools.partial(jax.jit, static_argnames=("spec", "norm_eps", "rows_programs", "block_tokens", "num_warps",
                                             "interpret"))
def route(logits, bias, spec: RoutingSpec, *, norm_rows: NormRows | None = None, norm_eps: float | None = None,
          rows_programs: int = 0, block_tokens: int | None = None, num_warps: int | None = None,
          interpret: bool = False):
    """Fused router: logits [T, E], bias f32[E] or None -> (weights f32[T, k], ids i32[T, k]).

    Same results as ``route_reference`` (ids exactly, ties to the lower expert or group id), in one
    pass over the logits: each program holds block_tokens full rows of scores in registers.

    ``norm_rows`` (a ``NormRows``) with ``norm_eps``: the MoE sublayer's RMSNorm finishes here instead
    of in XLA launches: logits are [T, E + 1], the router's products of x * g and then each row's sum
    of squares of x; the logits are scaled by 1 / rms before scoring and the normed rows [T, D] come
    back third (``route_norm_reference``). ``rows_programs`` > 0: the normed rows are written by that
    many programs of their own a token block, depth / rows_programs columns each, beside the program
    that routes (which then does not wait on the rows' loads); 0 (the default): by the routing program.
    """
    num_tokens, num_experts = logits.shape
    if (norm_rows is None) != (norm_eps is None):
        raise ValueError(f"route: norm_rows and norm_eps come together; got norm_eps={norm_eps}")
    if norm_rows is not None:
        num_experts -= 1  # the last column is the rows' sums of squares
        if norm_rows.x.shape[0] != num_tokens or norm_rows.norm.shape[-1] != norm_rows.x.shape[-1]:
            raise ValueError(f"route: norm_rows x {norm_rows.x.shape} / norm {norm_rows.norm.shape} do not match "
                             f"logits {logits.shape}; expected x [T={num_tokens}, D] and norm [L, D]")
    _check_spec(spec, num_experts)
    depth = norm_rows.x.shape[-1] if norm_rows is not None else 0
    if rows_programs and (norm_rows is None or rows_programs < 0 or depth % rows_programs):
        raise ValueError(f"route: rows_programs={rows_programs} splits the normed rows' {depth} columns; it needs "
                         "norm_rows and must divide their width")
    padded_experts = pl.next_power_of_2(num_experts)
    if padded_experts > 512:
        raise ValueError(f"num_experts={num_experts}: the routing kernel holds whole rows, up to 512")
    default_tokens, default_warps = _ROUTE_BLOCKS.get(max(64, padded_experts), (16, 8))
    # Small batches (decode) take smaller blocks so the grid still spreads over the SMs.
    spread = max(8, pl.next_power_of_2(pl.cdiv(num_tokens, _MIN_PROGRAMS)))
    block_tokens = block_tokens or min(default_tokens, spread)
    has_bias = spec.topk_method == "noaux_tc" and bias is not None
    kernel = functools.partial(_route_kernel, spec=spec, num_tokens=num_tokens, num_experts=num_experts,
                               block_tokens=block_tokens, has_bias=has_bias,
                               norm_eps=norm_eps, depth=depth, rows_programs=rows_programs,
                               block_d=math.gcd(depth // max(rows_programs, 1), NORM_BLOCK_D))
    out_shape = [jax.ShapeDtypeStruct((num_tokens, spec.top_k), jnp.float32),
                 jax.ShapeDtypeStruct((num_tokens, spec.top_k), jnp.int32)]
    extra = []
    if norm_rows is not None:
        out_shape.append(jax.ShapeDtypeStruct(norm_rows.x.shape, norm_rows.x.dtype))
        extra = [norm_rows.x, norm_rows.norm, jnp.asarray(norm_rows.layer, jnp.int32).reshape(1)]
    return tuple(pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block_tokens), *((1 + rows_programs,) if rows_programs else ())),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or default_warps, num_stages=1),
        interpret=interpret,
        name="moe_route_norm" if norm_rows is not None else "moe_route",
    )(logits, *([bias] if has_bias else []), *extra))
