"""Prometheus metrics of one server, in a registry of its own (several apps can live in one test process).

Request-level metrics are observed where the event happens (the engine thread for tokens and latencies,
the HTTP middleware for status codes). Engine state (queues, KV blocks, prefix hits) is read at scrape
time from the snapshot the engine thread publishes after each step, so a scrape never touches the engine.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds; CPU steps of the tiny model take ~20 ms, a large model's prefill can take seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# snapshot key -> (metric name, help, kind)
_ENGINE_STATE = {
    "num_running": ("dsjax_num_requests_running", "Sequences in the running batch.", "gauge"),
    "num_waiting": ("dsjax_num_requests_waiting", "Sequences waiting for admission (includes not yet added).", "gauge"),
    "num_blocks_total": ("dsjax_kv_blocks_total", "KV cache blocks in the pool.", "gauge"),
    "num_blocks_used": ("dsjax_kv_blocks_used", "KV blocks held by live sequences.", "gauge"),
    "num_blocks_cached": ("dsjax_kv_blocks_cached", "Free KV blocks still holding reusable prefixes.", "gauge"),
    "kv_cache_usage": ("dsjax_kv_cache_usage_ratio", "Fraction of KV blocks held by live sequences.", "gauge"),
    "prefix_cache_hit_rate": ("dsjax_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, "
                              "over prompt tokens looked up, since start.", "gauge"),
    "num_preemptions": ("dsjax_num_preemptions", "Sequences preempted (recomputed later) since start: the "
                        "memory-pressure ladder's third rung.", "counter"),
    "num_prefix_evictions": ("dsjax_kv_prefix_evictions", "Prefix-cache blocks evicted for fresh ones since start: "
                             "the memory-pressure ladder's first rung.", "counter"),
    "num_pressure_compressions": ("dsjax_kv_pressure_compressions", "KV blocks compressed early because the "
                                  "full-precision pool ran out: the ladder's second rung.", "counter"),
    "num_blocks_compressed": ("dsjax_kv_blocks_compressed", "KV blocks moved to the 8-bit pool since start "
                              "(full_precision_window and memory pressure).", "counter"),
    "num_steps": ("dsjax_engine_steps", "Engine steps run since start.", "counter"),
    "num_step_failures": ("dsjax_engine_step_failures", "Engine steps that raised since start.", "counter"),
    "num_useful_tokens": ("dsjax_step_useful_tokens", "Tokens scheduled in engine steps (before padding).", "counter"),
    "num_padded_tokens": ("dsjax_step_padded_tokens", "Tokens computed in engine steps (bucket-padded).", "counter"),
}


class _EngineStateCollector:
    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self):
        state = self._snapshot()
        for key, (name, doc, kind) in _ENGINE_STATE.items():
            if key not in state:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc)
            family.add_metric([], float(state[key]))
            yield family


class ServeMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("dsjax_http_requests", "HTTP requests by route and status code.",
                                     ["route", "code"], registry=r)
        self.requests_finished = Counter("dsjax_requests_finished", "Finished generations by finish reason "
                                         "(one per choice; 'error' when an engine step failed).",
                                         ["finish_reason"], registry=r)
        self.requests_rejected = Counter("dsjax_requests_rejected", "Requests refused before the engine "
                                         "(queue_full, draining, engine_dead).", ["reason"], registry=r)
        self.prompt_tokens = Counter("dsjax_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("dsjax_generation_tokens", "Tokens generated; rate() is tokens/s.",
                                         registry=r)
        self.time_to_first_token = Histogram("dsjax_time_to_first_token_seconds", "Arrival to first token.",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("dsjax_time_per_output_token_seconds",
                                               "Mean inter-token time after the first, per choice.",
                                               buckets=_TPOT_BUCKETS, registry=r)
        self.e2e_latency = Histogram("dsjax_e2e_request_latency_seconds", "Arrival to last token.",
                                     buckets=_LATENCY_BUCKETS, registry=r)

    def watch_engine(self, snapshot: Callable[[], dict]) -> None:
        self.registry.register(_EngineStateCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
