"""The engine thread <-> asyncio bridge, on the model-free FakeEngine: outputs in order, admission control,
aborts that free KV blocks, a failing step that fails only its batch, shutdown."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine, expected_text

from dsjax.config import EngineConfig
from dsjax.engine.sampling_params import SamplingParams
from dsjax.serve import fault_inject
from dsjax.serve.async_engine import AsyncEngine, EngineDeadError, EngineStepError, QueueFullError

SMALL = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=8)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _collect(stream):
    last = None
    async for output in stream:
        last = output
    return last


async def _until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def test_outputs_arrive_and_blocks_are_freed():
    async def main():
        engine = FakeEngine(SMALL)
        bridge = AsyncEngine(engine, max_queue_len=8)
        bridge.start()
        streams = [await bridge.add_request(f"r{i}", None, SamplingParams(max_tokens=5 + i), [0, 10, 11 + i])
                   for i in range(6)]
        finals = await asyncio.gather(*[_collect(s) for s in streams])
        assert [f.outputs[0].text for f in finals] == [expected_text(5 + i) for i in range(6)]
        assert bridge.num_in_flight == 0
        await _until(lambda: bridge.snapshot()["num_running"] == 0)
        assert bridge.snapshot()["num_blocks_used"] == 0
        await bridge.stop()

    run(main())


def test_engine_refusal_reaches_the_caller():
    async def main():
        bridge = AsyncEngine(FakeEngine(SMALL), max_queue_len=8)
        bridge.start()
        with pytest.raises(ValueError, match="max_model_len"):
            await bridge.add_request("long", None, SamplingParams(max_tokens=250), list(range(3, 20)))
        assert bridge.num_in_flight == 0
        await bridge.stop()

    run(main())


def test_queue_full_while_the_engine_is_busy():
    async def main():
        engine = FakeEngine(SMALL)
        engine.runner.gate.clear()  # the first step blocks: later adds stay queued
        bridge = AsyncEngine(engine, max_queue_len=2)
        bridge.start()
        first = asyncio.ensure_future(bridge.add_request("a", None, SamplingParams(max_tokens=3), [0, 5]))
        await _until(lambda: engine.num_steps == 0 and engine.scheduler.num_running == 1)
        # 4 running slots + 2 waiting: room for 5 more besides "a".
        queued = [asyncio.ensure_future(bridge.add_request(f"q{i}", None, SamplingParams(max_tokens=3), [0, 5]))
                  for i in range(5)]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError, match="max_queue_len=2"):
            await bridge.add_request("refused", None, SamplingParams(max_tokens=3), [0, 5])
        engine.runner.gate.set()
        streams = [await first] + [await q for q in queued]
        assert all(final.finished for final in await asyncio.gather(*[_collect(s) for s in streams]))
        await bridge.stop()

    run(main())


def test_abort_mid_stream_frees_blocks():
    async def main():
        engine = FakeEngine(SMALL, step_delay=0.002)
        bridge = AsyncEngine(engine, max_queue_len=8)
        bridge.start()
        stream = await bridge.add_request("long", None, SamplingParams(max_tokens=200), list(range(3, 40)))
        await stream.__anext__()
        assert bridge.snapshot()["num_blocks_used"] > 0
        stream.abort()
        await _until(lambda: not bridge.num_in_flight and bridge.snapshot()["num_blocks_used"] == 0
                     and bridge.snapshot()["num_running"] == 0)
        await bridge.stop()
        assert not engine.has_unfinished_requests()

    run(main())


def test_failed_step_fails_its_batch_only_and_the_engine_keeps_going():
    async def main():
        engine = FakeEngine(SMALL.replace(max_num_seqs=1, max_num_batched_tokens=32))
        fault_inject.install(engine, "BOOM")
        bridge = AsyncEngine(engine, max_queue_len=8)
        bridge.start()
        bad = await bridge.add_request("bad", "BOOM", SamplingParams(max_tokens=4), engine.tokenizer.encode("BOOM"))
        good = await bridge.add_request("good", "fine", SamplingParams(max_tokens=4), engine.tokenizer.encode("fine"))
        with pytest.raises(EngineStepError, match="injected fault"):
            await _collect(bad)
        assert (await _collect(good)).outputs[0].text == expected_text(4)
        snapshot = bridge.snapshot()
        assert snapshot["num_step_failures"] == 1 and snapshot["num_blocks_used"] == 0 and snapshot["healthy"]
        engine.scheduler.check_invariants()
        await bridge.stop()

    run(main())


def test_stop_fails_requests_in_flight():
    async def main():
        engine = FakeEngine(SMALL, step_delay=0.01)
        bridge = AsyncEngine(engine, max_queue_len=8)
        bridge.start()
        stream = await bridge.add_request("r", None, SamplingParams(max_tokens=200), [0, 5])
        await stream.__anext__()
        await bridge.stop()
        with pytest.raises(EngineDeadError):
            await _collect(stream)
        with pytest.raises(EngineDeadError):
            await bridge.add_request("late", None, SamplingParams(max_tokens=2), [0, 5])

    run(main())
