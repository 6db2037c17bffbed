"""One streamed completion, timed; the loopback guard; the server's batch counters from /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import time
from urllib.parse import urlsplit

try:  # the openai client's HTTP library; plain httpx where that is what is installed
    import httpx2 as httpx
except ModuleNotFoundError:  # pragma: no cover
    import httpx

from dsjax.loadtest.workload import RequestSpec


def check_loopback(url: str) -> str:
    """The URL, if it points at this machine (127.0.0.0/8, ::1 or localhost); ValueError otherwise.

    A load test is a denial-of-service tool: it only ever runs against a local server."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme not in ("http", "https") or not loopback:
        raise ValueError(f"url={url!r}: accepted http(s) URLs on loopback only (127.0.0.0/8, ::1, localhost)")
    return url.rstrip("/")


@dataclasses.dataclass
class RequestResult:
    index: int
    phase: int
    kind: str
    sent_at: float  # seconds after the start of the run
    status: str  # "ok" or an error kind: http_503, http_400, timeout, connect_error, stream_error, ...
    prompt_tokens: int
    completion_tokens: int = 0
    ttft_s: float | None = None  # to the first chunk carrying text
    tpot_s: float | None = None  # mean time per output token after the first
    e2e_s: float | None = None
    detail: str | None = None


async def send(http: httpx.AsyncClient, spec: RequestSpec, model: str, start: float, timeout_s: float,
               extra: dict) -> RequestResult:
    sent = time.monotonic()
    result = RequestResult(spec.index, spec.phase, spec.kind, sent - start, "ok", len(spec.prompt_token_ids))
    body = {"model": model, "prompt": spec.prompt_token_ids, "max_tokens": spec.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    try:
        await asyncio.wait_for(_stream(http, body, result, sent), timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        result.status, result.detail = "timeout", f"no complete response in {timeout_s}s"
    except httpx.ConnectError as e:
        result.status, result.detail = "connect_error", str(e)
    except httpx.HTTPError as e:
        result.status, result.detail = "transport_error", f"{type(e).__name__}: {e}"
    return result


async def _stream(http: httpx.AsyncClient, body: dict, result: RequestResult, sent: float) -> None:
    first = last = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.status = f"http_{response.status_code}"
            result.detail = (await response.aread()).decode(errors="replace")[:300]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result.status, result.detail = "stream_error", str(event["error"].get("message"))[:300]
                return
            if event.get("usage"):
                result.completion_tokens = event["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in event.get("choices", [])):
                last = time.monotonic()
                first = first or last
    end = time.monotonic()
    result.e2e_s = end - sent
    if first is not None:
        result.ttft_s = first - sent
        if result.completion_tokens > 1:
            result.tpot_s = (last - first) / (result.completion_tokens - 1)


async def scrape_batch_counters(http: httpx.AsyncClient) -> dict[str, float] | None:
    """dsjax's step counters (useful vs padded tokens) from /metrics; None when the server has none."""
    wanted = {"dsjax_step_useful_tokens_total": "useful_tokens", "dsjax_step_padded_tokens_total": "padded_tokens",
              "dsjax_num_preemptions_total": "preemptions"}
    try:
        response = await http.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    counters = {}
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            counters[wanted[name]] = float(value)
    return counters if len(counters) == len(wanted) else None
