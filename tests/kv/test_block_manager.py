import pytest

from dsjax.engine.sequence import Sequence
from dsjax.kv.block_manager import BlockManager

BS = 4
PREFIX = list(range(1000, 1008))  # two full blocks


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the scheduler does after a step: the KV of num_tokens more tokens is now in the cache."""
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> None:
    """Admit and prefill the whole uncached part in one step."""
    num_cached = bm.get_num_cached_tokens(seq)
    bm.allocate(seq, seq.num_tokens - num_cached)
    seq.num_computed_tokens = num_cached
    compute(bm, seq, seq.num_tokens - num_cached)


def test_allocation_takes_block_ids_in_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = Sequence("a", range(10)), Sequence("b", range(100, 105))
    assert bm.can_allocate(a, 10)
    assert bm.allocate(a, 10) == 0
    assert a.block_table == [0, 1, 2]
    bm.allocate(b, 5)
    assert b.block_table == [3, 4]
    assert (bm.num_blocks_used, bm.num_blocks_free, bm.num_blocks_cached) == (5, 3, 0)
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    bm.check_invariants([a, b])


def test_chunked_allocation_and_append_grow_only_as_needed():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence("a", range(10))
    bm.allocate(a, 3)  # first prefill chunk: 3 tokens, 1 block
    assert a.block_table == [0]
    compute(bm, a, 3)
    assert bm.can_append(a, 6)
    bm.append(a, 6)  # tokens 3..8 -> blocks for 9 tokens
    assert a.block_table == [0, 1, 2]
    compute(bm, a, 6)
    bm.append(a, 1)  # the 10th token still fits in block 2
    assert a.block_table == [0, 1, 2]
    bm.check_invariants([a])


def test_prefix_hit_shares_two_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence("a", PREFIX + [50, 51])
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    b = Sequence("b", PREFIX + [60, 61, 62])
    assert bm.get_num_cached_tokens(b) == 8
    assert bm.can_allocate(b, 3)
    assert bm.allocate(b, 3) == 8
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_blocks_used == 4
    # Admissions asked for 10 + 11 prompt tokens; 8 came from the cache.
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 21)
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_blocks_used == 0


def test_admission_hashes_the_prompt_once(monkeypatch):
    """The scheduler asks get_num_cached_tokens, can_allocate and allocate in turn: the prefix lookup
    (a hash per full block) runs once; a change to the index (blocks registered since) is seen."""
    from dsjax.kv import block_manager

    calls = []
    real = block_manager.hash_block
    monkeypatch.setattr(block_manager, "hash_block", lambda *a: calls.append(1) or real(*a))
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence("a", PREFIX + [50, 51])  # 10 tokens: 2 full blocks to look up (the last token is left out)
    num_cached = bm.get_num_cached_tokens(a)
    assert bm.can_allocate(a, 10 - num_cached)
    bm.allocate(a, 10 - num_cached)
    assert len(calls) == 1  # a miss at the first block ends the walk; once, not three times
    compute(bm, a, 10)
    b = Sequence("b", PREFIX + [60, 61, 62])
    calls.clear()
    assert bm.get_num_cached_tokens(b) == 8 and bm.can_allocate(b, 3) and bm.allocate(b, 3) == 8
    assert len(calls) == 2  # both prefix blocks, hashed once for the three questions
    bm.check_invariants([a, b])


def test_last_prompt_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=BS, partial_block_reuse=False)
    a = Sequence("a", PREFIX + [50])
    admit(bm, a)
    c = Sequence("c", PREFIX)  # exactly the two cached blocks
    assert bm.get_num_cached_tokens(c) == 4  # only full blocks within the first 7 tokens
    admit(bm, c)
    assert c.block_table == [0, 3]
    # Block 3 holds the same tokens as block 1, which stays the cached copy; 3 is a plain block.
    bm.free(c)
    assert (bm.num_blocks_free, bm.ref_count(3)) == (5, 0)  # "a" still holds 0, 1, 2
    assert bm.num_blocks_cached == 0  # block 0 is still held by "a"
    bm.check_invariants([a])


def test_partial_block_hit_copies_the_cached_block_and_pins_it_until_taken():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence("a", PREFIX + [50])
    admit(bm, a)
    bm.free(a)  # blocks 0, 1 cached and evictable, 2 (never full) free
    # The same prefix but the last token: block 0 whole, then 3 of block 1's 4 tokens.
    c = Sequence("c", PREFIX)
    assert bm.get_num_cached_tokens(c) == 7
    assert bm.allocate(c, 1) == 7
    fresh = c.block_table[1]
    assert c.block_table[0] == 0 and fresh not in (0, 1)
    assert bm.ref_count(1) == 1  # pinned: no allocation may recycle the source before the copy
    bm.check_invariants([c])
    # Allocations before the copy is handed over cannot evict the pinned source.
    d = Sequence("d", list(range(2000, 2024)))
    assert not bm.can_allocate(d, 24)  # 6 blocks: 5 free (2 .. 7 but the fresh one), block 1 pinned
    assert bm.take_block_copies() == [(1, fresh)]
    assert bm.take_block_copies() == []
    assert bm.ref_count(1) == 0 and bm.num_blocks_cached == 1  # back to evictable
    assert bm.can_allocate(d, 24)
    assert bm.num_partial_hits == 1
    bm.check_invariants([c])
    # Full now, the copy holds block 1's tokens again: block 1 stays the cached one.
    c.num_computed_tokens = 7
    compute(bm, c, 1)
    bm.free(c)
    bm.check_invariants([])
    assert (bm.num_blocks_cached, bm.ref_count(fresh)) == (2, 0)


def test_partial_block_hit_picks_the_longest_match_and_frees_cleanly():
    bm = BlockManager(num_blocks=16, block_size=BS)
    for name, tail in (("a", [1, 2, 9, 9]), ("b", [1, 2, 3, 9])):
        seq = Sequence(name, PREFIX + tail + [0])
        admit(bm, seq)
        bm.free(seq)
    c = Sequence("c", PREFIX + [1, 2, 3, 4, 5])
    assert bm.get_num_cached_tokens(c) == 8 + 3  # b's third block matches 3 tokens, a's only 2
    bm.allocate(c, 2)
    (src, dst), = bm._pending_block_copies
    assert bm._block_tokens[src].tolist() == [1, 2, 3, 9]
    # A request freed before its copy reaches the device drops the copy and unpins the source.
    bm.free(c)
    assert bm.take_block_copies() == [] and bm.ref_count(src) == 0
    bm.check_invariants([])
    # The first token must match: nothing is reused for a different one.
    e = Sequence("e", PREFIX + [7, 1, 2, 3, 4])
    assert bm.get_num_cached_tokens(e) == 8
    # Eviction drops a block from the partial-match index with its hash.
    bm.reset_prefix_cache()
    assert bm.get_num_cached_tokens(c) == 0
    bm.check_invariants([])


def test_free_in_reverse_order_and_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Sequence("a", PREFIX + [50])  # 9 tokens: blocks 0, 1 full and hashed, block 2 partial
    admit(bm, a)
    bm.free(a)
    # Tail first: partial block 2 goes to the free list; 1 then 0 enter the LRU pool, so 1 is older.
    assert (bm.num_blocks_free, bm.num_blocks_cached, bm.num_blocks_used) == (2, 2, 0)
    assert bm.get_num_free_blocks() == 4
    b = Sequence("b", range(200, 212))  # 12 tokens: 3 blocks
    bm.allocate(b, 12)
    assert b.block_table == [3, 2, 1]  # free list FIFO (3 was never used, 2 freed), then evict 1
    assert bm.num_evictions == 1
    # The head of the prefix survived eviction.
    assert bm.get_num_cached_tokens(Sequence("a2", PREFIX + [50])) == 4
    bm.check_invariants([b])


def test_recently_hit_blocks_are_evicted_last():
    bm = BlockManager(num_blocks=4, block_size=BS)
    x, y = Sequence("x", range(0, 5)), Sequence("y", range(10, 15))
    admit(bm, x)  # blocks [0, 1]; block 0 hashed
    admit(bm, y)  # blocks [2, 3]; block 2 hashed
    bm.free(x)
    bm.free(y)  # LRU pool: 0, then 2
    x2 = Sequence("x2", range(0, 5))
    admit(bm, x2)  # hits block 0 (it leaves the pool), fresh block 1 from the free list
    assert x2.block_table == [0, 1]
    bm.free(x2)  # block 0 re-enters at the most recently used end: pool is 2, 0
    z = Sequence("z", range(20, 33))  # 13 tokens: 4 blocks; free list has 3, 1
    bm.allocate(z, 13)
    assert z.block_table == [3, 1, 2, 0]
    assert bm.num_evictions == 2
    bm.check_invariants([z])


def test_decode_fills_and_registers_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    s = Sequence("s", [7, 8, 9])
    admit(bm, s)
    assert s.block_table == [0]
    for token in (10, 11):  # two decode steps: append the sampled token, then compute it
        s.output_token_ids.append(token)
        bm.append(s, 1)
        compute(bm, s, 1)
    assert s.block_table == [0, 1]
    # Block 0 (7, 8, 9, 10) filled during decode and is now shared.
    assert bm.get_num_cached_tokens(Sequence("t", [7, 8, 9, 10, 99])) == 4
    bm.check_invariants([s])


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = Sequence("a", PREFIX + [50])
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    assert bm.get_num_cached_tokens(Sequence("b", PREFIX + [60])) == 0
    bm.free(a)
    assert (bm.num_blocks_free, bm.num_blocks_cached) == (8, 0)
    b = Sequence("b", range(300, 324))  # 6 blocks: the untouched 3..7, then 2 (freed first)
    bm.allocate(b, 24)
    assert b.block_table == [3, 4, 5, 6, 7, 2]
    assert bm.prefix_cache_hit_rate == 0.0
    bm.check_invariants([b])


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence("a", PREFIX + [50])
    admit(bm, a)
    bm.free(a)
    assert bm.num_blocks_cached == 2
    assert bm.reset_prefix_cache() == 2
    assert (bm.num_blocks_free, bm.num_blocks_cached) == (8, 0)
    assert bm.get_num_cached_tokens(Sequence("b", PREFIX + [50])) == 0
    bm.check_invariants([])


def test_allocation_errors_and_capacity():
    bm = BlockManager(num_blocks=2, block_size=BS)
    big = Sequence("big", range(9))
    assert not bm.can_allocate(big, 9)
    with pytest.raises(RuntimeError, match="not enough free blocks for 9 new tokens"):
        bm.allocate(big, 9)
    small = Sequence("small", range(8))
    with pytest.raises(ValueError, match="num_new_tokens=9 .* accepted 1 to 8"):
        bm.can_allocate(small, 9)
    bm.allocate(small, 8)
    with pytest.raises(ValueError, match="allocate is for admission"):
        bm.allocate(small, 1)
    with pytest.raises(ValueError, match="block_size=0"):
        BlockManager(num_blocks=2, block_size=0)


def test_check_invariants_reports_corruption():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Sequence("a", range(6))
    bm.allocate(a, 6)
    bm._ref_counts[1] += 1
    with pytest.raises(AssertionError, match="block 1: ref_count=2 but held by 1 live block tables"):
        bm.check_invariants([a])
    bm._ref_counts[1] -= 1
    bm._free.append(0)
    with pytest.raises(AssertionError, match="free block 0: ref_count=1"):
        bm.check_invariants()
