"""Block pools of data-parallel attention: one BlockManager per rank of ('data', 'expert').

A rank's KV cache shard holds only its own sequences' blocks, so a sequence lives in one pool from
admission until it is freed (a preempted sequence may land elsewhere when re-admitted: its KV is
recomputed anyway). Block tables hold ids local to that pool, which is what the rank's attention reads.
Pure Python, like BlockManager, whose interface this mirrors for the scheduler.

Placement: the pool with the fewest live sequences (decode steps cost the slowest rank, and each
sequence adds one token per step), then the longest prefix-cache hit, then the most free blocks,
among the pools that can hold the whole uncached prompt now; if none can, among all pools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsjax.kv.block_manager import BlockManager

if TYPE_CHECKING:
    from dsjax.engine.sequence import Sequence


class ShardedBlockManager:
    num_compressed_blocks = 0  # distance-aware precision runs on one device only (ModelRunner refuses a mesh)
    num_blocks_compressed = num_pressure_compressions = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return []

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Every pool's partial-prefix-hit copies as (src, dst) in global block ids, pool p's local id b
        being p * num_blocks_per_shard + b: the runner copies each inside its rank's cache slice."""
        per = self.num_blocks_per_shard
        return [(p * per + src, p * per + dst) for p, shard in enumerate(self.shards)
                for src, dst in shard.take_block_copies()]

    def __init__(self, num_shards: int, num_blocks_per_shard: int, block_size: int,
                 enable_prefix_caching: bool = True):
        if num_shards < 1:
            raise ValueError(f"num_shards={num_shards}: accepted an int >= 1")
        self.shards = [BlockManager(num_blocks_per_shard, block_size, enable_prefix_caching)
                       for _ in range(num_shards)]
        self.num_shards = num_shards
        self.num_blocks_per_shard = num_blocks_per_shard
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._shard: dict[str, int] = {}  # request_id -> pool, while it holds blocks
        self._num_seqs = [0] * num_shards

    # ---- counters (sums over pools) -----------------------------------------------------------

    def _sum(self, name: str) -> int:
        return sum(getattr(shard, name) for shard in self.shards)

    num_blocks_total = property(lambda self: self._sum("num_blocks_total"))
    num_blocks_free = property(lambda self: self._sum("num_blocks_free"))
    num_blocks_cached = property(lambda self: self._sum("num_blocks_cached"))
    num_blocks_used = property(lambda self: self._sum("num_blocks_used"))
    num_evictions = property(lambda self: self._sum("num_evictions"))
    num_prefix_query_tokens = property(lambda self: self._sum("num_prefix_query_tokens"))
    num_prefix_hit_tokens = property(lambda self: self._sum("num_prefix_hit_tokens"))
    num_partial_hits = property(lambda self: self._sum("num_partial_hits"))

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.num_prefix_query_tokens
        return self.num_prefix_hit_tokens / queries if queries else 0.0

    def get_num_free_blocks(self) -> int:
        return sum(shard.get_num_free_blocks() for shard in self.shards)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_seqs(self, shard: int) -> int:
        return self._num_seqs[shard]

    # ---- placement ----------------------------------------------------------------------------

    def shard_of(self, seq: Sequence) -> int:
        """The pool seq lives in, or for a waiting one the pool allocate() would place it in now."""
        shard = self._shard.get(seq.request_id)
        return self._place(seq) if shard is None else shard

    def _place(self, seq: Sequence) -> int:
        def key(i):
            cached = self.shards[i].get_num_cached_tokens(seq)
            return self._num_seqs[i], -cached, -self.shards[i].get_num_free_blocks(), i

        def fits(i):
            shard = self.shards[i]
            return shard.can_allocate(seq, seq.num_tokens - shard.get_num_cached_tokens(seq))

        candidates = [i for i in range(self.num_shards) if fits(i)] or range(self.num_shards)
        return min(candidates, key=key)

    # ---- the BlockManager interface -----------------------------------------------------------

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        return self.shards[self.shard_of(seq)].get_num_cached_tokens(seq)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.shards[self.shard_of(seq)].can_allocate(seq, num_new_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> int:
        shard = self.shard_of(seq)
        num_cached = self.shards[shard].allocate(seq, num_new_tokens)
        self._shard[seq.request_id] = shard
        self._num_seqs[shard] += 1
        return num_cached

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.shards[self._shard[seq.request_id]].can_append(seq, num_new_tokens)

    def num_blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        return self.shards[self._shard[seq.request_id]].num_blocks_to_append(seq, num_new_tokens)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        self.shards[self._shard[seq.request_id]].append(seq, num_new_tokens)

    def cache_full_blocks(self, seq: Sequence) -> None:
        self.shards[self._shard[seq.request_id]].cache_full_blocks(seq)

    def free(self, seq: Sequence) -> None:
        shard = self._shard.pop(seq.request_id, None)
        if shard is None:  # never admitted, or already freed: nothing held
            seq.block_table = []
            return
        self.shards[shard].free(seq)
        self._num_seqs[shard] -= 1

    def reset_prefix_cache(self) -> int:
        return sum(shard.reset_prefix_cache() for shard in self.shards)

    def check_invariants(self, live_seqs: list[Sequence] | None = None) -> None:
        for i, shard in enumerate(self.shards):
            mine = None if live_seqs is None else [s for s in live_seqs if self._shard.get(s.request_id) == i]
            shard.check_invariants(live_seqs=mine)
        if live_seqs is not None:
            strays = [s.request_id for s in live_seqs if s.block_table and s.request_id not in self._shard]
            if strays:
                raise AssertionError(f"requests {strays} hold blocks but belong to no pool")
        placed = [sum(1 for s in self._shard.values() if s == i) for i in range(self.num_shards)]
        if placed != self._num_seqs:
            raise AssertionError(f"pool sequence counts {self._num_seqs}, but {placed} placed")
