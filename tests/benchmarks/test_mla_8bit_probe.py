"""The probes' trace readers (benchmarks.common: the 8-bit decode probe's summary by scope, the persistent
kernels' phases between grid barriers), over hand-written Mosaic GPU traces (the probes need a Hopper GPU)."""
import json

from benchmarks.common import barrier_phases, summarize_trace


def test_summarize_trace_means_each_scope_by_warpgroup(tmp_path):
    events = []
    for block in (1, 2):
        for tid, scopes in ((10 * block, [("scores", 2.0), ("scores", 4.0)]), (10 * block + 1, [("convert", 1.0)])):
            ts = 0.0
            for name, duration in scopes:
                events += [{"name": name, "ph": "B", "ts": ts, "pid": block, "tid": tid},
                           {"name": name, "ph": "E", "ts": ts + duration * block, "pid": block, "tid": tid}]
                ts += 10
    (tmp_path / "kernel-1-trace.json").write_text(json.dumps({"traceEvents": events}))
    table = summarize_trace(str(tmp_path)).splitlines()
    assert table[0] == "| warpgroup | scope | mean_us | per_block |"
    # warpgroup 0 (each block's lowest tid): scores 3 us in block 1, 6 in block 2, two a block
    assert table[2:] == ["| 0 | scores | 4.5 | 2 |", "| 1 | convert | 1.5 | 1 |"]
    assert barrier_phases(str(tmp_path)) is None  # no grid barriers in this kernel


def test_barrier_phases_follow_the_block_that_arrives_last(tmp_path):
    """A two-block persistent kernel's trace: between the releases of its grid barriers, the phase's length
    and the scopes of the block that arrived last."""
    def scopes(block, plan):
        events = [{"name": name, "ph": ph, "ts": ts, "pid": block, "tid": 7}
                  for name, begin, end in plan for ph, ts in (("B", begin), ("E", end))]
        return events + [{"name": "load", "ph": "B", "ts": 0.0, "pid": block, "tid": 8},  # another warpgroup
                         {"name": "load", "ph": "E", "ts": 50.0, "pid": block, "tid": 8}]

    # block 1 arrives last at the second barrier (after q_kv), block 2 at the third (after chunk)
    events = (scopes(1, [("barrier", 0, 1), ("q_kv", 1, 9), ("barrier", 9, 10), ("chunk", 10, 12),
                         ("barrier", 12, 20)])
              + scopes(2, [("barrier", 0, 1.5), ("q_kv", 1.5, 4), ("barrier", 4, 10.5), ("chunk", 10.5, 19),
                           ("barrier", 19, 20.5)]))
    (tmp_path / "kernel-1-trace.json").write_text(json.dumps({"traceEvents": events}))
    table = barrier_phases(str(tmp_path)).splitlines()
    assert table[2:] == ["| 1 | 9 | 1 | q_kv 8.00 |", "| 2 | 10 | 2 | chunk 8.50 |"]
