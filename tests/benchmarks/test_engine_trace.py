"""benchmarks/engine_trace.py: how a trace's device ops are read as step cycles and matched to the host's
dispatches, and the script's run on the tiny preset (the CPU trace has no device ops, only the host's spans)."""

from __future__ import annotations

import pytest

from benchmarks import engine_trace


def op(name, ts, dur):
    return {"name": name, "ts": ts, "dur": dur, "ph": "X", "pid": 1}


# Three steps of a 'step' kernel (the most time: the marker) and a small 'head' op each: the second step starts
# 50 µs after the first one's head ends (the device idle), the third right after the second's head.
OPS = [op("step", 0, 100), op("head", 101, 10), op("step", 161, 100), op("head", 262, 10), op("step", 273, 120),
       op("head", 394, 10)]


def test_cycles_run_from_one_marker_start_to_the_next():
    cycles = engine_trace.device_cycles(OPS)
    assert [c["start_us"] for c in cycles] == [0, 161]
    assert [c["cycle_us"] for c in cycles] == [161, 112]
    assert [c["marker_us"] for c in cycles] == [100, 100]
    # gaps under _IDLE_US (1 µs between ops here) are launch latency, not idle time
    assert cycles[0]["idle_us"] == pytest.approx(50) and cycles[0]["gap_before"] == "step"
    assert cycles[1]["idle_us"] == 0 and cycles[1]["largest_gap_us"] == 0


def test_each_dispatch_is_matched_to_the_next_marker_it_queued():
    # the first marker started before the traced dispatches (a step queued earlier): it is skipped; the second
    # step was queued 5 µs before it ran after 50 µs of idle (the host late), the third 100 µs ahead
    dispatches = [(60, 156), (150, 173)]
    rows = engine_trace.match_dispatches(OPS, dispatches)
    assert [r["queued_us"] for r in rows] == [5, 100]
    assert [r["device_idle_before_us"] for r in rows] == [50, 1]
    assert [r["dispatch_us"] for r in rows] == [96, 23]


def test_host_copies_say_whether_they_waited_behind_the_next_step():
    # step 0 ends at 100: its copy starts at 103; step 1 (161-261) ends at 261: its copy starts after step 2 began
    ops = OPS + [op("MemcpyD2H", 103, 1), op("MemcpyD2H", 280, 1)]
    rows = engine_trace.host_copies(ops)
    assert [r["after_step_us"] for r in rows] == [3, 19]
    assert [r["behind_next_step"] for r in rows] == [False, True]


def test_the_engine_trace_runs_on_the_tiny_preset(tmp_path):
    payload = engine_trace.main(["--steps", "4", "--copy-ab", "1", "--out", str(tmp_path)])
    assert payload["untraced"]["steps_timed"] == 4 and payload["traced_steps"]["steps"] == 4
    assert [r["copy_at_dispatch"] for r in payload["copy_ab"]] == [False, True]
    host = payload["engine_trace"]["host_us"]
    # every annotated span was recorded, once a traced step each (the step, and what it calls)
    assert set(host) == set(engine_trace.HOST_SPANS) and all(host[name] for name in engine_trace.HOST_SPANS)
    assert (tmp_path / "engine_trace.json").is_file()
