"""A step's input arrays: what a scheduler decision becomes on the host, the shapes of bucket t, their
split over the data-parallel ranks, and (no mesh) one int32 vector that reaches the device in one
transfer and that the compiled programs slice apart.

A step at bucket t has T = P * t tokens and S = P * num_rows(t) sequence rows for P data-parallel
ranks, rank-major: rank p's tokens at [p*t, (p+1)*t), its rows at [p*s, (p+1)*s), block ids local to
its cache slice (``ModelRunner`` holds the slices).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dsjax.config import EngineConfig
from dsjax.engine.sampler import SamplingArrays
from dsjax.engine.scheduler import SchedulerOutput
from dsjax.engine.sequence import PENDING_TOKEN, Sequence
from dsjax.model.paged import PagedBatch
from dsjax.parallel.sharding import batch_spec

# pack()'s order of a step's inputs: (name, per-token or per-row), then the block tables (S x max_blocks_per_seq),
# then the sampling arrays' fields (per row, in SamplingArrays' order, as int32 bit patterns)
_PACKED = (("tokens", "t"), ("positions", "t"), ("slot_mapping", "t"), ("seq_ids", "t"), ("token_sources", "t"),
           ("logits_indices", "s"))


class StepInputs(NamedTuple):
    tokens: jax.Array  # i32[T]
    batch: PagedBatch
    logits_indices: jax.Array  # i32[S] last scheduled token of each sequence
    sampling: SamplingArrays
    token_sources: jax.Array  # i32[T] -1: tokens[i]; r >= 0: row r of the previous step's last_tokens


class RowSampling(NamedTuple):
    """Sampling settings of one scheduled sequence, in scheduler order (a tuple, not a frozen dataclass:
    one is built for every sequence every step, and ``StepLayout.arrays`` transposes them with zip)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    counter: int = 0  # tokens generated so far by this sequence
    mask_eos: bool = False
    num_logprobs: int = 0


class StepLayout:
    """The arrays of a step for ``num_shards`` data-parallel ranks (a ``mesh`` of them, or None for one device).
    ``padding_slot``: the cache slot of a bucket's padding tokens (past every pool, so their writes drop);
    ``shard_of(seq)``: the rank whose cache slice holds seq's blocks."""

    def __init__(self, config: EngineConfig, num_shards: int, mesh, padding_slot: int, shard_of):
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_blocks_per_seq = config.max_blocks_per_seq
        self.num_shards = num_shards
        self.mesh = mesh
        self.padding_slot = padding_slot
        self.shard_of = shard_of

    def num_rows(self, t: int) -> int:
        """A rank's sequence rows at bucket t."""
        return min(t, self.max_num_seqs)

    # ----- shapes and sharding --------------------------------------------------------------------
    def shapes(self, t: int) -> StepInputs:
        """Shapes of a step at bucket t: every rank's t tokens and num_rows(t) rows, rank-major."""
        t, s, w = self.num_shards * t, self.num_shards * self.num_rows(t), self.max_blocks_per_seq
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
        return StepInputs(
            i32(t), PagedBatch(i32(t), i32(t), i32(t), i32(s, w)), i32(s),
            SamplingArrays(f32(s), i32(s), f32(s), jax.ShapeDtypeStruct((s,), jnp.uint32), i32(s),
                           jax.ShapeDtypeStruct((s,), jnp.bool_), i32(s)), i32(t))

    def abstract(self, t: int) -> StepInputs:
        """shapes(t) with the mesh's shardings, for lowering."""
        inputs = self.shapes(t)
        if self.mesh is None:
            return inputs
        return jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            inputs, self.shardings())

    def specs(self) -> StepInputs:
        """Every input split over the data-parallel ranks along its leading axis."""
        return jax.tree.map(lambda a: batch_spec(a.ndim), self.shapes(1))

    def shardings(self) -> StepInputs:
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.specs(),
                            is_leaf=lambda x: isinstance(x, P))

    # ----- a scheduler decision as host arrays -----------------------------------------------------
    def arrays(self, out: SchedulerOutput, rows: list[RowSampling], t: int, by_shard: list[list[int]],
               pending_rows: dict[Sequence, int] | None = None) -> tuple[StepInputs, np.ndarray]:
        """The step's host arrays (numpy, no device work) at bucket t, the sequences placed by rank as
        ``by_shard`` lists them. pending_rows: for each sequence whose last token is still a PENDING_TOKEN, its
        row in the previous step's result. -> (inputs, row i32[num_seqs]: where scheduled sequence i's sample
        comes back)."""
        bs, w, shards = self.block_size, self.max_blocks_per_seq, self.num_shards
        s = self.num_rows(t)
        tokens = np.zeros(shards * t, np.int32)
        positions = np.zeros(shards * t, np.int32)
        slots = np.full(shards * t, self.padding_slot, np.int32)
        seq_ids = np.zeros(shards * t, np.int32)
        sources = np.full(shards * t, -1, np.int32)
        tables = np.zeros((shards * s, w), np.int32)
        logits_indices = np.zeros(shards * s, np.int32)
        row_of = np.zeros(len(out.scheduled), np.int64)
        padded = [RowSampling()] * (shards * s)
        for shard, items in enumerate(by_shard):
            offset = 0  # within the rank's t tokens
            for r, i in enumerate(items):
                item = out.scheduled[i]
                n, start, row = item.num_scheduled_tokens, shard * t + offset, shard * s + r
                block_table, first = item.seq.block_table, item.num_computed_tokens
                if n == 1:  # decodes, most of a large batch: scalars, no temporary arrays
                    token = item.seq.last_token_id if item.is_decode else item.token_ids[0]
                    if token == PENDING_TOKEN:
                        sources[start] = pending_rows[item.seq]
                    tokens[start] = token
                    positions[start] = first
                    slots[start] = block_table[first // bs] * bs + first % bs
                    seq_ids[start] = r
                else:
                    table = np.asarray(block_table, np.int32)
                    pos = np.arange(first, first + n, dtype=np.int32)
                    tokens[start:start + n] = item.token_ids
                    positions[start:start + n] = pos
                    slots[start:start + n] = table[pos // bs] * bs + pos % bs
                    seq_ids[start:start + n] = r
                tables[row, :len(block_table)] = block_table
                logits_indices[row] = offset + n - 1
                padded[row], row_of[i] = rows[i], row
                offset += n
        temperature, top_k, top_p, seed, counter, mask_eos, num_logprobs = zip(*padded)  # RowSampling's fields
        sampling = SamplingArrays(
            np.asarray(temperature, np.float32), np.asarray(top_k, np.int32), np.asarray(top_p, np.float32),
            np.asarray([s & 0xFFFFFFFF for s in seed], np.uint32), np.asarray(counter, np.int32),
            np.asarray(mask_eos, np.bool_), np.asarray(num_logprobs, np.int32))
        inputs = StepInputs(tokens, PagedBatch(positions, slots, seq_ids, tables), logits_indices, sampling, sources)
        return inputs, row_of

    def by_shard(self, out: SchedulerOutput) -> list[list[int]]:
        """The scheduled sequences' indices, by the rank that holds each one's blocks."""
        by_shard: list[list[int]] = [[] for _ in range(self.num_shards)]
        for i, item in enumerate(out.scheduled):
            by_shard[self.shard_of(item.seq)].append(i)
        return by_shard

    # ----- one vector (no mesh) -------------------------------------------------------------------
    def pack(self, inputs: StepInputs) -> np.ndarray:
        """A step's inputs (no mesh) as one int32 host vector: ``_PACKED``'s fields, the block tables row by
        row, then the sampling arrays' fields (floats and unsigned seeds as their bit patterns, flags as 0 / 1)."""
        fields = {**inputs._asdict(), **inputs.batch._asdict()}
        sampling = [a.astype(np.int32) if a.dtype == np.bool_ else a.view(np.int32) for a in inputs.sampling]
        return np.concatenate([fields[name] for name, _ in _PACKED] + [inputs.batch.block_tables.ravel()] + sampling)

    def packed_length(self, t: int) -> int:
        """The length of bucket t's ``pack`` vector: its step's inputs, all of them."""
        return sum(a.size for a in jax.tree.leaves(self.shapes(t)))

    def unpack(self, packed, sizes) -> StepInputs:
        """``pack``'s vector -> StepInputs without the sampling arrays (the forward's), sliced apart; its length
        names the bucket among ``sizes`` (the length grows with the bucket)."""
        t = next(t for t in sizes if self.packed_length(t) == packed.shape[0])
        s, w = self.num_rows(t), self.max_blocks_per_seq
        fields, start = {}, 0
        for name, per in _PACKED:
            size = t if per == "t" else s
            fields[name], start = packed[start:start + size], start + size
        tables = packed[start:start + s * w].reshape(s, w)
        return StepInputs(fields["tokens"], PagedBatch(fields["positions"], fields["slot_mapping"], fields["seq_ids"],
                                                       tables), fields["logits_indices"], None, fields["token_sources"])

    def unpack_sampling(self, packed, s: int) -> SamplingArrays:
        """The sampling arrays of ``pack``'s vector (its last entries, s rows each), back in their dtypes."""
        dtypes = [a.dtype for a in self.shapes(1).sampling]
        fields = packed[-len(dtypes) * s:].reshape(len(dtypes), s)
        return SamplingArrays(*(f != 0 if dtype == jnp.bool_ else jax.lax.bitcast_convert_type(f, dtype)
                                for f, dtype in zip(fields, dtypes)))
