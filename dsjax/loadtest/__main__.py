"""``python -m dsjax.loadtest --url http://127.0.0.1:8000 --workload mixed --qps 4 --duration 60 --out r.json``

Overload then recovery: ``--phases 40:20,1:15`` (QPS:SECONDS, back to back) instead of --qps/--duration.
"""

from __future__ import annotations

import argparse
import os
import sys

from dsjax.loadtest.report import render
from dsjax.loadtest.runner import LoadTestConfig, run_loadtest
from dsjax.loadtest.workload import WORKLOADS, Phase, Workload, parse_mix, parse_phases, parse_range


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsjax.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed",
                   help="mixed: 50%% short (64-256 tokens), 30%% medium (257-2048), 20%% long (4096)")
    p.add_argument("--mix", help="override the ratios, e.g. short=0.7,medium=0.3")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length (0.1 for a CPU server)")
    p.add_argument("--max-tokens", default="64", help="output tokens per request: N or LO-HI")
    p.add_argument("--qps", type=float, default=2.0, help="mean arrival rate (Poisson)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--phases", help="QPS:SECONDS,... back to back; overrides --qps/--duration")
    p.add_argument("--max-requests", type=int, default=1000, help="stop sending after this many")
    p.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at most")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--api-key", default=os.environ.get("DSJAX_API_KEY"), help="Bearer key (default $DSJAX_API_KEY)")
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--priority", choices=["realtime", "default", "bulk"], help="dsjax scheduling lane")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let EOS end requests early (output lengths then vary)")
    p.add_argument("--token-ids", default="3-258", help="prompt token ids are drawn from LO-HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--label", help="free text stored in the JSON, e.g. how the server was started")
    return p


def config_from_args(argv: list[str] | None = None) -> LoadTestConfig:
    args = build_parser().parse_args(argv)
    mix = parse_mix(args.mix) if args.mix else WORKLOADS[args.workload]
    workload = Workload(mix, args.scale, parse_range(args.max_tokens, "max_tokens"),
                        parse_range(args.token_ids, "token_ids"))
    phases = parse_phases(args.phases) if args.phases else [Phase(args.qps, args.duration)]
    return LoadTestConfig(workload, tuple(phases), args.url, args.max_requests, args.max_concurrency, args.timeout,
                          args.api_key, args.model, args.priority, args.ignore_eos, args.seed, args.out, args.label)


def main(argv: list[str] | None = None) -> dict:
    try:
        config = config_from_args(argv)
    except ValueError as e:
        sys.exit(f"error: {e}")
    summary = run_loadtest(config)
    print(render(summary))
    if config.out:
        print(f"wrote {config.out}")
    return summary


if __name__ == "__main__":
    main()
