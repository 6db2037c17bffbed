"""The load test's parts that need no server: the loopback guard, the workload, the arithmetic."""

from __future__ import annotations

import random

import pytest

from dsjax.loadtest.client import RequestResult, check_loopback
from dsjax.loadtest.report import percentiles, render, summarize
from dsjax.loadtest.workload import MIXED, Phase, Workload, parse_mix, parse_phases, parse_range, schedule


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.9.9.9", "http://localhost:1/",
                                 "http://[::1]:8000", "https://127.0.0.1"])
def test_loopback_accepted(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000",
                                 "http://[::2]:80", "ftp://127.0.0.1", "127.0.0.1:8000", "http://localhost.evil.com"])
def test_non_loopback_refused(url):
    with pytest.raises(ValueError, match="loopback only"):
        check_loopback(url)


def test_mixed_workload_lengths_and_ratios():
    workload = Workload(MIXED, scale=1.0, max_tokens=(16, 32))
    rng = random.Random(0)
    kinds = {"short": 0, "medium": 0, "long": 0}
    for _ in range(2000):
        kind, ids, max_tokens = workload.sample(rng)
        kinds[kind] += 1
        lo, hi = {"short": (64, 256), "medium": (257, 2048), "long": (4096, 4096)}[kind]
        assert lo <= len(ids) <= hi and 16 <= max_tokens <= 32 and all(3 <= t <= 258 for t in ids)
    assert abs(kinds["short"] / 2000 - 0.5) < 0.05 and abs(kinds["long"] / 2000 - 0.2) < 0.05


def test_scale_shrinks_prompts():
    workload = Workload(MIXED, scale=0.1, max_tokens=(32, 32))
    assert workload.prompt_range("long") == (410, 410) and workload.prompt_range("short") == (6, 26)
    assert workload.longest_request() == 442


def test_schedule_is_bounded_in_count_and_time():
    workload = Workload({"short": 1.0}, scale=0.1)
    specs = schedule(workload, [Phase(50, 2), Phase(5, 2)], max_requests=1000, seed=1)
    assert 80 < sum(s.phase == 0 for s in specs) < 125 and sum(s.phase == 1 for s in specs) < 25
    assert all(s.send_at < 4 for s in specs) and [s.index for s in specs] == list(range(len(specs)))
    assert len(schedule(workload, [Phase(50, 2)], max_requests=7)) == 7


def test_parsers_name_what_they_accept():
    assert parse_range("16-64", "max_tokens") == (16, 64) and parse_range("8", "max_tokens") == (8, 8)
    assert parse_mix("short=1,long=1") == {"short": 1.0, "long": 1.0}
    assert parse_phases("40:20,1:15") == [Phase(40, 20), Phase(1, 15)]
    for parse, text, field in [(parse_phases, "40", "phases"), (parse_mix, "short", "mix")]:
        with pytest.raises(ValueError, match=field):
            parse(text)
    with pytest.raises(ValueError, match="mix classes"):
        Workload({"huge": 1.0})


def test_percentiles_nearest_rank():
    stats = percentiles([float(i) for i in range(1, 101)])
    assert (stats["p50"], stats["p90"], stats["p99"], stats["max"]) == (50.0, 90.0, 99.0, 100.0)
    assert percentiles([]) is None


def test_summary_reports_shedding_and_recovery():
    def result(i, phase, status, t):
        return RequestResult(i, phase, "short", t, status, 10, completion_tokens=4 if status == "ok" else 0,
                             ttft_s=0.1, tpot_s=0.01, e2e_s=0.2)

    results = [result(0, 0, "ok", 0.1), result(1, 0, "http_503", 0.2), result(2, 0, "http_503", 1.5),
               result(3, 1, "ok", 2.5), result(4, 1, "ok", 3.5)]
    summary = summarize(results, [Phase(10, 2), Phase(1, 2)], 4.0, 0,
                        {"useful_tokens": 0, "padded_tokens": 0, "preemptions": 0},
                        {"useful_tokens": 90, "padded_tokens": 100, "preemptions": 1})
    assert summary["requests"]["errors"] == {"http_503": 2}
    assert [p["success_rate"] for p in summary["phases"]] == [pytest.approx(1 / 3), 1.0]
    assert summary["batch_efficiency"]["efficiency"] == 0.9
    assert summary["timeline"][0] == {"t": 0, "sent": 2, "ok": 1, "http_503": 1, "other_errors": 0}
    assert summary["recovered"] is False  # fewer than RECOVERY_RUN requests after the overload
    assert "recovered after overload: NO" in render(summary)


def test_recovery_is_the_time_after_which_everything_succeeds():
    def result(i, phase, status, t):
        return RequestResult(i, phase, "short", t, status, 10, completion_tokens=4, ttft_s=0.1, e2e_s=0.2)

    overload = [result(i, 0, "http_503" if i % 2 else "ok", i * 0.1) for i in range(20)]
    recovery = [result(20, 1, "http_503", 2.3)] + [result(21 + i, 1, "ok", 2.5 + i * 0.5) for i in range(6)]
    summary = summarize(overload + recovery, [Phase(10, 2), Phase(2, 4)], 6.0, 0, None, None)
    assert summary["recovered"] is True and summary["recovery_s"] == pytest.approx(0.3)
    assert "recovered after overload: yes, every request sent more than 0.3 s after it ended succeeded" in render(summary)
