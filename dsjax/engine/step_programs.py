"""What one engine step computes, as the functions the runner traces and compiles (``ModelRunner`` owns the
compiled programs, the cache and the launches; nothing here jits or touches the device).

- ``forward``: one rank's forward over its packed tokens -> (its cache, its rows' logits).
- ``sample``: the rows sampled (``dsjax.engine.sampler``) and gathered from every rank.
- ``forward_greedy``: both as one program, for greedy steps without log-probabilities (``runner.GREEDY_IN_FORWARD``).
- ``forward_steps``: a multi-step chunk, ``num_scheduler_steps`` forward + sample steps in one program.

Without a mesh each takes the step's inputs as one int32 vector (``StepLayout.pack``) and slices it apart here.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import EngineConfig
from dsjax.engine.sampler import SamplingArrays, sample
from dsjax.engine.step_inputs import StepInputs, StepLayout
from dsjax.parallel.collectives import gather_batch


class StepPrograms:
    """The step's traced functions over the model ``graphdef`` whose weights come as a flat list
    (``state_treedef``'s leaves). ``bucket_sizes()``: the runner's buckets now (a packed vector's length names its
    bucket among them); ``packs``: inputs come as ``StepLayout.pack``'s vector (no mesh)."""

    def __init__(self, graphdef, state_treedef, layout: StepLayout, config: EngineConfig, eos_token_ids: tuple,
                 num_shards: int, packs: bool, bucket_sizes: Callable[[], tuple]):
        self.graphdef, self.state_treedef = graphdef, state_treedef
        self.layout, self.config, self.eos_token_ids = layout, config, eos_token_ids
        self.num_shards, self.packs, self.bucket_sizes = num_shards, packs, bucket_sizes

    def forward(self, state_leaves, cache, inputs, last_tokens):
        """One rank's forward (all of it without a mesh): its tokens, its cache slice, the logits of its
        rows. state_leaves: the weights' state flattened; inputs: StepInputs (no sampling), or them packed
        (``StepLayout.pack``); last_tokens: the previous step's sampled tokens, every rank's (replicated)."""
        if self.packs:
            inputs = self.layout.unpack(inputs, self.bucket_sizes())
        model, tokens = self.model_and_tokens(state_leaves, inputs, last_tokens)
        hidden, cache = model.forward_paged(tokens, cache, inputs.batch)
        return cache, model.compute_logits(hidden[inputs.logits_indices])

    def model_and_tokens(self, state_leaves, inputs: StepInputs, last_tokens):
        """The model over the flat weights, and the step's tokens: a pending one (token_sources >= 0) taken from the
        previous step's last_tokens."""
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self.state_treedef, state_leaves))
        sources = inputs.token_sources
        return model, jnp.where(sources >= 0, last_tokens[jnp.maximum(sources, 0)], inputs.tokens)

    def sample(self, logits, sampling: SamplingArrays, *, filtered: bool, logprobs: bool, greedy: bool):
        """One rank's rows sampled; -> every rank's SampleResult, its token_ids padded to last_tokens' rows (the
        next step's last_tokens: one array, where a second output of the same values would cost a copy)."""
        result = gather_batch(sample(logits, sampling, self.eos_token_ids, self.config.max_logprobs,
                                     filtered=filtered, logprobs=logprobs, greedy=greedy))
        rows = self.num_shards * self.config.max_num_seqs
        return result._replace(token_ids=jnp.pad(result.token_ids, (0, rows - result.token_ids.shape[0])))

    def sample_packed(self, sample_fn, logits, packed):
        """``sample_fn`` (``sample`` with its static settings) on the sampling fields of the packed vector."""
        return sample_fn(logits, self.layout.unpack_sampling(packed, logits.shape[0]))

    def forward_greedy(self, state_leaves, cache, packed, last_tokens):
        """The forward and the greedy sampler as one program (no mesh) -> (cache, SampleResult)."""
        cache, logits = self.forward(state_leaves, cache, packed, last_tokens)
        return cache, self.sample(logits, self.layout.unpack_sampling(packed, logits.shape[0]), filtered=False,
                                  logprobs=False, greedy=True)

    def forward_steps(self, state_leaves, cache, packed, last_tokens, *, t: int, filtered: bool, logprobs: bool,
                      greedy: bool):
        """A multi-step chunk of bucket t (decodes only, no mesh): ``num_scheduler_steps`` forward + sample steps,
        step j's samples step j + 1's tokens. packed: ``StepLayout.pack``'s vector, then each row's count of
        steps (a row past its count writes no cache slot and repeats its last position). -> (cache, SampleResult
        with a steps axis after the rows', the next step's last_tokens: each row's sample of its last step)."""
        s, bs = self.layout.num_rows(t), self.config.block_size
        packed, row_steps = packed[:-s], packed[-s:]
        inputs, sampling = self.layout.unpack(packed, (t,)), self.layout.unpack_sampling(packed, s)
        model, tokens = self.model_and_tokens(state_leaves, inputs, last_tokens)
        batch, rows = inputs.batch, inputs.batch.seq_ids  # token i decodes row rows[i]
        pad_slot = self.layout.padding_slot
        live = batch.slot_mapping != pad_slot  # a scheduled token, not the bucket's padding

        def step(carry, j):
            cache, tokens = carry
            active = live & (j < row_steps[rows])
            positions = batch.positions + jnp.where(live, jnp.minimum(j, jnp.maximum(row_steps[rows] - 1, 0)), 0)
            slots = batch.block_tables[rows, positions // bs] * bs + positions % bs
            stepped = batch._replace(positions=positions, slot_mapping=jnp.where(active, slots, pad_slot))
            hidden, cache = model.forward_paged(tokens, cache, stepped)
            logits = model.compute_logits(hidden[inputs.logits_indices])
            result = self.sample(logits, sampling._replace(counters=sampling.counters + j), filtered=filtered,
                                 logprobs=logprobs, greedy=greedy)
            return (cache, result.token_ids[rows]), result

        steps = self.config.num_scheduler_steps
        (cache, _), results = jax.lax.scan(step, (cache, tokens), jnp.arange(steps, dtype=jnp.int32))
        every_row = jnp.arange(results.token_ids.shape[1])
        last_step = jnp.maximum(jnp.pad(row_steps, (0, every_row.shape[0] - s)) - 1, 0)
        last = results.token_ids[last_step, every_row]
        return cache, jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), results), last
