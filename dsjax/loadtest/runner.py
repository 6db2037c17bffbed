"""The open-loop load test: requests leave on their Poisson schedule whether or not the server keeps up
(that is what overload looks like), bounded by a request count, the phases' duration plus one request
timeout, and a cap on connections in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import time
from pathlib import Path

from dsjax.loadtest.client import check_loopback, httpx, scrape_batch_counters, send
from dsjax.loadtest.report import summarize
from dsjax.loadtest.workload import Phase, Workload, schedule

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadTestConfig:
    workload: Workload
    phases: tuple[Phase, ...]
    url: str = "http://127.0.0.1:8000"
    max_requests: int = 1000
    max_concurrency: int = 256  # requests in flight; arrivals beyond it are counted, not sent
    timeout_s: float = 120.0  # per request, first byte to [DONE]
    api_key: str | None = None
    model: str | None = None  # default: the first model /v1/models lists
    priority: str | None = None  # dsjax's scheduling lane for every request
    ignore_eos: bool = True  # fixed output lengths, whatever the model draws
    seed: int = 0
    out: str | None = None  # JSON result path
    label: str | None = None  # free text kept in the JSON (e.g. how the server was started)

    def __post_init__(self):
        check_loopback(self.url)
        if not self.phases:
            raise ValueError("phases=(): accepted at least one QPS:SECONDS phase")
        for name in ("max_requests", "max_concurrency"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: accepted an int >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s}: accepted a number > 0")

    def as_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["api_key"] = "***" if self.api_key else None
        return data


def run_loadtest(config: LoadTestConfig) -> dict:
    """Runs the test, writes config.out if set, returns the summary (see report.summarize)."""
    summary = asyncio.run(_run(config))
    if config.out:
        path = Path(config.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


async def _served_model(http) -> tuple[str, int | None]:
    response = await http.get("/v1/models", timeout=10)
    if response.status_code != 200:
        raise RuntimeError(f"GET /v1/models answered {response.status_code}: {response.text[:200]}")
    model = response.json()["data"][0]
    return model["id"], model.get("max_model_len")


async def _run(config: LoadTestConfig) -> dict:
    url = check_loopback(config.url)
    specs = schedule(config.workload, list(config.phases), config.max_requests, config.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # Idle connections expire before uvicorn's 5 s keep-alive does: reusing one the server is closing fails.
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency,
                          keepalive_expiry=2.0)
    timeout = httpx.Timeout(config.timeout_s + 5, connect=10)
    extra = {"ignore_eos": True} if config.ignore_eos else {}
    if config.priority:
        extra["priority"] = config.priority
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as http:
        model, max_model_len = await _served_model(http)
        model = config.model or model
        if max_model_len and config.workload.longest_request() > max_model_len:
            log.warning("the longest request (%d tokens) exceeds the server's max_model_len=%d: expect 400s; "
                        "lower --scale or --max-tokens", config.workload.longest_request(), max_model_len)
        before = await scrape_batch_counters(http)
        start = time.monotonic()
        started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        tasks, in_flight, num_skipped = [], set(), 0
        for spec in specs:
            delay = start + spec.send_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(in_flight) >= config.max_concurrency:
                num_skipped += 1
                continue
            task = asyncio.create_task(send(http, spec, model, start, config.timeout_s, extra))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            tasks.append(task)
        results = await asyncio.gather(*tasks)
        wall_s = time.monotonic() - start
        after = await scrape_batch_counters(http)
    summary = summarize(results, list(config.phases), wall_s, num_skipped, before, after)
    return {"started_at": started_at, "model": model, "config": config.as_json()} | summary
