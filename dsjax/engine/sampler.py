"""Token sampling on device: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Runs inside the runner's jitted step on the [S, vocab] logits of the sequences that sample. Every
row has its own PRNG stream, key = fold_in(key(seed), number of tokens the request has generated),
so a seeded request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingArrays(NamedTuple):
    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    seeds: jax.Array  # u32[S]
    counters: jax.Array  # i32[S] tokens generated so far by the request
    mask_eos: jax.Array  # bool[S] min_tokens not reached: EOS may not be drawn
    num_logprobs: jax.Array  # i32[S] top log-probabilities the request wants (0: none)


class SampleResult(NamedTuple):
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S] log-probability of the drawn token under the model's distribution
    # i32[S, K] / f32[S, K], or None when no row asked for top log-probabilities: the program then has no such
    # outputs (an empty constant output is copied into its buffer on every call, a device copy a step)
    top_ids: jax.Array | None
    top_logprobs: jax.Array | None


def _filtered_sample(logits, arrays: SamplingArrays, keys):
    """Temperature, then top-k and top-p over the sorted distribution, then a categorical draw over
    the kept tokens in vocabulary order: a row that filters nothing draws exactly what _plain_sample
    draws, so a seeded request's tokens do not depend on its batch neighbours' filters."""
    scaled = logits / jnp.maximum(arrays.temperature, 1e-6)[:, None]
    sorted_logits = jax.lax.top_k(scaled, scaled.shape[-1])[0]  # descending
    rank = jnp.arange(scaled.shape[-1])[None, :]
    k = jnp.where(arrays.top_k > 0, arrays.top_k, scaled.shape[-1])[:, None]
    sorted_logits = jnp.where(rank < k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = (rank < k) & (mass_before < arrays.top_p[:, None])  # keeps rank 0
    cutoff = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)  # ties at it stay
    return jax.vmap(jax.random.categorical)(keys, jnp.where(scaled >= cutoff, scaled, -jnp.inf))


def _plain_sample(logits, arrays: SamplingArrays, keys):
    scaled = logits / jnp.maximum(arrays.temperature, 1e-6)[:, None]
    return jax.vmap(jax.random.categorical)(keys, scaled)


_CHUNK = 512  # vocabulary entries a first-stage partial of _best_and_sum_exp covers
# Whether sample() takes the argmax, max and sum of exponentials from _best_and_sum_exp's one pass (True) or
# from jnp.argmax / max and a second pass for the sum (XLA fuses the argmax and the max). Read at trace time. Off
# until timed on the H200 (decode_profile.md round 34: the greedy sampler was five of the batch-1 step's 26
# launches; ``run_h200.sh sampler-ab``).
ONE_PASS = False


def _combine(a, b):
    """Two partials (max, sum of exp(x - max), index of the max) of an online softmax as one: each sum rescaled to
    the larger max, ties to the lower index (as jnp.argmax)."""
    (max_a, sum_a, at_a), (max_b, sum_b, at_b) = a, b
    top = jnp.maximum(max_a, max_b)
    # a side still at -inf (the initial value, or masked logits) adds nothing; exp(-inf - -inf) would be nan
    scaled = lambda m, s: jnp.where(m == -jnp.inf, 0.0, s * jnp.exp(m - top))
    first = (max_a > max_b) | ((max_a == max_b) & (at_a < at_b))
    return top, scaled(max_a, sum_a) + scaled(max_b, sum_b), jnp.where(first, at_a, at_b)


def _best_and_sum_exp(logits):
    """logits f32[S, V] -> (argmax i32[S], max f32[S], sum of exp(logits - max) f32[S]): an online softmax's
    reduction, one pass over the vocabulary where argmax and the sum take two (on the GPU two launches, the
    chunks' partials, then theirs, where those take four). Two explicit stages of ``_CHUNK`` entries a partial
    (the vocabulary padded with -inf) keep the sums as accurate as a plain sum's where a backend reduces a row
    in order (the CPU: one ordered sum over 70k entries was off by ~1e-4)."""
    rows, vocab = logits.shape
    chunks = -(-vocab // _CHUNK)
    padded = jnp.pad(logits, ((0, 0), (0, chunks * _CHUNK - vocab)), constant_values=-jnp.inf)
    padded = padded.reshape(rows, chunks, _CHUNK)
    index = jax.lax.broadcasted_iota(jnp.int32, padded.shape, 1) * _CHUNK + jax.lax.broadcasted_iota(
        jnp.int32, padded.shape, 2)
    init = (jnp.array(-jnp.inf, logits.dtype), jnp.array(0, logits.dtype), jnp.array(0, jnp.int32))
    partials = jax.lax.reduce((padded, jnp.ones_like(padded), index), init, _combine, (2,))
    top, sum_exp, best = jax.lax.reduce(partials, init, _combine, (1,))
    return best, top, sum_exp


def sample(logits, arrays: SamplingArrays, eos_token_ids: tuple[int, ...], num_top_logprobs: int, *,
           filtered: bool = True, logprobs: bool = True, greedy: bool = False) -> SampleResult:
    """logits f32[S, V] -> SampleResult.

    filtered / logprobs / greedy (static, decided on the host from the batch's settings): whether any row
    uses top-k / top-p (the sorted path; rows that filter nothing draw as without it), whether any wants
    top log-probabilities (else top_ids / top_logprobs are None), and whether every row is greedy
    (temperature 0: no keys, no draw over the vocabulary; the same result). Static, not lax.cond: a
    conditional makes the GPU runtime read its predicate back, blocking the host mid-step."""
    if eos_token_ids:
        eos = jnp.zeros((logits.shape[-1],), bool).at[jnp.asarray(eos_token_ids)].set(True)
        logits = jnp.where(arrays.mask_eos[:, None] & eos[None, :], -jnp.inf, logits)
    if ONE_PASS:
        best, top, sum_exp = _best_and_sum_exp(logits)
    else:
        best, top = jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.max(logits, axis=-1)
        sum_exp = jnp.sum(jnp.exp(logits - top[:, None]), axis=-1)
    if greedy:
        token_ids = best
    else:
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(arrays.seeds, arrays.counters)
        drawn = (_filtered_sample if filtered else _plain_sample)(logits, arrays, keys)
        token_ids = jnp.where(arrays.temperature > 0, drawn, best).astype(jnp.int32)
    log_sum = jnp.log(sum_exp)  # log_softmax(x) = (x - max) - log_sum, as jax.nn.log_softmax forms it
    if greedy:  # the drawn token is the max, (max - max) - log_sum: no gather
        chosen = -log_sum
    else:
        chosen = (jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0] - top) - log_sum
    if not logprobs:
        return SampleResult(token_ids, chosen, None, None)
    top_logprobs, top_ids = jax.lax.top_k((logits - top[:, None]) - log_sum[:, None], num_top_logprobs)
    return SampleResult(token_ids, chosen, top_ids.astype(jnp.int32), top_logprobs)
