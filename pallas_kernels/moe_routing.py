"""Mixture-of-experts routing: router logits -> top-k expert ids and weights, plus the expert-sorted
token permutation that grouped expert GEMMs consume.

Covers DeepSeek-V2 (softmax, greedy or group-limited greedy) and DeepSeek-V3 (sigmoid scores,
e_score_correction_bias for the choice only, group-limited top-k by the sum of each group's top two,
weights from the unbiased scores, optional renormalization, routed_scaling_factor).
"""
from __future__ import annotations
from typing import NamedTuple
import jax
import jax.numpy as jnp


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


def sort_by_expert_reference(ids, num_experts: int):
    """ids i32[T, k] -> (order i32[T*k], group_sizes i32[E]).

    ``order`` lists flat (token, slot) assignment indices sorted by expert (stable, so within an
    expert tokens keep their order); token index = order // k. ``group_sizes[e]`` counts rows of expert e.
    """
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, group_sizes
