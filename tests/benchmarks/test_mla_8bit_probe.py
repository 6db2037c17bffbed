"""The 8-bit decode probe's trace summary, over a hand-written Mosaic GPU trace (the probe itself needs a
Hopper GPU)."""
import json

from benchmarks.common import summarize_trace


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
