"""Numbers from a load test's per-request results: throughput, latency percentiles, errors by kind, per
phase and per second (to see shedding and recovery), batch efficiency from the server's counters."""

from __future__ import annotations

import collections
import math

from dsjax.loadtest.client import RequestResult
from dsjax.loadtest.workload import Phase


def percentiles(values: list[float]) -> dict[str, float] | None:
    """Nearest-rank P50/P90/P99, mean and max; None when empty."""
    if not values:
        return None
    ranked = sorted(values)

    def rank(q: float) -> float:
        return ranked[max(0, math.ceil(q * len(ranked)) - 1)]

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "mean": sum(ranked) / len(ranked),
            "max": ranked[-1], "count": len(ranked)}


def _errors(results: list[RequestResult]) -> dict[str, int]:
    return dict(collections.Counter(r.status for r in results if r.status != "ok"))


def _error_samples(results: list[RequestResult], per_kind: int = 3) -> dict[str, list[str]]:
    samples: dict[str, list[str]] = collections.defaultdict(list)
    for r in results:
        if r.status != "ok" and len(samples[r.status]) < per_kind:
            samples[r.status].append(r.detail or "")
    return dict(samples)


def summarize(results: list[RequestResult], phases: list[Phase], wall_s: float, num_skipped: int,
              counters_before: dict | None, counters_after: dict | None) -> dict:
    ok = [r for r in results if r.status == "ok"]
    output_tokens = sum(r.completion_tokens for r in ok)
    summary = {
        "wall_s": wall_s,
        "requests": {"sent": len(results), "ok": len(ok), "skipped_client_saturated": num_skipped,
                     "errors": _errors(results), "error_samples": _error_samples(results)},
        "throughput": {"requests_per_s": len(ok) / wall_s if wall_s else 0.0,
                       "output_tokens_per_s": output_tokens / wall_s if wall_s else 0.0,
                       "prompt_tokens_per_s": sum(r.prompt_tokens for r in ok) / wall_s if wall_s else 0.0,
                       "output_tokens": output_tokens},
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "batch_efficiency": _batch_efficiency(counters_before, counters_after),
        "phases": [],
        "timeline": _timeline(results),
    }
    start = 0.0
    for p, phase in enumerate(phases):
        mine = [r for r in results if r.phase == p]
        mine_ok = [r for r in mine if r.status == "ok"]
        summary["phases"].append({
            "qps": phase.qps, "start_s": start, "duration_s": phase.duration_s, "sent": len(mine),
            "ok": len(mine_ok), "errors": _errors(mine),
            "success_rate": len(mine_ok) / len(mine) if mine else None,
            "ttft_s": percentiles([r.ttft_s for r in mine_ok if r.ttft_s is not None])})
        start += phase.duration_s
    if len(phases) > 1:
        summary.update(_recovery(results, len(phases) - 1, start - phases[-1].duration_s))
    return summary


RECOVERY_RUN = 5  # consecutive successes that end the last phase for it to count as recovered


def _recovery(results: list[RequestResult], last_phase: int, last_start: float) -> dict:
    """After the overload phases, the last (gentler) phase: the queue built up during the overload drains,
    then every request succeeds. recovery_s: from the phase start to just after its last failure."""
    mine = sorted((r for r in results if r.phase == last_phase), key=lambda r: r.sent_at)
    failures = [r for r in mine if r.status != "ok"]
    recovery_s = max(r.sent_at for r in failures) - last_start if failures else 0.0
    tail = mine[-RECOVERY_RUN:]
    recovered = len(tail) == RECOVERY_RUN and all(r.status == "ok" for r in tail)
    return {"recovered": recovered, "recovery_s": recovery_s if recovered else None}


def _batch_efficiency(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    useful = after["useful_tokens"] - before["useful_tokens"]
    padded = after["padded_tokens"] - before["padded_tokens"]
    return {"useful_tokens": useful, "padded_tokens": padded, "efficiency": useful / padded if padded else None,
            "preemptions": after["preemptions"] - before["preemptions"]}


def _timeline(results: list[RequestResult]) -> list[dict]:
    """Per second of send time: requests sent, succeeded, refused with 503, failed otherwise."""
    seconds: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        bucket = seconds[int(r.sent_at)]
        bucket["sent"] += 1
        bucket["ok" if r.status == "ok" else "http_503" if r.status == "http_503" else "other_errors"] += 1
    return [{"t": t, "sent": c["sent"], "ok": c["ok"], "http_503": c["http_503"], "other_errors": c["other_errors"]}
            for t, c in sorted(seconds.items())]


def render(summary: dict) -> str:
    """A few lines for a terminal."""
    def ms(stats: dict | None, key: str) -> str:
        return "n/a" if not stats else f"{stats[key] * 1e3:.0f} ms"

    req, thr = summary["requests"], summary["throughput"]
    lines = [
        f"requests: {req['sent']} sent, {req['ok']} ok, errors {req['errors'] or '{}'}"
        + (f", {req['skipped_client_saturated']} not sent (client at --max-concurrency)"
           if req["skipped_client_saturated"] else ""),
        f"throughput: {thr['requests_per_s']:.2f} req/s, {thr['output_tokens_per_s']:.1f} output tok/s, "
        f"{thr['prompt_tokens_per_s']:.1f} prompt tok/s over {summary['wall_s']:.1f} s",
        f"TTFT p50 {ms(summary['ttft_s'], 'p50')}, p99 {ms(summary['ttft_s'], 'p99')}; "
        f"TPOT p50 {ms(summary['tpot_s'], 'p50')}, p99 {ms(summary['tpot_s'], 'p99')}; "
        f"e2e p50 {ms(summary['e2e_s'], 'p50')}, p99 {ms(summary['e2e_s'], 'p99')}",
    ]
    eff = summary["batch_efficiency"]
    if eff and eff["efficiency"] is not None:
        lines.append(f"batch efficiency: {eff['efficiency']:.1%} useful of {eff['padded_tokens']:.0f} computed "
                     f"tokens; {eff['preemptions']:.0f} preemptions")
    for i, phase in enumerate(summary["phases"]):
        rate = "n/a" if phase["success_rate"] is None else f"{phase['success_rate']:.0%}"
        lines.append(f"phase {i}: {phase['qps']:g} qps x {phase['duration_s']:g} s: {phase['sent']} sent, "
                     f"{phase['ok']} ok ({rate}), errors {phase['errors'] or '{}'}")
    if summary.get("recovered"):
        lines.append(f"recovered after overload: yes, every request sent more than {summary['recovery_s']:.1f} s "
                     "after it ended succeeded")
    elif "recovered" in summary:
        lines.append(f"recovered after overload: NO (the last {RECOVERY_RUN} requests did not all succeed)")
    return "\n".join(lines)
