"""Paged KV block manager with prefix caching. Pure Python: no JAX, testable in microseconds.

Every block is in exactly one of three places:
  free list   ref_count 0, no hash; handed out FIFO (block 0 first on a fresh manager)
  evictable   ref_count 0, hashed; still findable by hash, evicted least recently used first
  used        ref_count > 0, held by that many block tables

A full block is identified by a chained hash, blake2b(parent_hash, its token ids), so a hit on block i
implies hits on blocks 0..i-1 and two requests sharing a system prompt share its blocks.

Partial-block reuse (``partial_block_reuse``, on with prefix caching): where the full-block hits end,
a cached block that continues the same prefix and starts with the next n tokens of the request
(0 < n < block_size) is reused too: the request gets a fresh block, the device copies the cached block
into it before the next forward (``take_block_copies``), and prefill starts n tokens later. Templates
and system prompts rarely end on a block boundary; with 64-token pages this saves on average half a
page a request. Until the copy is handed to the device the source block is pinned (one extra
reference), so no allocation in between can recycle it.

Distance-aware precision (``num_compressed_blocks`` > 0): block ids [0, num_blocks) are full precision
and [num_blocks, num_blocks + num_compressed_blocks) an 8-bit pool. New tokens always go to full
blocks; ``compress_outside_window`` moves a sequence's blocks that lie wholly before its most recent
``window`` tokens into compressed blocks (the caller copies their content on the device) and frees the
full ones. Compressed blocks are never hashed (prefix caching shares full blocks only) and a block
shared by several sequences stays full.
"""

from __future__ import annotations

import array
import collections
import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type hints only: kv must not import the engine at runtime
    from dsjax.engine.sequence import Sequence

_ROOT_HASH = b""  # parent of a sequence's first block


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    # A cryptographic hash, not Python's hash(): a collision would hand one request another's KV.
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array.array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_compressed_blocks: int = 0, partial_block_reuse: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: accepted an int >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: accepted an int >= 1")
        self.num_blocks_total = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self.num_compressed_blocks = num_compressed_blocks
        self._free_compressed: collections.deque[int] = collections.deque(
            range(num_blocks, num_blocks + num_compressed_blocks))
        self._compressed_upto: dict[str, int] = {}  # request_id -> leading blocks already considered
        self.num_blocks_compressed = 0  # blocks moved to the compressed pool, summed over time
        self.num_pressure_compressions = 0  # of those, moved early because the full pool ran out
        self._pending_copies: list[tuple[int, int]] = []  # (full, compressed) moves the device still owes
        self._ref_counts = [0] * (num_blocks + num_compressed_blocks)
        self._block_hashes: list[bytes | None] = [None] * (num_blocks + num_compressed_blocks)
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.partial_block_reuse = enable_prefix_caching and partial_block_reuse
        # Hashed blocks by (parent hash, first token), with their parent and tokens: partial-block matches.
        self._children: dict[tuple[bytes, int], set[int]] = {}
        self._block_parents: list[bytes | None] = [None] * (num_blocks + num_compressed_blocks)
        self._block_tokens: list[array.array | None] = [None] * (num_blocks + num_compressed_blocks)
        self._pending_block_copies: list[tuple[int, int]] = []  # (cached source, fresh block), sources pinned
        self.num_partial_hits = 0  # admissions that reused part of a cached block
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        # request_id -> (number of leading blocks already hashed, hash of the last of them).
        self._hash_progress: dict[str, tuple[int, bytes]] = {}
        # The prefix index (_cached, _children) changes version on every edit; admission asks for a
        # sequence's lookup up to three times (cached tokens, can_allocate, allocate): the last is kept.
        self._index_version = 0
        self._last_lookup: tuple[tuple, tuple] | None = None
        self.num_evictions = 0
        self.num_prefix_query_tokens = 0  # tokens to prefill, summed over admissions
        self.num_prefix_hit_tokens = 0  # of those, tokens served from the prefix cache

    # ---- one pool (dsjax.kv.sharded splits the cache into several) -----------------------------

    num_shards = 1

    @property
    def num_blocks_per_shard(self) -> int:
        return self.num_blocks_total

    def shard_of(self, seq: Sequence) -> int:
        return 0

    # ---- counters -------------------------------------------------------------------------------

    @property
    def num_blocks_free(self) -> int:
        return len(self._free)

    @property
    def num_blocks_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - len(self._free) - len(self._evictable)

    @property
    def num_compressed_blocks_free(self) -> int:
        return len(self._free_compressed)

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take: the free list plus evictable cached blocks."""
        return len(self._free) + len(self._evictable)

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.num_prefix_query_tokens == 0:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission ------------------------------------------------------------------------------

    def _lookup(self, seq: Sequence) -> tuple[list[int], tuple[int, int] | None]:
        """Block ids of the longest cached full-block prefix of seq's tokens, and the partial match
        after it: (cached block, how many of its leading tokens continue the prefix) or None."""
        if not self.enable_prefix_caching:
            return [], None
        key = (seq.request_id, seq.num_tokens, self._index_version)
        if self._last_lookup is None or self._last_lookup[0] != key:
            self._last_lookup = key, self._search(seq)
        return self._last_lookup[1]

    def _search(self, seq: Sequence) -> tuple[list[int], tuple[int, int] | None]:
        token_ids = seq.all_token_ids
        bs = self.block_size
        # Leave the last token out: the step that ends the prefill must compute it to have logits.
        usable = len(token_ids) - 1
        parent, hits = _ROOT_HASH, []
        for i in range(usable // bs):
            block_hash = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        if not self.partial_block_reuse:
            return hits, None
        start = len(hits) * bs
        wanted = token_ids[start : min(start + bs, usable)]
        best = None
        for block in self._children.get((parent, wanted[0]), ()) if wanted else ():
            num_tokens = _common_prefix(self._block_tokens[block], wanted)
            if best is None or num_tokens > best[1]:
                best = (block, num_tokens)
        return hits, best

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens allocate(seq, ...) would serve from the prefix cache now; changes nothing."""
        hits, partial = self._lookup(seq)
        return len(hits) * self.block_size + (partial[1] if partial else 0)

    def _plan_allocation(self, seq: Sequence, num_new_tokens: int):
        """(prefix hit block ids, partial match or None, cached tokens, number of fresh blocks,
        whether the pool can supply them all)."""
        if seq.block_table or seq.num_computed_tokens != 0:
            raise ValueError(
                f"request {seq.request_id!r}: allocate is for admission, accepted a sequence with no "
                f"blocks and num_computed_tokens=0, got {len(seq.block_table)} blocks and "
                f"num_computed_tokens={seq.num_computed_tokens}"
            )
        hits, partial = self._lookup(seq)
        num_cached_tokens = len(hits) * self.block_size + (partial[1] if partial else 0)
        if not 1 <= num_new_tokens <= seq.num_tokens - num_cached_tokens:
            raise ValueError(
                f"num_new_tokens={num_new_tokens} for request {seq.request_id!r}: accepted 1 to "
                f"{seq.num_tokens - num_cached_tokens} (num_tokens={seq.num_tokens} minus "
                f"num_cached_tokens={num_cached_tokens})"
            )
        num_fresh = self.num_blocks_for(num_cached_tokens + num_new_tokens) - len(hits)
        # A hit on an evictable block takes it out of the pool, just as a fresh block would (the
        # partial match's source too, pinned until its copy is handed to the device).
        sources = hits + [partial[0]] if partial else hits
        num_revived = sum(1 for block in sources if self._ref_counts[block] == 0)
        return hits, partial, num_cached_tokens, num_fresh, num_fresh + num_revived <= self.get_num_free_blocks()

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether seq can be admitted to compute num_new_tokens past its cached prefix."""
        return self._plan_allocation(seq, num_new_tokens)[4]

    def allocate(self, seq: Sequence, num_new_tokens: int) -> int:
        """Admit seq: share its cached prefix, add fresh blocks for num_new_tokens more.

        Sets seq.block_table and seq.num_cached_tokens; returns num_cached_tokens.
        """
        hits, partial, num_cached_tokens, num_fresh, fits = self._plan_allocation(seq, num_new_tokens)
        if not fits:
            raise RuntimeError(
                f"request {seq.request_id!r}: not enough free blocks for {num_new_tokens} new tokens "
                f"({self.get_num_free_blocks()} free); call can_allocate first"
            )
        # Before fresh blocks, so eviction cannot take a block we are about to share or copy.
        for block in hits + [partial[0]] if partial else hits:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        seq.block_table = hits + [self._allocate_fresh_block() for _ in range(num_fresh)]
        if partial:
            self._pending_block_copies.append((partial[0], seq.block_table[len(hits)]))
            self.num_partial_hits += 1
        seq.num_cached_tokens = num_cached_tokens
        last_hash = self._block_hashes[hits[-1]] if hits else _ROOT_HASH
        self._hash_progress[seq.request_id] = (len(hits), last_hash)
        self.num_prefix_query_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += seq.num_cached_tokens
        return seq.num_cached_tokens

    # ---- growth ---------------------------------------------------------------------------------

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._num_missing_blocks(seq, num_new_tokens) <= self.get_num_free_blocks()

    def num_blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        return self._num_missing_blocks(seq, num_new_tokens)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq.block_table to hold num_computed_tokens + num_new_tokens tokens."""
        num_missing = self._num_missing_blocks(seq, num_new_tokens)
        if num_missing > self.get_num_free_blocks():
            raise RuntimeError(
                f"request {seq.request_id!r}: needs {num_missing} blocks, {self.get_num_free_blocks()} "
                "free; call can_append first"
            )
        seq.block_table.extend(self._allocate_fresh_block() for _ in range(num_missing))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that became full of computed tokens; call after every step."""
        if not self.enable_prefix_caching:
            return
        num_hashed, parent = self._hash_progress[seq.request_id]
        if seq.num_computed_tokens // self.block_size <= num_hashed:  # most steps: no block filled
            return
        # a block is hashed once its tokens are known: a multi-step chunk's are pending until it is read back
        num_full_blocks = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        if num_full_blocks <= num_hashed:
            return
        bs = self.block_size
        token_ids = seq.token_ids_slice(num_hashed * bs, num_full_blocks * bs)
        for i in range(num_hashed, num_full_blocks):
            offset = (i - num_hashed) * bs
            block_hash = hash_block(parent, token_ids[offset : offset + bs])
            block = seq.block_table[i]
            # Skip a block that already carries this hash (a prefix hit) or whose content another
            # sequence computed concurrently: the first copy stays cached, this one frees normally.
            if self._block_hashes[block] is None and block_hash not in self._cached:
                self._register(block, parent, block_hash, token_ids[offset : offset + bs])
            parent = block_hash
        self._hash_progress[seq.request_id] = (num_full_blocks, parent)

    def _register(self, block: int, parent: bytes, block_hash: bytes, token_ids: list[int]) -> None:
        self._index_version += 1
        self._block_hashes[block] = block_hash
        self._cached[block_hash] = block
        if self.partial_block_reuse:
            self._block_parents[block] = parent
            self._block_tokens[block] = array.array("q", token_ids)
            self._children.setdefault((parent, token_ids[0]), set()).add(block)

    def _forget(self, block: int) -> None:
        """Drop block's hash: its content is about to change or leave the full pool."""
        self._index_version += 1
        del self._cached[self._block_hashes[block]]
        self._block_hashes[block] = None
        if self.partial_block_reuse:
            key = (self._block_parents[block], self._block_tokens[block][0])
            self._children[key].discard(block)
            if not self._children[key]:
                del self._children[key]
            self._block_parents[block] = self._block_tokens[block] = None

    # ---- distance-aware precision ------------------------------------------------------------------

    def is_compressed(self, block: int) -> bool:
        return block >= self.num_blocks_total

    def compress_outside_window(self, seq: Sequence, window: int) -> list[tuple[int, int]]:
        """Moves seq's unshared full blocks that end at least ``window`` computed tokens ago into the
        compressed pool (as far as it has room). Returns the (full, compressed) block pairs whose
        content the device must copy (quantizing) before the next step; the full blocks are free."""
        num_outside = max(0, seq.num_computed_tokens - window) // self.block_size
        first = self._compressed_upto.get(seq.request_id, 0)
        pairs = []
        for i in range(first, num_outside):
            src = seq.block_table[i]
            if self.is_compressed(src) or self._ref_counts[src] != 1:
                continue  # already moved, or a prefix other sequences share: stays full
            if not self._free_compressed:
                num_outside = i
                break
            dst = self._free_compressed.popleft()
            self._ref_counts[dst] = 1
            self._ref_counts[src] = 0
            if self._block_hashes[src] is not None:  # its content leaves the full pool: forget it
                self._forget(src)
            self._free.append(src)
            seq.block_table[i] = dst
            pairs.append((src, dst))
        self._compressed_upto[seq.request_id] = max(first, num_outside)
        self.num_blocks_compressed += len(pairs)
        self._pending_copies += pairs
        return pairs

    def relieve_pressure(self, seqs: list[Sequence], num_blocks_needed: int) -> int:
        """The ladder's second rung: when the full pool runs dry, compress every complete block of
        ``seqs`` (in that order, window or not) until ``num_blocks_needed`` blocks are free. Returns how
        many blocks moved."""
        moved = 0
        for seq in seqs:
            if self.get_num_free_blocks() >= num_blocks_needed or not self._free_compressed:
                break
            moved += len(self.compress_outside_window(seq, 0))
        self.num_pressure_compressions += moved
        return moved

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (full, compressed) block moves decided since the last call: the engine copies them on the
        device before the next forward (which may already overwrite the freed full blocks)."""
        pairs, self._pending_copies = self._pending_copies, []
        return pairs

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (cached source, fresh block) copies of partial-block hits since the last call: the engine
        copies them on the device before the next forward, which is queued after the copies, so the
        sources are unpinned now (a later reuse of one writes only in a later forward)."""
        pairs, self._pending_block_copies = self._pending_block_copies, []
        for src, _ in pairs:
            self._release(src)
        return pairs

    # ---- release --------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (finished, aborted or preempted). Safe on a sequence with none."""
        # Tail first: it reaches the LRU end of the evictable pool first and is evicted before
        # the head blocks, which are the ones other requests are likely to share.
        for block in reversed(seq.block_table):
            if self._ref_counts[block] <= 0:
                raise AssertionError(
                    f"request {seq.request_id!r} frees block {block} with "
                    f"ref_count={self._ref_counts[block]}"
                )
            self._release(block)
        released = set(seq.block_table) if self._pending_copies or self._pending_block_copies else ()
        if self._pending_copies:  # moves into blocks just freed are moot, and the blocks may be reused
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies if dst not in released]
        if self._pending_block_copies:  # likewise partial-block copies: their sources are unpinned
            kept = []
            for src, dst in self._pending_block_copies:
                if dst in released:
                    self._release(src)
                else:
                    kept.append((src, dst))
            self._pending_block_copies = kept
        seq.block_table = []
        self._hash_progress.pop(seq.request_id, None)
        self._compressed_upto.pop(seq.request_id, None)

    def _release(self, block: int) -> None:
        """One reference fewer; an unreferenced block goes back to its free list, or to the evictable
        pool while it is hashed."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if self.is_compressed(block):
                self._free_compressed.append(block)
            elif self._block_hashes[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _allocate_fresh_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self.num_evictions += 1
        self._ref_counts[block] = 1
        return block

    def reset_prefix_cache(self) -> int:
        """Forget every hash; evictable blocks return to the free list. Returns how many did."""
        num_released = len(self._evictable)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._index_version += 1
        self._cached.clear()
        self._children.clear()
        self._block_hashes = [None] * len(self._ref_counts)
        self._block_parents = [None] * len(self._ref_counts)
        self._block_tokens = [None] * len(self._ref_counts)
        return num_released

    # ---- checks ---------------------------------------------------------------------------------

    def check_invariants(self, live_seqs: list[Sequence] | None = None) -> None:
        """Raise AssertionError naming the first broken invariant."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"free list holds duplicates: {list(self._free)}")
        for block in free:
            if self._ref_counts[block] != 0 or self._block_hashes[block] is not None:
                raise AssertionError(
                    f"free block {block}: ref_count={self._ref_counts[block]}, "
                    f"hashed={self._block_hashes[block] is not None}; expected 0 and unhashed"
                )
        for block in self._evictable:
            if block in free:
                raise AssertionError(f"block {block} is both free and evictable")
            if self._ref_counts[block] != 0 or self._block_hashes[block] is None:
                raise AssertionError(
                    f"evictable block {block}: ref_count={self._ref_counts[block]}, "
                    f"hashed={self._block_hashes[block] is not None}; expected 0 and hashed"
                )
        num_used = sum(1 for count in self._ref_counts[:self.num_blocks_total] if count > 0)
        if any(count < 0 for count in self._ref_counts):
            raise AssertionError(f"negative ref_counts: {self._ref_counts}")
        if len(free) + len(self._evictable) + num_used != self.num_blocks_total:
            raise AssertionError(
                f"free={len(free)} + evictable={len(self._evictable)} + used={num_used} "
                f"!= num_blocks_total={self.num_blocks_total}"
            )
        free_compressed = set(self._free_compressed)
        num_compressed_used = sum(1 for count in self._ref_counts[self.num_blocks_total:] if count > 0)
        if len(free_compressed) != len(self._free_compressed) or \
                any(not self.is_compressed(b) or self._ref_counts[b] for b in free_compressed) or \
                len(free_compressed) + num_compressed_used != self.num_compressed_blocks:
            raise AssertionError(
                f"compressed pool: free={sorted(free_compressed)}, used={num_compressed_used}, "
                f"size={self.num_compressed_blocks}: expected distinct unreferenced compressed ids that "
                "with the used ones make up the pool")
        if any(self._block_hashes[b] is not None for b in range(self.num_blocks_total, len(self._block_hashes))):
            raise AssertionError("a compressed block carries a prefix-cache hash")
        for block_hash, block in self._cached.items():
            if self._block_hashes[block] != block_hash:
                raise AssertionError(f"hash map points to block {block}, which carries a different hash")
        num_hashed = sum(1 for h in self._block_hashes if h is not None)
        if num_hashed != len(self._cached):
            raise AssertionError(f"{num_hashed} hashed blocks but {len(self._cached)} hash map entries")
        if self.partial_block_reuse:
            indexed = [b for blocks in self._children.values() for b in blocks]
            if sorted(indexed) != sorted(self._cached.values()):
                raise AssertionError(f"partial-match index holds blocks {sorted(indexed)}, hashed blocks are "
                                     f"{sorted(self._cached.values())}")
        if live_seqs is not None:
            self._check_tables(live_seqs)

    def _check_tables(self, live_seqs: list[Sequence]) -> None:
        holders = [0] * len(self._ref_counts)
        for src, _ in self._pending_block_copies:  # pinned until the copy is handed to the device
            holders[src] += 1
        for seq in live_seqs:
            if len(set(seq.block_table)) != len(seq.block_table):
                raise AssertionError(f"request {seq.request_id!r} holds a block twice: {seq.block_table}")
            if len(seq.block_table) < self.num_blocks_for(seq.num_computed_tokens):
                raise AssertionError(
                    f"request {seq.request_id!r}: {len(seq.block_table)} blocks cannot hold "
                    f"num_computed_tokens={seq.num_computed_tokens}"
                )
            for block in seq.block_table:
                holders[block] += 1
        for block, (count, held) in enumerate(zip(self._ref_counts, holders)):
            if count != held:
                raise AssertionError(
                    f"block {block}: ref_count={count} but held by {held} live block tables"
                )
        tracked = set(self._hash_progress)
        holding = {seq.request_id for seq in live_seqs if seq.block_table}
        if tracked != holding:
            raise AssertionError(
                f"hash progress kept for {sorted(tracked)}, blocks held by {sorted(holding)}"
            )


def _common_prefix(stored: array.array, token_ids: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for a, b in zip(stored, token_ids):
        if a != b:
            break
        n += 1
    return n
