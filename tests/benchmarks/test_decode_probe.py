"""benchmarks/decode_probe.py: how a decode point's step and tokens a second are counted."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from benchmarks import decode_probe
from dsjax import LLM


def test_measure_counts_tokens_over_elapsed_time(monkeypatch):
    """The timed steps last 1, 1, 1 and 5 ms by the probe's clock, starting 1, 1 and 2 ms after the last one's
    end: 12 ms pass from the first start to the last end, a step is 3 ms of elapsed time and batch 2 decodes 667
    tokens a second, where the median step (kept as step_median_ms) would have said 1 ms and 2000 tokens, and the
    steps' sum 2 ms."""
    llm = LLM("tiny", dtype="float32", kernel_backend="reference", max_num_seqs=2, max_num_batched_tokens=16,
              max_model_len=32, block_size=8, buckets=(2, 16))
    ticks = iter([0, 1, 2, 3, 4, 5, 7, 12])  # ms: each timed step's start, then its end

    def perf_counter():
        return next(ticks) * 1e-3

    monkeypatch.setattr(decode_probe, "time", SimpleNamespace(perf_counter=perf_counter, thread_time=time.thread_time))
    row = decode_probe.measure(llm, 2, 4, 4, warmup_steps=1)
    assert row["steps_timed"] == 4 and row["preemptions"] == 0
    assert row["step_ms"] == pytest.approx(3.0) and row["tok_per_s"] == pytest.approx(2000 / 3)
    assert row["step_median_ms"] == pytest.approx(1.0)
    assert row["step_p10_ms"] == pytest.approx(1.0) and row["step_p90_ms"] == pytest.approx(3.8)
