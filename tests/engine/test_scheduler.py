import random

import pytest

from dsjax.engine.sampling_params import SamplingParams
from dsjax.engine.scheduler import Scheduler, SchedulerOutput
from dsjax.engine.sequence import Lane, Sequence, SequenceStatus
from dsjax.kv.block_manager import BlockManager

EOS = 2


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64,
         enable_prefix_caching=True, **kwargs) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, eos_token_ids=(EOS,),
                     **kwargs)


def request(rid: str, num_prompt: int, start: int = 100, **params) -> Sequence:
    params.setdefault("max_tokens", 20)
    return Sequence(rid, list(range(start, start + num_prompt)), SamplingParams(**params))


def step(s: Scheduler, scripts: dict | None = None) -> tuple[SchedulerOutput, list[Sequence]]:
    """One engine step: schedule, 'sample' (1000 + step, or the next scripted token), update."""
    out = s.schedule()
    sampled = {}
    for item in out.scheduled:
        if item.do_sample:
            rid = item.seq.request_id
            sampled[rid] = scripts[rid].pop(0) if scripts and rid in scripts else 1000 + out.step
    finished = s.update_from_output(out, sampled)
    s.check_invariants()
    return out, finished


def summary(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_scheduled_tokens) for item in out.scheduled]


# ---- batching -------------------------------------------------------------------------------------


def test_chunked_prefill_mixes_with_decodes_within_budget():
    s = make(max_num_batched_tokens=16)
    s.add(request("a", 5, start=100))
    s.add(request("b", 5, start=200))
    out, _ = step(s)
    assert summary(out) == [("a", 5), ("b", 5)]
    assert [item.do_sample for item in out.scheduled] == [True, True]
    s.add(request("c", 30, start=300))
    chunks = []
    for _ in range(4):
        out, _ = step(s)
        chunks.append((summary(out), out.num_decodes, out.num_batched_tokens, out.scheduled[-1].do_sample))
    assert chunks == [
        ([("a", 1), ("b", 1), ("c", 14)], 2, 16, False),
        ([("a", 1), ("b", 1), ("c", 14)], 2, 16, False),
        ([("a", 1), ("b", 1), ("c", 2)], 2, 4, True),  # completes c's prompt: sample
        ([("a", 1), ("b", 1), ("c", 1)], 3, 3, True),
    ]
    c = s.get("c")
    assert (c.num_computed_tokens, c.num_output_tokens) == (31, 2)
    assert out.scheduled[2].token_ids == [c.output_token_ids[0]]


def test_decodes_come_first_even_behind_a_higher_lane_prefill():
    s = make(max_num_batched_tokens=16, realtime_max_prompt_tokens=64)
    s.add(request("d", 2, start=100))
    step(s)
    s.add(request("r", 40, start=200, priority="realtime"))
    out, _ = step(s)
    assert summary(out) == [("d", 1), ("r", 15)]
    out, _ = step(s)
    assert [s_.request_id for s_ in s.running] == ["r", "d"]  # priority order
    assert summary(out) == [("d", 1), ("r", 15)]  # but the decode is batched first
    assert [item.is_decode for item in out.scheduled] == [True, False]
    assert (out.num_decodes, len(out.decodes), len(out.prefills)) == (1, 1, 1)


def test_without_chunked_prefill_a_prompt_waits_for_room():
    s = make(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    s.add(request("a", 20, start=100, max_tokens=5))
    s.add(request("b", 20, start=200, max_tokens=5))
    out, _ = step(s)
    assert summary(out) == [("a", 20)]
    out, _ = step(s)
    assert summary(out) == [("a", 1), ("b", 20)]
    with pytest.raises(ValueError, match="max_num_batched_tokens=16: without chunked prefill"):
        make(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)


def test_prefix_hit_skips_cached_tokens():
    s = make(max_num_batched_tokens=32)
    system = list(range(500, 508))  # two blocks
    s.add(Sequence("a", system + [1, 3, 5], SamplingParams(max_tokens=4)))
    step(s)
    s.add(Sequence("b", system + [7, 9], SamplingParams(max_tokens=4)))
    out, _ = step(s)
    b = s.get("b")
    assert summary(out) == [("a", 1), ("b", 2)]
    assert (b.num_cached_tokens, b.block_table[:2]) == (8, s.get("a").block_table[:2])


# ---- lanes and aging ------------------------------------------------------------------------------


def test_lane_order_and_fcfs_within_lane():
    s = make(max_num_seqs=1, realtime_max_prompt_tokens=8, bulk_min_prompt_tokens=16)
    for rid, n, priority in [
        ("b1", 4, "bulk"), ("d1", 4, "default"), ("long", 20, "default"),
        ("rlong", 12, "realtime"), ("d2", 4, "default"), ("r1", 4, "realtime"),
    ]:
        s.add(request(rid, n, max_tokens=1, priority=priority))
    lanes = {seq.request_id: seq.lane for seq in s.waiting_seqs()}
    assert lanes == {"b1": Lane.BULK, "d1": Lane.DEFAULT, "long": Lane.BULK,
                     "rlong": Lane.DEFAULT, "d2": Lane.DEFAULT, "r1": Lane.REALTIME}
    admitted = [summary(step(s)[0])[0][0]]
    s.add(request("r2", 4, max_tokens=1, priority="realtime"))  # arrives late, overtakes DEFAULT and BULK
    while s.has_unfinished():
        admitted.append(summary(step(s)[0])[0][0])
    assert admitted == ["r1", "r2", "d1", "rlong", "d2", "b1", "long"]


def test_aging_promotes_one_lane_every_aging_steps():
    s = make(max_num_seqs=1, aging_steps=3)
    s.add(request("hog", 4, start=100, max_tokens=50))
    s.add(request("b", 4, start=200, priority="bulk"))
    lanes = []
    for _ in range(7):
        step(s)
        lanes.append(s.get("b").lane)
    assert lanes == [Lane.BULK] * 2 + [Lane.DEFAULT] * 3 + [Lane.REALTIME] * 2


def test_aging_lets_a_starved_bulk_request_through_a_realtime_flood():
    s = make(max_num_seqs=1, aging_steps=2)
    s.add(request("b", 4, start=200, max_tokens=1, priority="bulk"))
    admitted = []
    for i in range(1, 8):
        s.add(request(f"r{i}", 4, start=300 + 10 * i, max_tokens=1, priority="realtime"))
        admitted.append(summary(step(s)[0])[0][0])
    # BULK -> DEFAULT after step 2, DEFAULT -> REALTIME after step 4, ahead of r5 at step 5.
    assert admitted == ["r1", "r2", "r3", "r4", "b", "r5", "r6"]


# ---- preemption -----------------------------------------------------------------------------------


def _five_lanes(s: Scheduler) -> None:
    for i, (rid, priority) in enumerate([("r", "realtime"), ("d1", "default"), ("d2", "default"),
                                         ("b1", "bulk"), ("b2", "bulk")]):
        s.add(request(rid, 4, start=100 * (i + 1), priority=priority))


def test_preemption_order_bulk_first_most_recent_first():
    s = make(num_blocks=7, max_num_batched_tokens=64)
    _five_lanes(s)
    out, _ = step(s)
    assert {seq.request_id: seq.block_table for seq in s.running} == {
        "r": [0], "d1": [1], "d2": [2], "b1": [3], "b2": [4]}
    # Every decode now needs a second block; the free list holds 5 and 6.
    out, _ = step(s)
    assert summary(out) == [("r", 1), ("d1", 1), ("d2", 1)]
    assert [seq.request_id for seq in out.preempted] == ["b2", "b1"]  # b1 finally preempts itself
    assert {seq.request_id: seq.block_table for seq in s.running} == {
        "r": [0, 5], "d1": [1, 6], "d2": [2, 4]}  # d2 got b2's evicted block
    assert [seq.request_id for seq in s.waiting_seqs()] == ["b1", "b2"]  # original order restored
    for _ in range(3):
        out, _ = step(s)
        assert (summary(out), out.preempted) == ([("r", 1), ("d1", 1), ("d2", 1)], [])
    out, _ = step(s)  # third blocks: r evicts b1's cached block, d1 preempts d2 (the newer DEFAULT)
    assert summary(out) == [("r", 1), ("d1", 1)]
    assert [seq.request_id for seq in out.preempted] == ["d2"]
    assert {seq.request_id: seq.block_table for seq in s.running} == {"r": [0, 5, 3], "d1": [1, 6, 4]}
    assert [seq.request_id for seq in s.waiting_seqs()] == ["d2", "b1", "b2"]
    assert (s.num_preemptions, s.get("d2").num_preemptions, s.get("b1").num_preemptions) == (3, 1, 1)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preempted_sequence_recomputes_and_keeps_its_output(enable_prefix_caching):
    s = make(num_blocks=3, max_num_batched_tokens=16, enable_prefix_caching=enable_prefix_caching)
    s.add(request("x", 4, start=100, max_tokens=4))
    s.add(request("r", 4, start=200, max_tokens=3, priority="realtime"))
    step(s)
    x = s.get("x")
    assert x.output_token_ids == [1001]
    out, _ = step(s)  # r takes the last free block; x, the lowest, preempts itself
    assert (summary(out), [seq.request_id for seq in out.preempted]) == ([("r", 1)], ["x"])
    assert (x.status, x.num_computed_tokens, x.block_table) == (SequenceStatus.WAITING, 0, [])
    out, finished = step(s)
    assert (summary(out), [seq.request_id for seq in finished]) == ([("r", 1)], ["r"])
    out, _ = step(s)
    item = out.scheduled[0]
    if enable_prefix_caching:  # its prompt block is still cached: only the sampled token is left
        assert (item.num_scheduled_tokens, item.is_decode, x.num_cached_tokens) == (1, True, 4)
    else:  # prompt + the output so far are prefilled again
        assert (item.num_scheduled_tokens, item.is_decode, x.num_cached_tokens) == (5, False, 0)
        assert item.token_ids == [100, 101, 102, 103, 1001]
    assert item.do_sample
    assert x.output_token_ids == [1001, 1004]  # sampling resumed after the kept output
    assert x.num_preemptions == 1


# ---- stopping, finishing, aborting ----------------------------------------------------------------


def test_stop_conditions():
    s = make(max_num_batched_tokens=64)
    cases = {
        "len": (dict(max_tokens=3), [5, 6, 7, 8]),
        "eos": (dict(max_tokens=10), [5, EOS, 9]),
        "stop_id": (dict(max_tokens=10, stop_token_ids=[42]), [5, 42, 9]),
        "min": (dict(max_tokens=10, min_tokens=3, stop_token_ids=[42]), [EOS, 42, EOS, 9]),
        "ignore_eos": (dict(max_tokens=3, ignore_eos=True), [EOS, EOS, EOS, EOS]),
        "eos_at_max": (dict(max_tokens=2), [5, EOS]),
    }
    scripts = {}
    for i, (rid, (params, script)) in enumerate(cases.items()):
        s.add(request(rid, 3, start=100 * (i + 1), **params))
        scripts[rid] = list(script)
    done = {}
    while s.has_unfinished():
        for seq in step(s, scripts)[1]:
            done[seq.request_id] = (seq.output_token_ids, seq.status, seq.finish_reason, seq.stop_reason)
    L, S = SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_STOPPED
    assert done == {
        "len": ([5, 6, 7], L, "length", None),
        "eos": ([5, EOS], S, "stop", None),
        "stop_id": ([5, 42], S, "stop", 42),
        "min": ([EOS, 42, EOS], S, "stop", None),
        "ignore_eos": ([EOS, EOS, EOS], L, "length", None),
        "eos_at_max": ([5, EOS], S, "stop", None),
    }
    assert s.block_manager.num_blocks_used == 0
    assert s.num_finished == 6


def test_finish_for_a_stop_string_and_abort_free_blocks():
    s = make(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        s.add(request(rid, 6, start=ord(rid) * 100))
    step(s)
    assert (s.num_running, s.num_waiting, s.block_manager.num_blocks_used) == (2, 1, 4)
    a = s.get("a")
    s.finish(a, SequenceStatus.FINISHED_STOPPED, stop_reason="###")  # the detokenizer saw a stop string
    assert (a.finish_reason, a.stop_reason, a.block_table, s.get("a")) == ("stop", "###", [], None)
    assert s.block_manager.num_blocks_used == 2
    c = s.abort("c")  # waiting
    assert (c.status, c.finish_reason, s.num_waiting) == (SequenceStatus.FINISHED_ABORTED, "abort", 0)
    assert s.abort("c") is None and s.abort("nope") is None
    out = s.schedule()
    b = s.abort("b")  # aborted between schedule() and update_from_output()
    assert s.update_from_output(out, {"b": 1}) == []
    assert b.block_table == [] and b.num_output_tokens == 1
    assert (s.has_unfinished(), s.block_manager.num_blocks_used, s.num_aborted) == (False, 0, 2)
    s.check_invariants()


def test_add_refuses_what_can_never_run():
    s = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt tokens 60 \+ max_tokens 20 = 80 exceeds max_model_len=64"):
        s.add(request("long", 60))
    with pytest.raises(ValueError, match="need 6 KV blocks, more than the whole pool of 4"):
        s.add(request("big", 10, max_tokens=12))
    with pytest.raises(ValueError, match="prompt is empty"):
        s.add(Sequence("empty", []))
    s.add(request("a", 4, max_tokens=4))
    with pytest.raises(ValueError, match="request_id='a': already scheduled"):
        s.add(request("a", 4, max_tokens=4))
    with pytest.raises(ValueError, match="max_num_batched_tokens=4: accepted >= max_num_seqs=8"):
        make(max_num_batched_tokens=4)


# ---- randomized simulation ------------------------------------------------------------------------


def test_random_simulation_keeps_invariants_and_leaks_nothing():
    rng = random.Random(0)
    s = make(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64,
             realtime_max_prompt_tokens=12, bulk_min_prompt_tokens=28, aging_steps=8)
    prefixes = [list(range(1000 * k, 1000 * k + 12)) for k in range(1, 4)]  # shared system prompts
    outputs: dict[str, list[int]] = {}
    n = 0
    for t in range(2000):
        if t < 200:
            for _ in range(rng.choice([0, 0, 1, 2])):
                n += 1
                suffix = [rng.randint(3, 99) for _ in range(rng.randint(1, 20))]
                prompt = rng.choice(prefixes)[: rng.randint(0, 12)] + suffix
                max_tokens = rng.randint(1, 16)
                params = SamplingParams(max_tokens=max_tokens,
                                        min_tokens=min(max_tokens, rng.choice([0, 0, 2])),
                                        priority=rng.choice(["realtime", "default", "bulk"]))
                s.add(Sequence(f"q{n}", prompt, params))
            if s.running and rng.random() < 0.03:
                s.abort(rng.choice(s.running).request_id)
        elif not s.has_unfinished():
            break
        out = s.schedule()
        assert out.num_batched_tokens <= s.max_num_batched_tokens
        assert out.num_batched_tokens == sum(item.num_scheduled_tokens for item in out.scheduled)
        assert len(out.scheduled) <= s.max_num_seqs
        assert not out.is_empty or not s.has_unfinished()
        is_decode = [item.is_decode for item in out.scheduled]
        assert is_decode == sorted(is_decode, reverse=True)  # decodes first
        for item in out.scheduled:
            seq = item.seq
            assert not item.is_decode or item.num_scheduled_tokens == 1
            assert item.num_computed_tokens + item.num_scheduled_tokens <= seq.num_tokens
            assert len(seq.block_table) * 4 >= item.num_computed_tokens + item.num_scheduled_tokens
        sampled = {i.seq.request_id: (EOS if rng.random() < 0.05 else rng.randint(3, 99))
                   for i in out.scheduled if i.do_sample}
        s.update_from_output(out, sampled)
        s.check_invariants()
        for seq in s.running + s.waiting_seqs():  # outputs only grow, across preemptions too
            before = outputs.get(seq.request_id, [])
            assert seq.output_token_ids[: len(before)] == before
            outputs[seq.request_id] = list(seq.output_token_ids)
    assert not s.has_unfinished()
    bm = s.block_manager
    assert bm.num_blocks_used == 0
    assert bm.num_blocks_free + bm.num_blocks_cached == bm.num_blocks_total
    bm.check_invariants([])
    # The run exercised what it is meant to.
    assert s.num_preemptions > 0 and bm.prefix_cache_hit_rate > 0 and bm.num_evictions > 0
    assert s.num_finished == n


def test_finished_statuses_are_exactly_those_with_a_finish_reason():
    from dsjax.engine.sequence import finish_reason_of

    for status in SequenceStatus:
        if status.is_finished:
            assert finish_reason_of(status) in ("stop", "length", "abort")
        else:
            assert status in (SequenceStatus.WAITING, SequenceStatus.RUNNING)
            with pytest.raises(ValueError, match="accepted a finished status"):
                finish_reason_of(status)


# ---- multi-step chunks ------------------------------------------------------------------------------


def test_multi_step_chunks_only_when_every_sequence_decodes():
    """num_scheduler_steps=4: a prefill step and any step with a request waiting stay single; once all decode,
    each sequence takes a chunk of up to 4 steps (fewer near max_tokens, and not past the min_tokens that mask
    its EOS), with cache room for every step; resolve takes the chunk's tokens up to a stop and frees the rest."""
    s = make(num_scheduler_steps=4, max_num_seqs=2)
    a = request("a", 3, max_tokens=6)
    b = request("b", 5, start=200, max_tokens=20, min_tokens=3)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.num_steps == 1 and all(item.num_steps == 1 for item in out.scheduled)  # the prefills
    s.update_from_output(out, {"a": 7, "b": 8})
    out = s.schedule()
    assert out.num_steps == 4 and {i.seq.request_id: i.num_steps for i in out.scheduled} == {"a": 4, "b": 2}
    assert all(i.num_scheduled_tokens == 1 and i.is_decode for i in out.scheduled)
    assert len(a.block_table) == 2 and len(b.block_table) == 2  # room for positions 3..6 and 5..6
    s.update_from_output(out, {"a": [10, 11, 12, 13], "b": [20, 21, 99, 99]})
    assert a.output_token_ids == [7, 10, 11, 12, 13] and b.output_token_ids == [8, 20, 21]
    assert a.num_computed_tokens == a.num_tokens - 1 and b.num_computed_tokens == b.num_tokens - 1
    out = s.schedule()
    assert {i.seq.request_id: i.num_steps for i in out.scheduled} == {"a": 1, "b": 4}  # a: one token to max_tokens
    finished = s.update_from_output(out, {"a": [14, 0, 0, 0], "b": [30, EOS, 31, 32]})
    assert {seq.request_id for seq in finished} == {"a", "b"}
    assert a.output_token_ids == [7, 10, 11, 12, 13, 14] and a.finish_reason == "length"
    assert b.output_token_ids == [8, 20, 21, 30, EOS] and b.finish_reason == "stop"  # the chunk's rest dropped
    assert s.block_manager.num_blocks_used == 0
    s.add(request("c", 3))
    s.add(request("d", 3, start=300))
    s.update_from_output(s.schedule(), {"c": 1, "d": 2})
    s.add(request("e", 3, start=400))  # waits: max_num_seqs=2
    assert s.schedule().num_steps == 1
    s = make(num_scheduler_steps=4)
    s.add(request("x", 3, max_tokens=2))
    s.update_from_output(s.schedule(), {"x": 5})
    out = s.schedule()  # one token from max_tokens: a chunk of one step is a plain step
    assert out.num_steps == 1 and [i.num_steps for i in out.scheduled] == [1]
