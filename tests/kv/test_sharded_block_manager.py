"""Data-parallel attention's block pools: placement, local block ids, per-pool prefix caching and
preemption, through the scheduler that drives them."""

from dsjax.engine.sampling_params import SamplingParams
from dsjax.engine.scheduler import Scheduler
from dsjax.engine.sequence import Sequence
from dsjax.kv.sharded import ShardedBlockManager

BS = 4


def seq(rid: str, num_tokens: int, start: int = 100, max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(range(start, start + num_tokens)), SamplingParams(max_tokens=max_tokens))


def admit(bm: ShardedBlockManager, s: Sequence) -> int:
    cached = bm.get_num_cached_tokens(s)
    bm.allocate(s, s.num_tokens - cached)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return bm.shard_of(s)


def test_sequences_spread_over_pools_with_local_block_ids():
    bm = ShardedBlockManager(num_shards=3, num_blocks_per_shard=6, block_size=BS)
    seqs = [seq(str(i), 6, start=100 * i) for i in range(4)]
    assert [admit(bm, s) for s in seqs] == [0, 1, 2, 0]  # fewest live sequences first
    assert [s.block_table for s in seqs] == [[0, 1], [0, 1], [0, 1], [2, 3]]  # ids local to the pool
    assert (bm.num_blocks_total, bm.num_blocks_used, bm.num_blocks_free) == (18, 8, 10)
    bm.check_invariants(seqs)
    bm.free(seqs[1])
    late = seq("4", 3, start=900)
    assert admit(bm, late) == 1 and bm.num_seqs(1) == 1 and late.block_table == [2]  # FIFO free list
    bm.check_invariants([seqs[0], seqs[2], seqs[3], late])


def test_prefix_hit_is_per_pool_and_breaks_ties():
    bm = ShardedBlockManager(num_shards=2, num_blocks_per_shard=8, block_size=BS)
    prefix = list(range(500, 508))  # two full blocks
    a, b = Sequence("a", prefix + [1, 2]), Sequence("b", list(range(10)))
    assert (admit(bm, a), admit(bm, b)) == (0, 1)
    c = Sequence("c", prefix + [3])  # both pools hold one sequence: the one with the prefix wins
    assert bm.shard_of(c) == 0 and bm.get_num_cached_tokens(c) == 8
    assert bm.allocate(c, 1) == 8 and c.block_table[:2] == a.block_table[:2]
    assert bm.prefix_cache_hit_rate == 8 / (10 + 10 + 9)


def test_a_pool_that_cannot_hold_the_prompt_is_skipped():
    bm = ShardedBlockManager(num_shards=2, num_blocks_per_shard=4, block_size=BS)
    admit(bm, seq("small", 2))
    admit(bm, seq("big", 14, start=300))  # 4 blocks: fills pool 1
    admit(bm, seq("other", 2, start=600))  # pool 0 again (pool 1 is full)
    assert bm.shard_of(seq("next", 8, start=700)) == 0  # 2 blocks fit only in pool 0


def test_scheduler_preempts_within_the_pool_that_is_full():
    bm = ShardedBlockManager(num_shards=2, num_blocks_per_shard=3, block_size=BS)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    for rid, start in (("a", 100), ("b", 200), ("c", 300)):
        s.add(seq(rid, 4, start=start, max_tokens=8))
    out = s.schedule()  # a -> pool 0, b -> pool 1, c -> pool 0
    assert [bm.shard_of(item.seq) for item in out.scheduled] == [0, 1, 0]
    s.update_from_output(out, {item.seq.request_id: 7 for item in out.scheduled})
    for _ in range(4):  # pool 0 runs out first: its newest sequence (c) goes, b in pool 1 stays
        out = s.schedule()
        s.update_from_output(out, {item.seq.request_id: 7 for item in out.scheduled if item.do_sample})
        s.check_invariants()
        if out.preempted:
            break
    assert [p.request_id for p in out.preempted] == ["c"]
    assert s.get("b").num_preemptions == 0


def test_a_request_larger_than_a_pool_is_refused_at_once():
    bm = ShardedBlockManager(num_shards=4, num_blocks_per_shard=2, block_size=BS)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    try:
        s.add(seq("long", 8, max_tokens=4))  # 11 tokens of KV = 3 blocks > 2 per pool
    except ValueError as e:
        assert "more than the whole pool of 2" in str(e)
    else:
        raise AssertionError("a request no pool can hold was accepted")
