"""Distance-aware precision in the block manager: blocks wholly outside a sequence's recent window move
to the compressed pool (exact ids), shared prefixes stay full, nothing leaks."""

from dsjax.engine.sequence import Sequence
from dsjax.kv.block_manager import BlockManager
from tests.kv.test_block_manager import admit, compute

BS = 4


def test_blocks_leave_the_window_into_the_compressed_pool_in_order():
    bm = BlockManager(num_blocks=6, block_size=BS, num_compressed_blocks=3)
    a = Sequence("a", range(17))  # 5 blocks: [0..4]
    admit(bm, a)
    assert a.block_table == [0, 1, 2, 3, 4]
    # window 8: tokens 9..16 are recent; blocks 0 and 1 (tokens 0..7) lie wholly before them.
    assert bm.compress_outside_window(a, 8) == [(0, 6), (1, 7)]
    assert a.block_table == [6, 7, 2, 3, 4]
    assert bm.num_blocks_free == 3 and bm.num_compressed_blocks_free == 1 and bm.num_blocks_compressed == 2
    assert bm.compress_outside_window(a, 8) == []  # nothing new left the window
    bm.check_invariants([a])
    # Decoding on: freed full block 0 is handed out again first (FIFO), compressed ids never are.
    a.output_token_ids += [5, 6, 7, 8]
    bm.append(a, 4)
    compute(bm, a, 4)  # 21 tokens: blocks 0..2 (tokens 0..11) now outside a window of 8
    assert a.block_table == [6, 7, 2, 3, 4, 5]
    assert bm.compress_outside_window(a, 8) == [(2, 8)]
    # Pool full: block 3 (tokens 12..15) left the window too late for room; it stays full.
    a.output_token_ids += [9, 10, 11, 12]
    bm.append(a, 4)
    compute(bm, a, 4)
    assert bm.compress_outside_window(a, 8) == []
    assert a.block_table[:4] == [6, 7, 8, 3]
    bm.check_invariants([a])
    bm.free(a)
    assert bm.get_num_free_blocks() == 6 and bm.num_compressed_blocks_free == 3  # hashed full ones: evictable
    bm.check_invariants([])


def test_shared_prefix_blocks_stay_full_and_compressed_blocks_are_never_hashed():
    bm = BlockManager(num_blocks=10, block_size=BS, num_compressed_blocks=4)
    prefix = list(range(100, 108))
    a, b = Sequence("a", prefix + [1, 2, 3, 4, 5]), Sequence("b", prefix + [9, 9, 9, 9, 9])
    admit(bm, a)
    admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2]  # prefix hit: blocks 0 and 1 shared
    # window 1: blocks 0..2 (tokens 0..11) are outside; 0 and 1 are shared: skipped
    assert bm.compress_outside_window(a, 1) == [(2, 10)]
    bm.free(b)  # now a alone holds 0 and 1, but they were already passed over
    assert bm.compress_outside_window(a, 1) == []
    bm.check_invariants([a])
    # A hashed block that moves is forgotten by the prefix cache: a newcomer cannot hit it.
    c = Sequence("c", range(200, 213))
    admit(bm, c)
    moved = bm.compress_outside_window(c, 4)
    assert [dst for _, dst in moved] == [11, 12] and bm.num_compressed_blocks_free == 1
    d = Sequence("d", range(200, 213))
    assert bm.get_num_cached_tokens(d) == 0
    bm.check_invariants([a, c])
    for seq in (a, c):
        bm.free(seq)
    bm.check_invariants([])


def test_freeing_a_sequence_drops_its_pending_moves():
    """An aborted sequence's pending device copies must not land in compressed blocks that another
    sequence may take next (two writes to one block in one copy would race)."""
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False, num_compressed_blocks=1)
    a, b = Sequence("a", range(9)), Sequence("b", range(100, 109))
    admit(bm, a)
    admit(bm, b)
    assert bm.compress_outside_window(a, 4) == [(0, 8)]
    bm.free(a)  # aborted before the next step flushed the copy
    assert bm.compress_outside_window(b, 4) == [(3, 8)]  # block 8 is b's now
    assert bm.take_pending_copies() == [(3, 8)]
    bm.check_invariants([b])
