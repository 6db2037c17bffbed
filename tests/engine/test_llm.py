"""The engine end to end on the tiny preset: greedy outputs equal the no-cache forward through
chunked prefill, small blocks and preemption; prefix caching; seeds; stops; logprobs; n."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import LLM, SamplingParams

# 120 blocks of 4 tokens: room for one 325-token sequence but far from all of 16 long prompts at once.
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=384, block_size=4, num_kv_blocks=120)


@pytest.fixture(scope="module")
def llm():
    """One engine for the module: each compiles its six step buckets (seconds on CPU)."""
    return LLM("tiny", dtype="float32", progress=False, **ENGINE)


def reference_greedy(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy continuation from full causal forwards without a cache (one [B, L] buffer per step)."""
    length = max(map(len, prompts)) + num_tokens
    buffer = np.zeros((len(prompts), length), np.int32)
    for i, p in enumerate(prompts):
        buffer[i, :len(p)] = p
    out = [[] for _ in prompts]
    for step in range(num_tokens):
        logits = np.asarray(model.logits(buffer))
        for i, p in enumerate(prompts):
            pos = len(p) + step
            out[i].append(int(np.argmax(logits[i, pos - 1])))
            buffer[i, pos] = out[i][-1]
    return out


def _prompts(num, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 259, size=n).tolist() for n in lengths[:num]]


def test_greedy_matches_uncached_forward_with_chunking_and_preemption(llm):
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 200, 233, 260, 300, 317]
    prompts = _prompts(16, lengths)
    num_new = 8
    engine = llm.engine
    preemptions_before = llm.stats()["num_preemptions"]
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, params, prompt_token_ids=p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
    stats = llm.stats()
    assert stats["num_preemptions"] > preemptions_before
    assert stats["num_blocks_used"] == 0  # nothing leaked
    expected = reference_greedy(llm.model, prompts, num_new)
    for i in range(len(prompts)):
        assert done[str(i)] == expected[i], f"prompt {i} (length {lengths[i]})"


def test_prefix_cache_second_pass(llm):
    rng = np.random.default_rng(3)
    system = rng.integers(3, 259, size=120).tolist()
    prompts = [system + rng.integers(3, 259, size=6).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    before = llm.stats()
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    after = llm.stats()
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    assert hits / queries > 0.8
    assert second == first


def test_partial_block_prefix_hits_match_the_uncached_forward(llm):
    """A template that ends mid-block (30 tokens, blocks of 4): later prompts reuse 7 whole blocks and
    2 tokens of the 8th through a device copy, and still decode exactly like a cache-free forward."""
    rng = np.random.default_rng(5)
    template = rng.integers(3, 259, size=30).tolist()
    first = template + rng.integers(3, 259, size=10).tolist()
    later = [template + rng.integers(3, 259, size=n).tolist() for n in (3, 6, 9)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.engine.block_manager.reset_prefix_cache()
    partial_before = llm.engine.block_manager.num_partial_hits
    outs = llm.generate([first], params) + llm.generate(later, params)
    assert [o.num_cached_tokens for o in outs] == [0, 30, 30, 30]
    assert llm.engine.block_manager.num_partial_hits - partial_before == 3
    expected = reference_greedy(llm.model, [first, *later], 5)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["num_blocks_used"] == 0


def test_seed_reproduces_samples_regardless_of_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate(["the quick brown fox"], params)[0].outputs[0].token_ids
    crowd = llm.generate(["other prompt", "the quick brown fox", "x" * 40],
                         [SamplingParams(max_tokens=5, temperature=1.0), params,
                          SamplingParams(max_tokens=9, temperature=0.7)])
    assert crowd[1].outputs[0].token_ids == alone
    # And an unfiltered seeded request draws the same whether or not a neighbour filters (top-k/p).
    plain = SamplingParams(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    plain_alone = llm.generate(["the quick brown fox"], plain)[0].outputs[0].token_ids
    beside_filter = llm.generate(["the quick brown fox", "other"], [plain, params])[0].outputs[0].token_ids
    assert beside_filter == plain_alone
    other_seed = llm.generate(["the quick brown fox"], SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llm):
    """A batch of greedy rows takes the greedy sampler (no keys, no draw: ``sample(greedy=True)``); a top-k 1
    draw through the filtered one picks the same tokens."""
    samplers, calls = llm.engine.runner._samplers, []
    built = {key: fn for key, fn in samplers.items() if key[3]}  # compile_all's greedy samplers, counted
    assert built
    samplers.update({key: (lambda fn: lambda *a: calls.append(1) or fn(*a))(fn) for key, fn in built.items()})
    try:
        greedy = llm.generate("abc", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        assert len(calls) >= 8  # a step a token
        top1 = llm.generate("abc", SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=5,
                                                  ignore_eos=True))[0]
    finally:
        samplers.update(built)
    assert len(calls) < 10  # the top-k draws took the filtered sampler
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_greedy_sampler_matches_the_general_one():
    """sample(greedy=True), for batches whose rows are all greedy, gives what the general path gives them:
    the argmax (EOS masked where min_tokens asks), its log-probability, the top log-probabilities."""
    import jax

    from dsjax.engine.sampler import SamplingArrays, sample

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, 50)) * 3, jnp.float32).at[1, 7].set(40.0)  # row 1: EOS on top
    rows = 4
    arrays = SamplingArrays(jnp.zeros(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows),
                            jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32),
                            jnp.asarray([False, True, False, False]), jnp.full(rows, 2, jnp.int32))
    run = jax.jit(lambda g: sample(logits, arrays, (7,), 3, filtered=False, logprobs=True, greedy=g), static_argnums=0)
    fast, general = run(True), run(False)
    for got, want in zip(fast, general):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(fast.token_ids[1]) != 7  # masked
    plain = sample(logits, arrays, (7,), 3, filtered=False, logprobs=False, greedy=True)  # no top log-probabilities:
    assert plain.top_ids is None and plain.top_logprobs is None  # not outputs of the program at all
    np.testing.assert_array_equal(np.asarray(plain.token_ids), np.asarray(fast.token_ids))


@pytest.mark.parametrize("one_pass", [True, False])
def test_sampler_log_probabilities_are_log_softmax(one_pass, monkeypatch):
    """The sampler's one-pass reduction (argmax, max and the sum of exponentials, rescaled as partials meet; and
    the two-pass form it replaces, sampler.ONE_PASS) gives jnp.argmax's token (ties to the lower index, masked
    EOS never) and jax.nn.log_softmax's log-probabilities: the drawn token's and the top ones, over a vocabulary
    long enough for many partials."""
    import jax

    from dsjax.engine import sampler
    from dsjax.engine.sampler import SamplingArrays, sample

    monkeypatch.setattr(sampler, "ONE_PASS", one_pass)

    rng = np.random.default_rng(3)
    rows, vocab = 5, 70_000
    logits = jnp.asarray(rng.standard_normal((rows, vocab)) * 4, jnp.float32)
    logits = logits.at[0, 123].set(30.0).at[0, 60_001].set(30.0)  # row 0: a tie, the lower index wins
    logits = logits.at[1, 7].set(50.0)  # row 1: EOS on top, masked (min_tokens)
    logits = logits.at[2, :].set(-jnp.inf).at[2, 9].set(1.0)  # row 2: one finite logit
    logits = logits.at[3, : vocab // 2].set(-jnp.inf)  # row 3 (drawn, as row 4): half of its logits -inf
    arrays = SamplingArrays(jnp.asarray([0.0, 0.0, 0.0, 0.7, 1.3]), jnp.zeros(rows, jnp.int32), jnp.ones(rows),
                            jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32),
                            jnp.asarray([False, True, False, False, False]), jnp.full(rows, 3, jnp.int32))
    got = jax.jit(lambda: sample(logits, arrays, (7,), 3, filtered=False, logprobs=True))()
    masked = logits.at[1, 7].set(-jnp.inf)
    want = jax.nn.log_softmax(masked, axis=-1)
    tokens = np.asarray(got.token_ids)
    np.testing.assert_array_equal(tokens[:3], np.asarray(jnp.argmax(masked, axis=-1))[:3])
    assert tokens[0] == 123 and tokens[1] != 7 and tokens[2] == 9 and tokens[3] >= vocab // 2
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want)[np.arange(rows), tokens], atol=2e-5)
    top_logprobs, top_ids = jax.lax.top_k(want, 3)
    np.testing.assert_allclose(np.asarray(got.top_logprobs), np.asarray(top_logprobs), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got.top_ids)[[1, 2, 3, 4]], np.asarray(top_ids)[[1, 2, 3, 4]])
    assert float(got.logprobs[2]) == 0.0  # the only finite logit: probability 1


def test_sampler_returns_the_next_steps_last_tokens(llm):
    """The runner's sampler returns one SampleResult whose token_ids, padded to every row of last_tokens, are
    the next step's last_tokens (no second output holding the same tokens: a copy on the device)."""
    runner = llm.engine.runner
    rows, max_rows = 2, runner.config.max_num_seqs
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((rows, runner.model_config.vocab_size)), jnp.float32)
    packed = jnp.zeros((runner.layout.packed_length(rows),), jnp.int32)  # the step's inputs, greedy rows
    result = runner._sampler(rows, False, False, True)(logits, packed)
    assert result.token_ids.shape == (max_rows,) and result.top_ids is None
    np.testing.assert_array_equal(np.asarray(result.token_ids[:rows]), np.asarray(jnp.argmax(logits, axis=-1)))


def test_stop_token_ids_and_max_tokens(llm):
    free = llm.generate("stop here", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    out = llm.generate("stop here", SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.outputs[0].token_ids == free.token_ids[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_stop_string_truncates_text(llm):
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = llm.generate("abcdef", SamplingParams(**params))[0].outputs[0]
    # The random model emits arbitrary bytes; any whole character (not U+FFFD) can serve as the stop.
    candidates = [ch for ch in free.text if ch != "\ufffd"]
    assert candidates, f"no whole character in {free.text!r}"
    stop = candidates[len(candidates) // 2]
    out = llm.generate("abcdef", SamplingParams(stop=[stop], **params))[0].outputs[0]
    assert out.text == free.text[:free.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(free.token_ids)


def test_detokenizer_stop_across_tokens():
    from dsjax.engine.detokenizer import IncrementalDetokenizer

    tok = dsjax.load_tokenizer("tiny")
    ids = tok.encode("hello STOP world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [0], stop=("STOP",))
    for i in ids:
        detok.append(i)
        if detok.stop_reason:
            break
    assert detok.text == "hello " and detok.stop_reason == "STOP"
    utf8 = IncrementalDetokenizer(tok, [0])
    pieces = [utf8.append(i) for i in tok.encode("é✓", add_special_tokens=False)]
    assert "".join(pieces) == "é✓" and pieces[0] == ""  # waits for the whole character


@pytest.mark.parametrize("model", ["tiny", "default"])
def test_deferred_detokenizer_gives_the_incremental_text(model):
    """Offline requests without stop strings decode once at the end: same text as token by token,
    random ids included (bytes that split multi-byte characters, U+FFFD in between)."""
    from dsjax.engine.detokenizer import IncrementalDetokenizer

    tok = dsjax.load_tokenizer(model)
    rng = np.random.default_rng(0)
    for prompt, output in [(tok.encode("x = 1"), tok.encode(" é✓ déjà\n\tdef f():", add_special_tokens=False)),
                           *[(rng.integers(3, 500, 7).tolist(), rng.integers(3, 500, 40).tolist()) for _ in range(5)]]:
        eager, deferred = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt, deferred=True)
        for token in output:
            eager.append(token)
            assert deferred.append(token) == ""
        eager.flush(), deferred.flush()
        assert deferred.text == eager.text
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tok, [0], stop=("x",), deferred=True)


def test_logprobs_and_n(llm):
    out = llm.generate("hi", SamplingParams(max_tokens=4, temperature=0.8, n=3, logprobs=2, seed=7, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert len(completion.token_ids) == 4 and len(completion.logprobs) == 4
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry and all(lp <= 0 for lp in entry.values())
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t] for t, e in zip(completion.token_ids, completion.logprobs)), rel=1e-5)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_prompt_too_long_is_refused(llm):
    with pytest.raises(ValueError, match=r"prompt 0: 400 prompt tokens \+ max_tokens=16 exceed max_model_len=384"):
        llm.generate([[5] * 400])


def test_empty_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.engine.add_request("empty", None, SamplingParams(), prompt_token_ids=[])


def test_stats_report_buckets(llm):
    stats = llm.stats()
    assert stats["buckets"] == [1, 2, 4, 8, 16, 32] and stats["num_compiled_shapes"] == 6
    assert 0 <= stats["padding_ratio"] < 1 and stats["warmup_seconds"] > 0


def test_step_kernel_buckets_compile_without_command_buffers(llm, monkeypatch):
    """A bucket whose forward runs the batch-1 step kernel compiles with XLA's command buffers off
    (runner.STEP_KERNEL_GRAPHS, decode_profile.md round 32), every other bucket with the backend's options; the
    option compiles (on CPU XLA ignores it)."""
    from dsjax.engine import runner as runner_module

    runner = llm.engine.runner
    assert not any(runner.runs_step_kernel(t) for t in runner.buckets.sizes)  # the reference backend on CPU
    assert runner._compiler_options(1) == runner.compiler_options
    monkeypatch.setattr(runner, "runs_step_kernel", lambda t: t == 1)
    assert runner._compiler_options(1) == {**(runner.compiler_options or {}), "xla_gpu_enable_command_buffer": ""}
    assert runner._compiler_options(2) == runner.compiler_options
    compiled = runner._jitted.lower(runner._state_leaves, runner.cache,
                                    jnp.zeros((runner.layout.packed_length(1),), jnp.int32),
                                    runner.last_tokens).compile(runner._compiler_options(1))
    assert compiled.as_text()
    monkeypatch.setattr(runner_module, "STEP_KERNEL_GRAPHS", True)
    assert runner._compiler_options(1) == runner.compiler_options


def test_compiled_steps_update_the_kv_pool_in_place(llm):
    """The donated pool is written in place: no step copies it (on CPU a one-token step once copied
    the whole pool several times a layer, making decode cost grow with the pool, not the context)."""
    runner = llm.engine.runner
    pool_shapes = {f"{jnp.dtype(a.dtype).name.replace('float', 'f')}[{','.join(map(str, a.shape))}]"
                   for a in (runner.cache.c_kv, runner.cache.k_pe)}
    for bucket, compiled in runner._compiled.items():
        copies = [line for line in compiled.as_text().splitlines()
                  if re.search(r"= (\S+)\{[\d,]+\} copy\(", line) and
                  re.search(r"= (\S+)\{", line).group(1) in pool_shapes]
        assert not copies, f"bucket {bucket} copies the KV pool: {copies[0].strip()[:200]}"


def test_failed_step_aborts_only_its_requests(llm, monkeypatch):
    from dsjax.engine.llm_engine import StepFailedError

    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("ok", None, params, prompt_token_ids=[5, 6, 7])
    engine.step()  # "ok" is running before the bad request arrives
    engine.add_request("bad", None, params, prompt_token_ids=[8, 9])
    real = engine.runner.dispatch

    def fail_once(out, rows, pending_rows=None):
        monkeypatch.setattr(engine.runner, "dispatch", real)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "dispatch", fail_once)
    with pytest.raises(StepFailedError) as err:
        engine.step()
    assert sorted(err.value.request_ids) == ["bad", "ok"]  # both were in the failed step
    assert not engine.has_unfinished_requests() and engine.block_manager.num_blocks_used == 0
    engine.scheduler.check_invariants()
    out = llm.generate([[5, 6, 7]], params)[0]  # and the engine keeps serving
    assert len(out.outputs[0].token_ids) == 6
