"""Async scheduling: each step is queued before the previous one's tokens are read, and a decode takes
its pending token straight from the device. Outputs must equal the synchronous engine's exactly, with
stops, preemption, prefix hits, n > 1, logprobs and seeds; aborts and failures must not leak blocks."""

from __future__ import annotations

import pytest

from dsjax import LLM, SamplingParams
from dsjax.engine.llm_engine import StepFailedError
from dsjax.engine.sequence import PENDING_TOKEN

# A pool of 24 blocks x 4 tokens for up to 8 sequences: the mixed set below preempts.
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=384, block_size=4, num_kv_blocks=24)


@pytest.fixture(scope="module")
def engines():
    return (LLM("tiny", dtype="float32", progress=False, **ENGINE),
            LLM("tiny", dtype="float32", progress=False, async_scheduling=True, **ENGINE))


def mixed_requests(stop_token: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[5, 6, 7], list(range(3, 43)), [9, 8, 7, 6, 5, 4, 3], list(range(3, 43)) + [11, 12],
               [100, 101], list(range(50, 70)), [7] * 13, [21, 22, 23, 24]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=9, temperature=1.0, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.7, top_p=0.9, seed=11, min_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, stop=["e"], ignore_eos=True),
    ]
    return prompts, params


def summary(outputs) -> list:
    """Tokens, text, finish and the top-logprob ids exactly; the logprob values go to ``logprob_values``
    (the two engines' prefix caches differ, so a prompt may be split differently between cache and
    compute: float32 noise, not a different result)."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs and [list(e) for e in c.logprobs])
             for c in out.outputs] for out in outputs]


def logprob_values(outputs) -> list[float]:
    return [lp for out in outputs for c in out.outputs for entry in c.logprobs or [] for lp in entry.values()]


def outputs_equal_sync(sync, llm):
    """The mixed requests through ``llm`` give the sync engine's outputs exactly (log-probability values to
    1e-4) -> (llm's outputs, the sync engine's, the prompts, their params)."""
    greedy = sync.generate([[9, 8, 7, 6, 5, 4, 3]], SamplingParams(max_tokens=16, temperature=0.0))[0]
    stop_token = greedy.outputs[0].token_ids[5]  # request 2 stops on its 6th token (or earlier)
    prompts, params = mixed_requests(stop_token)
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert summary(got) == summary(expected)
    assert logprob_values(got) == pytest.approx(logprob_values(expected), abs=1e-4)
    return got, expected, prompts, params


def test_async_outputs_equal_sync(engines):
    sync, overlapped = engines
    got, expected, prompts, params = outputs_equal_sync(sync, overlapped)
    assert got[2].outputs[0].finish_reason == "stop" and len(got[2].outputs[0].token_ids) <= 6
    for cpl_got, cpl_expected in zip(got[3].outputs, expected[3].outputs):
        assert cpl_got.cumulative_logprob == pytest.approx(cpl_expected.cumulative_logprob, abs=1e-4)
    assert overlapped.stats()["num_preemptions"] > 0  # the small pool forced recomputation
    # The second pass hits the prefix cache in both, with the same tokens.
    again = overlapped.generate(prompts, params, use_tqdm=False)
    assert summary(again) == summary(expected)
    assert logprob_values(again) == pytest.approx(logprob_values(expected), abs=1e-4)
    assert overlapped.stats()["prefix_cache_hits"] > 0
    for llm in engines:
        assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_blocks_used == 0
        llm.engine.scheduler.check_invariants()


def test_async_outputs_with_the_copy_queued_at_dispatch(engines, monkeypatch):
    """runner.COPY_AT_DISPATCH: each step's samples start their copy to the host as the step is queued (every
    array of the result: log-probabilities too; fetch's device_get starts them otherwise); the outputs stay the
    sync engine's."""
    from jax._src.array import ArrayImpl

    from dsjax.engine import runner

    started, in_dispatch = [], []
    copy, dispatch = ArrayImpl.copy_to_host_async, runner.ModelRunner.dispatch

    def counting_copy(array):
        started.append(array.shape)
        return copy(array)

    def counting_dispatch(self, *args, **kwargs):
        before = len(started)
        handle = dispatch(self, *args, **kwargs)
        in_dispatch.append(len(started) - before)
        return handle

    monkeypatch.setattr(ArrayImpl, "copy_to_host_async", counting_copy)
    monkeypatch.setattr(runner.ModelRunner, "dispatch", counting_dispatch)
    sync, overlapped = engines
    outputs_equal_sync(sync, overlapped)
    assert in_dispatch and not any(in_dispatch)  # off: fetch alone copies
    in_dispatch.clear()
    monkeypatch.setattr(runner, "COPY_AT_DISPATCH", True)
    outputs_equal_sync(sync, overlapped)
    # the sync engine's dispatches too: two arrays a step at least (token ids and log-probabilities)
    assert in_dispatch and min(in_dispatch) >= 2


def test_async_step_reports_one_call_later(engines):
    engine = engines[1].engine
    steps = engine.num_steps
    engine.add_request("a", None, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       prompt_token_ids=[5, 6, 7])
    assert engine.step() == []  # the prefill is queued; nothing read yet
    seq = engine.scheduler.get("a")
    assert seq.output_token_ids == [PENDING_TOKEN]  # sampled on the device, not yet known here
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
            assert PENDING_TOKEN not in tokens
    assert len(tokens) == 3 and out.finished and out.outputs[0].finish_reason == "length"
    # max_tokens is known ahead: no step is spent past it (prefill + 2 decodes).
    assert engine.num_steps - steps == 3
    assert engine.block_manager.num_blocks_used == 0


def test_async_abort_while_in_flight(engines):
    engine = engines[1].engine
    engine.add_request("gone", None, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                       prompt_token_ids=[5, 6, 7, 8])
    engine.step()
    engine.step()  # a decode of the pending token is in flight
    assert engine.abort_request("gone")
    assert engine.has_unfinished_requests()  # its step still has to land
    assert engine.step() == []
    assert not engine.has_unfinished_requests() and engine.block_manager.num_blocks_used == 0
    engine.scheduler.check_invariants()


def test_async_failed_read_aborts_both_queued_steps(engines, monkeypatch):
    engine = engines[1].engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("first", None, params, prompt_token_ids=[5, 6, 7])
    engine.step()  # "first" is in flight
    engine.add_request("second", None, params, prompt_token_ids=[8, 9])
    real = engine.runner.fetch

    def fail_once(handle):
        monkeypatch.setattr(engine.runner, "fetch", real)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "fetch", fail_once)
    with pytest.raises(StepFailedError) as err:
        engine.step()  # queues a step with both, then reading the first step fails
    assert sorted(err.value.request_ids) == ["first", "second"]
    assert not engine.has_unfinished_requests() and engine.block_manager.num_blocks_used == 0
    out = engines[1].generate([[5, 6, 7]], params, use_tqdm=False)[0]  # and the engine keeps serving
    assert len(out.outputs[0].token_ids) == 6


def test_packed_step_inputs_equal_sync(engines):
    """Without a mesh a step's inputs, the sampling arrays' too, reach the device as one int32 vector
    (StepLayout.pack) that the forward and the sampler slice apart (unpack, unpack_sampling; buckets up to and
    past max_num_seqs); the async engine's outputs stay the sync engine's."""
    import jax
    import numpy as np

    sync, llm = engines
    runner = llm.engine.runner
    layout = runner.layout
    assert runner._packs and sorted(runner._compiled) == [1, 2, 4, 8, 16, 32]
    for t in (1, 8, 16, 32):  # the bucket comes back from the vector's length alone
        rng = np.random.default_rng(t)
        host = jax.tree.map(lambda a: rng.integers(-5, 1000, a.shape).astype(a.dtype), layout.abstract(t))
        sampling = host.sampling
        host = host._replace(sampling=sampling._replace(
            temperature=rng.uniform(0, 2, sampling.temperature.shape).astype(np.float32),
            top_p=rng.uniform(0, 1, sampling.top_p.shape).astype(np.float32),
            seeds=rng.integers(0, 2**32, sampling.seeds.shape, dtype=np.uint64).astype(np.uint32),
            mask_eos=rng.integers(0, 2, sampling.mask_eos.shape).astype(np.bool_)))
        packed = layout.pack(host)
        assert packed.dtype == np.int32 and packed.shape == (layout.packed_length(t),)
        back = layout.unpack(packed, runner.buckets.sizes)
        for got, want in zip(jax.tree.leaves(back._replace(sampling=None)), jax.tree.leaves(host._replace(sampling=None))):
            np.testing.assert_array_equal(got, want)
        rows = layout.num_rows(t)
        for got, want in zip(layout.unpack_sampling(jax.numpy.asarray(packed), rows), host.sampling):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), want)
    outputs_equal_sync(sync, llm)


def test_greedy_sampler_inside_the_forward_equals_sync(engines, monkeypatch):
    """runner.GREEDY_IN_FORWARD: a bucket that runs the batch-1 step kernel (forced here for bucket 1) also compiles
    its forward with the greedy sampler inside, and its steps whose rows all decode greedily without
    log-probabilities run that one program (no sampler program); the outputs stay the sync engine's, a lone greedy
    request's and min_tokens' EOS mask included."""
    from dsjax.engine import runner as runner_module

    sync, _ = engines
    monkeypatch.setattr(runner_module, "GREEDY_IN_FORWARD", True)
    monkeypatch.setattr(runner_module.ModelRunner, "runs_step_kernel", lambda self, t: t == 1)
    llm = LLM("tiny", dtype="float32", progress=False, async_scheduling=True, **ENGINE)
    runner = llm.engine.runner
    assert sorted(runner._greedy_forwards) == [1]
    one, two = [], []  # launches of bucket 1's one program, and of its greedy sampler program
    counted = lambda fn, calls: lambda *a: calls.append(1) or fn(*a)
    runner._greedy_forwards[1] = counted(runner._greedy_forwards[1], one)
    runner._samplers[1, False, False, True] = counted(runner._samplers[1, False, False, True], two)
    outputs_equal_sync(sync, llm)
    for params in (SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.0, min_tokens=15)):
        alone = [[9, 8, 7, 6, 5, 4, 3]]
        assert summary(llm.generate(alone, params, use_tqdm=False)) == summary(sync.generate(alone, params, use_tqdm=False))
    assert len(one) > 20  # the lone greedy requests' decodes, one program a step
    logprobs = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    before = len(one)
    assert summary(llm.generate([[5, 6, 7]], logprobs, use_tqdm=False)) == summary(
        sync.generate([[5, 6, 7]], logprobs, use_tqdm=False))
    assert len(one) == before and (1, False, True, True) in runner._samplers  # log-probabilities: two programs
    assert not two


@pytest.mark.parametrize("greedy_in_forward", [True, False])
def test_greedy_only_compiles_what_a_greedy_step_launches(engines, monkeypatch, greedy_in_forward):
    """compile_all(greedy_only=True) (the step A/Bs' compile): of a step-kernel bucket (forced for bucket 1) only
    its forward with the greedy sampler inside, or without GREEDY_IN_FORWARD the forward and the greedy sampler;
    a later compile_all compiles the rest without counting the bucket twice, and the outputs stay the sync
    engine's."""
    from dsjax.engine import runner as runner_module

    sync, _ = engines
    monkeypatch.setattr(runner_module, "GREEDY_IN_FORWARD", greedy_in_forward)
    monkeypatch.setattr(runner_module.ModelRunner, "runs_step_kernel", lambda self, t: t == 1)
    llm = LLM("tiny", dtype="float32", progress=False, **ENGINE)
    runner = llm.engine.runner
    shapes = runner.num_compiled_shapes
    assert shapes == len(runner.buckets.sizes) > 1
    runner.clear_compiled()
    runner.compile_all([1], greedy_only=True)
    assert sorted(runner._greedy_forwards) == ([1] if greedy_in_forward else [])
    assert sorted(runner._compiled) == ([] if greedy_in_forward else [1])
    assert list(runner._samplers) == ([] if greedy_in_forward else [(1, False, False, True)])
    runner.compile_all([1], greedy_only=True)  # nothing left to compile for it
    assert runner.num_compiled_shapes == shapes + 1
    runner.compile_all()
    assert sorted(runner._compiled) == sorted(runner.buckets.sizes)
    assert all((t, False, False, False) in runner._samplers for t in runner.buckets.sizes)  # bucket 1's too
    assert runner.num_compiled_shapes == 2 * shapes
    outputs_equal_sync(sync, llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multi_step_chunks_equal_sync(engines, async_scheduling):
    """num_scheduler_steps=4: once every running sequence decodes and none waits, a step is a chunk of up to 4
    decode steps in one program (short of a sequence's max_tokens, and of the min_tokens that mask its EOS), and
    a sequence that stops inside one drops the rest. The mixed requests (stop tokens and strings, seeds, n=2,
    log-probabilities, min_tokens, preemption in a small pool, prefix hits) give the single-step sync engine's
    outputs exactly, with and without async scheduling; no block leaks."""
    sync, _ = engines
    llm = LLM("tiny", dtype="float32", progress=False, async_scheduling=async_scheduling, num_scheduler_steps=4,
              **ENGINE)
    runner = llm.engine.runner
    chunks = []
    launch = runner.launch
    runner.launch = lambda t, inputs, row_steps=None: (chunks.append(row_steps), launch(t, inputs, row_steps))[1]
    got, expected, prompts, params = outputs_equal_sync(sync, llm)
    steps = [r for r in chunks if r is not None]
    assert steps and max(int(r.max()) for r in steps) == 4  # chunks ran, whole ones too
    assert any(0 < int(r[r > 0].min()) < 4 for r in steps)  # and rows of fewer steps (max_tokens, min_tokens)
    assert any(key[2] for key in runner._chunks)  # the log-probabilities' chunk program too
    # One lone greedy request: prefill, then chunks of 4 (a token each step of the device, 4 a launch).
    before = llm.engine.num_steps
    alone = [[9, 8, 7, 6, 5, 4, 3]]
    greedy = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    assert summary(llm.generate(alone, greedy, use_tqdm=False)) == summary(sync.generate(alone, greedy,
                                                                                         use_tqdm=False))
    assert llm.engine.num_steps - before == 1 + 3
    again = llm.generate(prompts, params, use_tqdm=False)  # prefix hits on blocks a chunk filled
    assert summary(again) == summary(expected) and llm.engine.stats()["prefix_cache_hits"] > 0
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_blocks_used == 0
    llm.engine.scheduler.check_invariants()


def test_multi_step_chunk_blocks_are_cached_once_read():
    """A chunk's own tokens are pending when it is committed: the blocks they fill are hashed when the chunk is
    read back (not with the placeholder), so a follow-up prompt repeating the generated text hits as many cached
    tokens as after single steps."""
    settings = dict(ENGINE, max_num_seqs=2, num_kv_blocks=48)
    hits = []
    for steps in (1, 4):
        llm = LLM("tiny", dtype="float32", progress=False, num_scheduler_steps=steps, **settings)
        prompt = [5, 6, 7, 8, 9]
        first = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        follow_up = prompt + first.outputs[0].token_ids[:11] + [3, 4]
        before = llm.engine.stats()["prefix_cache_hits"]
        llm.generate([follow_up], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        hits.append(llm.engine.stats()["prefix_cache_hits"] - before)
    assert hits[0] >= 12 and hits[1] == hits[0]
