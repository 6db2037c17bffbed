"""The memory-pressure ladder under a scripted squeeze: when full-precision KV blocks run out the
engine (1) evicts LRU prefix-cache blocks, then (2) compresses old blocks early into the 8-bit pool,
then (3) preempts the lowest-priority sequence; each rung is counted and logged once; nothing leaks.
(The server's fourth rung, 503 + Retry-After on a full queue, is tested in tests/serve.)"""

from __future__ import annotations

import logging

import pytest

from dsjax import LLM, SamplingParams
from dsjax.engine.scheduler import Scheduler
from dsjax.kv.block_manager import BlockManager
from tests.engine.test_scheduler import request, step

WINDOW = 16


def ladder(bm: BlockManager, s: Scheduler) -> tuple[int, int, int]:
    return bm.num_evictions, bm.num_pressure_compressions, s.num_preemptions


def test_rungs_fire_in_order_under_a_squeeze():
    # 10 full-precision blocks of 4 tokens, 12 compressed ones; windows of 16 tokens (4 blocks + the
    # one being filled per sequence), so three growing sequences outgrow the full pool first.
    bm = BlockManager(10, 4, enable_prefix_caching=True, num_compressed_blocks=12)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, eos_token_ids=(2,))
    s.add(request("cached", 9, start=500, max_tokens=1))  # leaves 2 hashed blocks in the prefix cache
    while s.has_unfinished():
        step(s)
    assert bm.num_blocks_cached == 2 and ladder(bm, s) == (0, 0, 0)
    first_step = {}
    for i, rid in enumerate("abc"):
        s.add(request(rid, 10, start=100 * (i + 1), max_tokens=30))
    while s.has_unfinished():
        step(s)
        for seq in s.running:  # what the engine does after every step
            bm.compress_outside_window(seq, WINDOW)
        bm.take_pending_copies()
        for rung, count in enumerate(ladder(bm, s)):
            if count and rung not in first_step:
                first_step[rung] = s.step
        bm.check_invariants(s.running)
    assert sorted(first_step) == [0, 1, 2], first_step  # every rung was needed
    assert first_step[0] <= first_step[1] <= first_step[2]
    bm.check_invariants([])
    assert bm.get_num_free_blocks() == 10 and bm.num_compressed_blocks_free == 12


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_engine_logs_each_rung_once_and_counts_it(caplog, num_scheduler_steps):
    """The real engine: a cached prefix, then four sequences growing to max_model_len in a pool that
    holds less than that (28 full-precision + 29 compressed blocks for 64 needed); in multi-step chunks
    too, whose cache room for 4 steps a sequence climbs the same ladder."""
    llm = LLM("tiny", dtype="float32", kernel_backend="reference", max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=64, block_size=4, buckets=(16,), progress=False, kv_cache_dtype="int8",
              full_precision_window=WINDOW, num_kv_blocks=40, num_scheduler_steps=num_scheduler_steps)
    engine = llm.engine
    assert (engine.block_manager.num_blocks_total, engine.block_manager.num_compressed_blocks) == (28, 29)
    with caplog.at_level(logging.WARNING, logger="dsjax.engine.llm_engine"):
        llm.generate([list(range(500, 509))], SamplingParams(max_tokens=1), use_tqdm=False)
        params = SamplingParams(max_tokens=64 - 10, temperature=0.0, ignore_eos=True)
        outs = llm.generate([list(range(100 * i, 100 * i + 10)) for i in (1, 2, 3, 4)], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 54 for o in outs)  # preempted ones were recomputed and finished
    stats = llm.stats()
    assert stats["num_prefix_evictions"] > 0 and stats["num_preemptions"] > 0 and stats["num_blocks_compressed"] > 0
    logged = [r.getMessage() for r in caplog.records if "KV memory pressure" in r.getMessage()]
    fired = [rung for rung, (key, _) in enumerate(engine.LADDER, start=1) if stats[key]]
    assert [int(m.split("rung ")[1].split(" ")[0]) for m in logged] == fired  # once each, lowest rung first
    engine.block_manager.check_invariants([])
    if num_scheduler_steps > 1:  # the 54 tokens a sequence mostly came in chunks (64 launches in single steps)
        assert engine.num_steps < 40
